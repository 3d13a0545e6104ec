"""Prometheus metrics for the gateway.

Children with fixed labels are resolved once and cached, and per-stream counts are accumulated
in locals and added once when the stream ends: the per-token path touches no metric at all.

The request path's children (``GatewayMetrics.child``) also add to prometheus_client's values
directly (``_Fast*``): its own ``inc``/``observe`` are four or five Python calls each with a lock
(a histogram walks its buckets in Python), ~60 calls for a request's dozen updates. Every write
happens on the event loop's thread, the only one that updates metrics, so the lock has nothing to
guard against; a scrape still reads the same values through prometheus_client.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from typing import Any, ClassVar

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.values import MutexValue

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)
# seconds per output token: a fast decode is a few ms a token, a starved one a second or two
_TOKEN_BUCKETS = (
    0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.5, 0.75, 1.0, 2.0,
)


class GatewayMetrics:
    """All of the gateway's series, registered on one registry (one per gateway instance)."""

    content_type: ClassVar[str] = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        if registry is None:
            registry = CollectorRegistry()
            ProcessCollector(registry=registry)
            PlatformCollector(registry=registry)
        self.registry = registry
        self._children: dict[tuple[object, tuple[str, ...]], Any] = {}
        self.requests = Counter(
            "sluicegate_requests_total",
            "Requests answered, by route, model, HTTP status and client transport (h1, h2, h3, grpc-web).",
            ["route", "model", "status", "transport"],
            registry=registry,
        )
        self.request_duration = Histogram(
            "sluicegate_request_duration_seconds",
            "Whole request time, from the request's arrival to its last byte.",
            ["route", "model"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.time_to_first_token = Histogram(
            "sluicegate_time_to_first_token_seconds",
            "From the request's arrival to the first token sent to the client, by the client's transport.",
            ["model", "transport"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.in_flight = Gauge(
            "sluicegate_in_flight_requests",
            "Requests being relayed right now, per pod.",
            ["pod"],
            registry=registry,
        )
        self.upstream_errors = Counter(
            "sluicegate_upstream_errors_total",
            "Failures talking to a pod, by kind (connect, status, protocol, broken_stream).",
            ["pod", "kind"],
            registry=registry,
        )
        self.timeouts = Counter(
            "sluicegate_timeouts_total",
            "Requests ended by a timeout, by stage (connect, first_token, stall, total).",
            ["stage"],
            registry=registry,
        )
        self.upstream_attempts = Counter(
            "sluicegate_upstream_attempts_total",
            "Attempts to get an answer from a pod, by outcome (ok, connect_error, connect_timeout, "
            "reset, status_502, status_503, first_token_timeout, failed).",
            ["outcome"],
            registry=registry,
        )
        self.retries_denied = Counter(
            "sluicegate_retry_budget_exhausted_total",
            "Retryable failures not retried because the retry budget was spent.",
            registry=registry,
        )
        self.stream_resumes = Counter(
            "sluicegate_stream_resumes_total",
            "Broken streams continued on another pod, by outcome (ok, failed, unsupported).",
            ["outcome"],
            registry=registry,
        )
        self.rollback_resumed_streams = Counter(
            "sluicegate_rollback_resumed_streams_total",
            "Canary streams in flight when their route's rollout rolled back with on_rollback: resume, "
            "by outcome (resumed: continued on stable; failed: no stable pod could; finished: stayed "
            "on the canary, since resume is off for it, refuses it or it had no first token yet).",
            ["model", "outcome"],
            registry=registry,
        )
        self.client_disconnects = Counter(
            "sluicegate_client_disconnects_total",
            "Clients that went away before their answer was complete.",
            ["model"],
            registry=registry,
        )
        self.variant_requests = Counter(
            "sluicegate_variant_requests_total",
            "Requests to a canary route, by its model as sent upstream, variant and HTTP status.",
            ["model", "variant", "status"],
            registry=registry,
        )
        self.variant_time_to_first_token = Histogram(
            "sluicegate_variant_time_to_first_token_seconds",
            "Time to first token of a canary route's streams, by variant (stable and canary side by side).",
            ["model", "variant"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.time_per_output_token = Histogram(
            "sluicegate_time_per_output_token_seconds",
            "Inter-token latency of each successful stream: (duration - time to first token) / "
            "(output tokens - 1), output tokens from the pod's usage or else upstream reads, so an "
            "approximation where a read holds several tokens. Variant 'none' outside canary routes.",
            ["model", "variant", "transport"],
            buckets=_TOKEN_BUCKETS,
            registry=registry,
        )
        self.variant_tokens = Counter(
            "sluicegate_tokens_by_variant_total",
            "Tokens the pods reported per request, by kind (prompt, completion) and the canary route's "
            "variant ('none' outside canary routes).",
            ["model", "variant", "kind"],
            registry=registry,
        )
        # shadow traffic (gateway/canary/shadow.py): copies to a canary whose answers nobody reads
        self.shadow_requests = Counter(
            "sluicegate_shadow_requests_total",
            "Shadow copies of canary-route requests, by the shadow variant's upstream model, variant and "
            "outcome (ok, error, timeout, client_gone, skipped).",
            ["model", "variant", "outcome"],
            registry=registry,
        )
        self.shadow_time_to_first_token = Histogram(
            "sluicegate_shadow_time_to_first_token_seconds",
            "Time to first token of shadow copies (streams), from the copy's start.",
            ["model", "variant"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.shadow_duration = Histogram(
            "sluicegate_shadow_duration_seconds",
            "Whole time of shadow copies that ended ok, from the copy's start to the answer's last byte.",
            ["model", "variant"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.stream_chunks = Counter(
            "sluicegate_stream_chunks_total",
            "Upstream reads relayed to streaming clients (each holds one or more SSE events).",
            ["model"],
            registry=registry,
        )
        self.tokens = Counter(
            "sluicegate_tokens_total",
            "Tokens reported in pods' usage objects, by kind (prompt, completion).",
            ["model", "kind"],
            registry=registry,
        )
        self.pod_up = Gauge(
            "sluicegate_pod_up",
            "1 when the pod answered its last discovery probe, else 0.",
            ["pod"],
            registry=registry,
        )

        self.pod_state = Gauge(
            "sluicegate_pod_state",
            "1 for the pod's current health state (healthy, degraded, unhealthy, draining), else 0.",
            ["pod", "state"],
            registry=registry,
        )
        self.pod_breaker = Gauge(
            "sluicegate_pod_breaker",
            "1 for the pod's current breaker state (closed, open, half_open), by cause (pressure, outlier).",
            ["pod", "cause", "state"],
            registry=registry,
        )
        self.pod_transitions = Counter(
            "sluicegate_pod_transitions_total",
            "Changes of a pod's health or breaker state.",
            ["pod", "kind", "to"],
            registry=registry,
        )
        self.pod_kv_cache_usage = Gauge(
            "sluicegate_pod_kv_cache_usage",
            "KV-cache usage the pod reported at its last scrape (0..1).",
            ["pod"],
            registry=registry,
        )
        self.pod_waiting = Gauge(
            "sluicegate_pod_waiting_requests",
            "Requests waiting in the pod's queue at its last scrape.",
            ["pod"],
            registry=registry,
        )
        self.shed = Counter(
            "sluicegate_shed_total",
            "Requests answered 429 or 503 because no pod could take them, by criticality and reason.",
            ["model", "criticality", "reason"],
            registry=registry,
        )
        self.affinity = Counter(
            "sluicegate_affinity_total",
            "Requests with an affinity key: 'home' went to the key's own pod, 'moved' to another because "
            "that pod was unfit, full or far busier than the rest.",
            ["model", "outcome"],
            registry=registry,
        )
        self.degraded = Counter(
            "sluicegate_degraded_total",
            "Streaming requests served without streaming because the pod streamed slowly, by tier.",
            ["model", "tier"],
            registry=registry,
        )
        self.fail_open = Gauge(
            "sluicegate_fail_open",
            "1 while every pod of the model has stale metrics and routing ignores pressure.",
            ["model"],
            registry=registry,
        )
        self.panic = Gauge(
            "sluicegate_panic",
            "1 while probes alone would leave too few of the model's pods routable (healthy panic "
            "threshold): routing spans every live pod, device faults still excluded.",
            ["model"],
            registry=registry,
        )
        self.probes = Histogram(
            "sluicegate_probe_duration_seconds",
            "Round trip of each /health probe as the prober's own thread timed it, by outcome.",
            ["pod", "outcome"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
            registry=registry,
        )
        self.probes_excused = Counter(
            "sluicegate_probe_timeouts_excused_total",
            "Probe timeouts not held against a pod because it served live traffic within the passive window.",
            ["pod"],
            registry=registry,
        )
        self.quota_store_mode = Gauge(
            "sluicegate_quota_store_mode",
            "1 for where quota counters are kept now: redis, or while Redis is down local "
            "(fail_open quotas) and closed (fail_closed quotas answering 503).",
            ["mode"],
            registry=registry,
        )
        self.quota_decisions = Counter(
            "sluicegate_quota_decisions_total",
            "Quota admissions by outcome (admitted, refused, and the same decided while Redis is down).",
            ["outcome"],
            registry=registry,
        )
        self.quota_redis_seconds = Histogram(
            "sluicegate_quota_redis_seconds",
            "Round trip of each admission's Redis script, by outcome (ok, error: failed or timed out).",
            ["outcome"],
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1),
            registry=registry,
        )
        # config reloads (gateway/reload.py): SIGHUP, a changed file or POST /admin/reload
        self.config_reloads = Counter(
            "sluicegate_config_reloads_total",
            "Config reloads by outcome (ok: applied or nothing to apply; error: the file was refused).",
            ["outcome"],
            registry=registry,
        )
        self.config_reloaded = Gauge(
            "sluicegate_config_last_reload_timestamp_seconds",
            "When the running config was last loaded (start-up, or the last reload that applied).",
            registry=registry,
        )
        self.config_reloaded.set_to_current_time()

    def watch_runtime(self, tasks: Callable[[], int], upstream_connections: Callable[[], int]) -> None:
        """Gauges read at scrape time, so a leak of tasks or pod connections shows on a graph."""
        Gauge(
            "sluicegate_asyncio_tasks",
            "asyncio tasks alive in the gateway's event loop.",
            registry=self.registry,
        ).set_function(tasks)
        Gauge(
            "sluicegate_upstream_connections",
            "Open connections to pods (busy and idle keep-alive).",
            registry=self.registry,
        ).set_function(upstream_connections)

    def watch_key_store(self, store: Any) -> None:
        """The key store's size and reloads, read from it at scrape time (no per-request work)."""
        self.registry.register(_KeyStoreCollector(store))

    def watch_rollouts(self, rollouts: Any) -> None:
        """Each rollout's canary weight, step and state, read from it at scrape time."""
        self.registry.register(_RolloutCollector(rollouts))

    def child(self, metric: Counter | Gauge | Histogram, *labels: str) -> Any:
        """``metric.labels(*labels)``, resolved once (prometheus_client's own lookup costs a few
        microseconds per call, which the per-request path pays several times over), as a child
        that updates its values directly (see the module doc). Only for the event loop's thread."""
        key = (metric, labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = fast_child(metric.labels(*labels))
        return found

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _KeyStoreCollector:
    """``sluicegate_api_keys`` and ``sluicegate_key_store_reloads_total{outcome}`` from the store's
    own counters (``KeyStore.reloads``, ``reload_errors``)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def collect(self) -> Any:
        keys = GaugeMetricFamily("sluicegate_api_keys", "API keys in force in the key store.")
        keys.add_metric([], len(self.store))
        yield keys
        reloads = CounterMetricFamily(
            "sluicegate_key_store_reloads",
            "Key store re-reads after its file changed, by outcome (on an error the last good keys stay).",
            labels=["outcome"],
        )
        reloads.add_metric(["ok"], getattr(self.store, "reloads", 0))
        reloads.add_metric(["error"], getattr(self.store, "reload_errors", 0))
        yield reloads


class _RolloutCollector:
    """``sluicegate_rollout_canary_percent``, ``_step`` and ``_state`` per route (a handful of
    routes, four states: bounded)."""

    def __init__(self, rollouts: Any) -> None:
        self.rollouts = rollouts

    def collect(self) -> Any:
        percent = GaugeMetricFamily(
            "sluicegate_rollout_canary_percent", "The canary's share of the route's callers now.",
            labels=["model"],
        )
        step = GaugeMetricFamily(
            "sluicegate_rollout_step", "The rollout's step (0 is the first).", labels=["model"]
        )
        state = GaugeMetricFamily(
            "sluicegate_rollout_state",
            "1 for the rollout's state: progressing, paused, promoted, rolled_back.",
            labels=["model", "state"],
        )
        for model, rollout in self.rollouts.active.items():
            percent.add_metric([model], rollout.canary_percent)
            step.add_metric([model], rollout.step)
            for name in ("progressing", "paused", "promoted", "rolled_back"):
                state.add_metric([model, name], 1 if rollout.state == name else 0)
        yield percent
        yield step
        yield state


def fast_child(child: Any) -> Any:
    """``child`` (a labelled Counter, Gauge or Histogram) with ``inc``/``dec``/``set``/``observe``
    that write its values directly; ``child`` itself where its values are not the single-process
    kind this knows (prometheus_client's multiprocess mode, a Gauge's "mostrecent" mode)."""
    if isinstance(child, Histogram):
        parts = [child._sum, *child._buckets]
        if all(type(v) is MutexValue for v in parts):
            return _FastHistogram(child)
        return child
    if type(getattr(child, "_value", None)) is not MutexValue:
        return child
    if isinstance(child, Counter):
        return _FastCounter(child._value)
    if isinstance(child, Gauge) and not child._is_most_recent:
        return _FastGauge(child._value)
    return child


class _FastCounter:
    __slots__ = ("_value",)

    def __init__(self, value: MutexValue) -> None:
        self._value = value

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self._value._value += amount


class _FastGauge:
    __slots__ = ("_value",)

    def __init__(self, value: MutexValue) -> None:
        self._value = value

    def inc(self, amount: float = 1) -> None:
        self._value._value += amount

    def dec(self, amount: float = 1) -> None:
        self._value._value -= amount

    def set(self, value: float) -> None:
        self._value._value = float(value)


class _FastHistogram:
    """``observe`` as prometheus_client's: the sum, and the first bucket whose bound is not below
    the value (found by bisection; its buckets are cumulated when scraped)."""

    __slots__ = ("_bounds", "_buckets", "_sum")

    def __init__(self, child: Histogram) -> None:
        self._sum: MutexValue = child._sum
        self._buckets: list[MutexValue] = list(child._buckets)
        self._bounds: list[float] = list(child._upper_bounds)

    def observe(self, amount: float) -> None:
        self._sum._value += amount
        if amount == amount:  # NaN is in no bucket (prometheus_client compares it with each bound)
            self._buckets[bisect_left(self._bounds, amount)]._value += 1
