"""The pod registry: every pod's identity and live state, in one place.

Background loops (discovery, probes, scrapes, device health) write it; the request path only reads
it to pick a pod, and reports each attempt's outcome back (the outlier breaker learns there). No
other module keeps a pod list.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import random
import ssl
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol
from urllib.parse import urlsplit

from gateway.config import HealthConfig, PodConfig
from gateway.metrics import GatewayMetrics
from gateway.pods.credentials import ApiKey, PodAccess
from gateway.pods.state import (
    BREAKER_STATES,
    CLOSED,
    HALF_OPEN,
    HEALTH_STATES,
    OPEN,
    HealthState,
    Load,
    OutlierDetector,
    PressureBreaker,
)

log = logging.getLogger("sluicegate.pods")

# Load score weights: KV-cache usage (0..1) and the waiting queue relative to its high mark dominate;
# this gateway's own in-flight count breaks ties and covers the time between two scrapes.
_IN_FLIGHT_WEIGHT = 0.02

_MODE_LOG = {  # (mode, entering) -> (log level, what the operator reads)
    ("fail_open", True): (logging.WARNING,
                          "no fresh metrics from any pod: routing on in-flight counts alone"),
    ("fail_open", False): (logging.INFO, "fresh metrics again: pressure-aware routing resumed"),
    ("panic", True): (logging.WARNING,
                      "too few pods pass their probes (panic threshold): routing across every live pod"),
    ("panic", False): (logging.WARNING, "enough pods pass their probes again: panic routing over"),
}

_NO_ACCESS = PodAccess()  # no keys; the system trust store for https:// pods (built when first needed)


class PodFilter(Protocol):
    """Which pods a request may go to (a canary route's variant: ``gateway.canary.routing``)."""

    def matches(self, pod_labels: Mapping[str, str]) -> bool: ...


class Pod:
    """One pod: what it is (from config) and how it is doing now (mutated on the event loop)."""

    __slots__ = (
        "_key",
        "config",
        "health",
        "host",
        "in_flight",
        "last_error",
        "last_probe",
        "load",
        "models",
        "name",
        "outlier",
        "passive_window_s",
        "port",
        "pressure",
        "reachable",
        "served_at",
        "server_name",
        "tls",
        "url",
        "waiting_high",
    )

    def __init__(
        self, config: PodConfig, health: HealthConfig | None = None, access: PodAccess | None = None
    ) -> None:
        health = health or HealthConfig()
        access = access or _NO_ACCESS
        self.config = config
        self.name = config.name
        self.url = config.url
        parts = urlsplit(config.url)
        self.host = parts.hostname or "127.0.0.1"
        https = parts.scheme == "https"
        # https:// pods: the one shared client context, and the name their certificate must carry
        self.tls: ssl.SSLContext | None = access.context if https else None
        self.server_name: str | None = (access.server_name or self.host) if https else None
        self.port = parts.port or (443 if https else 80)
        self._key: ApiKey | None = access.key_for(config.credentials)
        self.models: frozenset[str] = frozenset(config.models)
        # Pods with configured models are routable until a probe says otherwise; pods whose
        # models must be discovered are not, until discovery has asked them.
        self.reachable = bool(config.models)
        self.in_flight = 0
        self.last_error: str | None = None
        self.last_probe: float | None = None
        self.health = HealthState(health.probe)
        self.pressure = PressureBreaker(health.pressure)
        self.outlier = OutlierDetector(health.outlier)
        self.load = Load()
        self.waiting_high = health.pressure.waiting_high
        self.served_at = -1e9  # when live traffic last got a first token or a 2xx from it (monotonic)
        self.passive_window_s = health.probe.passive_window_s

    @property
    def auth_header(self) -> bytes | None:
        """The ``authorization`` value this pod wants (``Bearer KEY``), or None: its own key, else
        ``upstream.credentials``. Read per request: a rotated key file is picked up."""
        key = self._key
        return None if key is None else key.header

    @property
    def routable(self) -> bool:
        """Healthy enough for traffic (pressure and ejections aside)."""
        return self.reachable and bool(self.models) and self.health.routable

    @property
    def alive(self) -> bool:
        """Could be serving, whatever its probes say: reachable and not condemned (no device fault,
        not draining, not a pod that said it is broken). The panic threshold routes across these."""
        return self.reachable and bool(self.models) and not self.health.condemned

    def serving(self, now: float) -> bool:
        """Whether live traffic got a first token or a 2xx answer from it within the passive window."""
        return now - self.served_at <= self.passive_window_s

    def fresh(self, now: float, stale_after_s: float) -> bool:
        return self.load.scraped_at is not None and now - self.load.scraped_at <= stale_after_s

    def score(self) -> float:
        """Lower is better: how full the pod's GPU is, by its own metrics and our in-flight count."""
        load = self.load
        score = _IN_FLIGHT_WEIGHT * self.in_flight
        if load.kv_cache_usage is not None:
            score += load.kv_cache_usage
        if load.waiting is not None:
            score += load.waiting / self.waiting_high
        return score

    def snapshot(self, now: float | None = None, stale_after_s: float = 5.0) -> dict[str, Any]:
        mig = self.config.mig
        now = time.monotonic() if now is None else now
        load = self.load
        return {
            "name": self.name,
            "url": self.url,
            "models": sorted(self.models),
            "models_source": "config" if self.config.models else "discovered",
            "mig": mig.model_dump() if mig else None,
            "labels": dict(self.config.labels),
            "state": {
                "reachable": self.reachable,
                "routable": self.routable,
                "health": self.health.state,
                "health_reason": self.health.reason,
                "device_fault": self.health.device_fault,
                "breaker": {
                    "pressure": OPEN if self.pressure.open else CLOSED,
                    "pressure_reason": self.pressure.reason or None,
                    "outlier": self.outlier.state,
                    "outlier_reason": self.outlier.reason or None,
                    "ejections": self.outlier.ejections,
                },
                "load": {
                    "kv_cache_usage": load.kv_cache_usage,
                    "running": load.running,
                    "waiting": load.waiting,
                    "itl_p95_ms": None if load.itl_p95_s is None else round(load.itl_p95_s * 1000, 1),
                    "fresh": self.fresh(now, stale_after_s),
                    "age_s": None if load.scraped_at is None else round(now - load.scraped_at, 3),
                },
                "in_flight": self.in_flight,
                "last_served_age_s": round(now - self.served_at, 3) if self.served_at > 0 else None,
                "last_error": self.last_error,
                "last_probe_age_s": None
                if self.last_probe is None
                else round(time.monotonic() - self.last_probe, 3),
            },
        }


class PodRegistry:
    """Holds the pods and answers "which pod should take this model's next request?"."""

    def __init__(
        self,
        pods: Iterable[PodConfig],
        health: HealthConfig | None = None,
        metrics: GatewayMetrics | None = None,
        access: PodAccess | None = None,
    ) -> None:
        self.health_config = health or HealthConfig()
        self.metrics = metrics
        self.access = access or _NO_ACCESS  # keys and TLS for the pods (PodAccess.from_config at start)
        self.pods: tuple[Pod, ...] = tuple(Pod(p, self.health_config, self.access) for p in pods)
        self._by_model: dict[str, tuple[Pod, ...]] = {}
        self._tiebreak = itertools.count()
        self.failing_open: set[str] = set()  # models routed without pressure data (all stale)
        self.panicking: set[str] = set()  # models routed across every live pod (panic threshold)
        # A worker of ``serve --workers N`` also sends each outcome to the supervisor, whose breakers
        # decide on the whole host's traffic: (pod name, failure or None for a success, when).
        self.outcomes: Callable[[str, str | None, float], None] | None = None
        self.reindex()
        for pod in self.pods:
            self._publish(pod)

    def reindex(self) -> None:
        """Rebuild the model → pods index; call after any pod's models change."""
        index: dict[str, list[Pod]] = {}
        for pod in self.pods:
            for model in pod.models:
                index.setdefault(model, []).append(pod)
        self._by_model = {model: tuple(pods) for model, pods in index.items()}

    def sync(self, configs: Iterable[PodConfig]) -> None:
        """Make the pod set match ``configs`` (from Kubernetes or DNS); pods that stay keep their state."""
        by_name = {pod.name: pod for pod in self.pods}
        pods = []
        for config in configs:
            pod = by_name.get(config.name)
            if pod is None or pod.config.url != config.url:
                pod = Pod(config, self.health_config, self.access)
                log.info("pod %s added at %s", pod.name, pod.url)
                self._publish(pod)
            else:
                pod.config = config
                pod._key = self.access.key_for(config.credentials)
                if config.models:
                    pod.models = frozenset(config.models)
            pods.append(pod)
        for gone in set(by_name) - {p.name for p in pods}:
            log.info("pod %s removed", gone)
            self._unpublish(gone)
        self.pods = tuple(pods)
        self.reindex()

    def knows(self, model: str) -> bool:
        return model in self._by_model

    def models(self) -> list[str]:
        """Every model some pod serves (reachable or not), sorted."""
        return sorted(self._by_model)

    def routable_models(self) -> list[str]:
        return sorted(m for m, pods in self._by_model.items() if self._routable(m, pods))

    def _routable(self, model: str, candidates: tuple[Pod, ...]) -> list[Pod]:
        """The model's pods that health allows: the routable ones, or, below the panic threshold,
        every live one.

        Envoy's healthy panic threshold: when probes alone would leave fewer than
        ``panic_threshold_percent`` of the pods that could be serving, the probes are more likely
        wrong (an overload that slows ``/health`` everywhere, a probe path problem) than that many
        pods broken at once; routing across all of them beats refusing everyone. Pods with a device
        fault, draining, or that said they are broken are never included.
        """
        routable = [p for p in candidates if p.routable]
        threshold = self.health_config.panic_threshold_percent
        # live pods are a subset of the candidates: only when too few of *those* are routable can a
        # panic be due, so the usual request (every pod healthy) does not build the second list
        if len(routable) * 100 < threshold * len(candidates):
            alive = [p for p in candidates if p.alive]
            if len(routable) * 100 < threshold * len(alive):
                self._set_mode("panic", model, self.panicking, True)
                return alive
        self._set_mode("panic", model, self.panicking, False)
        return routable

    def pick(
        self,
        model: str,
        exclude: tuple[Pod, ...] = (),
        criticality: str = "standard",
        now: float | None = None,
        affinity: str | None = None,
        max_load_factor: float = 1.5,
        pods: PodFilter | None = None,
    ) -> Pod | None:
        """The best pod for ``model``'s next request, or None when none can take it.

        A pod qualifies when it is healthy (or degraded), its outlier breaker admits a request (a
        half-open one admits a single trial), and its GPU is not under pressure: critical requests
        ignore the pressure breaker, sheddable ones stop at lower marks. A pod whose metrics are
        stale counts as saturated, unless every pod of the model is stale: then routing fails open
        on in-flight counts rather than refusing everything. Among the qualified, the better of two
        (power of two choices), so that many gateway replicas do not herd onto one pod; ties rotate.
        ``exclude`` holds pods this request already tried. With an ``affinity`` key, the key's own
        pod among the qualified (see ``_by_affinity``) instead. ``pods`` keeps only the pods of a
        canary route's variant (their labels match).
        """
        candidates = self._by_model.get(model)
        if candidates and pods is not None:
            candidates = tuple(p for p in candidates if pods.matches(p.config.labels))
        if not candidates:
            return None
        now = time.monotonic() if now is None else now
        stale_after = self.health_config.scrape.stale_after_s
        eligible = self._routable(model, candidates)
        usable = [p for p in eligible if p not in exclude and p.outlier.admits()]
        if not usable:
            return None
        fresh = [p for p in usable if p.fresh(now, stale_after)]
        if fresh:
            self._set_fail_open(model, False)
            if criticality != "critical":
                fresh = [p for p in fresh if not p.pressure.open]
                if criticality == "sheddable":
                    fresh = [p for p in fresh if p.pressure.admits_sheddable(p.load)]
            usable = fresh
        elif all(not p.fresh(now, stale_after) for p in eligible):
            self._set_fail_open(model, True)
        else:
            usable = []
        if not usable:
            return None
        pod = None
        if affinity is not None:
            pod = self._by_affinity(model, candidates, usable, affinity, max_load_factor)
        if pod is None:
            pod = self._better_of_two(usable)
        if pod.outlier.state == HALF_OPEN:
            pod.outlier.trial_out = True
        return pod

    def _better_of_two(self, pods: list[Pod]) -> Pod:
        n = len(pods)
        if n == 1:
            return pods[0]
        if n == 2:
            first = next(self._tiebreak) % 2
            a, b = pods[first], pods[1 - first]
        else:
            a, b = random.sample(pods, 2)
        return b if b.score() < a.score() else a

    def _by_affinity(
        self, model: str, candidates: tuple[Pod, ...], usable: list[Pod], key: str, max_load_factor: float
    ) -> Pod | None:
        """The first pod in ``key``'s rendezvous order that qualified and is not far busier than the rest.

        Rendezvous (highest random weight) hashing ranks every pod of the model by a hash of the key
        and the pod's name: replicas agree without sharing state, and a pod that leaves or is unfit
        hands on only its own keys, each to its next pod in order. Bounded as in consistent hashing
        with bounded loads: a pod over ``max_load_factor`` x the mean in-flight (plus one) is passed
        over. None (load balancing decides) when every qualified pod is over that bound.
        """
        ranked = sorted(candidates, key=lambda pod: _weight(key, pod.name), reverse=True)
        qualified = set(usable)
        bound = max_load_factor * sum(p.in_flight for p in usable) / len(usable) + 1
        for pod in ranked:
            if pod in qualified and pod.in_flight <= bound:
                outcome = "home" if pod is ranked[0] else "moved"
                if self.metrics is not None:
                    self.metrics.child(self.metrics.affinity, model, outcome).inc()
                return pod
        if self.metrics is not None:
            self.metrics.child(self.metrics.affinity, model, "moved").inc()
        return None

    def _set_fail_open(self, model: str, failing: bool) -> None:
        self._set_mode("fail_open", model, self.failing_open, failing)

    def _set_mode(self, mode: str, model: str, models: set[str], on: bool) -> None:
        """Enter or leave a routing mode (``fail_open``, ``panic``) for a model: log it and set the
        gauge of the same name."""
        if on == (model in models):
            return
        if on:
            models.add(model)
        else:
            models.discard(model)
        level, what = _MODE_LOG[mode, on]
        log.log(level, "%s: %s", model, what)
        if self.metrics is not None:
            getattr(self.metrics, mode).labels(model).set(1 if on else 0)

    def shed_reason(
        self, model: str, criticality: str, now: float | None = None, only: PodFilter | None = None
    ) -> tuple[int, str, int]:
        """Why ``pick`` found nothing: (status, reason, Retry-After seconds).

        429 when pods are healthy but full or ejected (capacity comes back by itself), 503 when no
        pod of the model (of the variant, with ``only``) is healthy at all.
        """
        now = time.monotonic() if now is None else now
        candidates = self._by_model.get(model, ())
        if only is not None:
            candidates = tuple(p for p in candidates if only.matches(p.config.labels))
        pods = self._routable(model, candidates)
        if not pods:
            return 503, "no_healthy_pod", 5
        waits = []
        for pod in pods:
            if pod.outlier.state == OPEN:
                waits.append(max(1.0, pod.outlier.ejected_until - now))
            load = pod.load
            if load.waiting and load.drain_per_s:
                waits.append(load.waiting / load.drain_per_s)
        if any(p.pressure.open for p in pods):
            reason = "pressure"
        else:
            reason = "sheddable_pressure" if criticality == "sheddable" else "ejected"
        retry = min(waits) if waits else 1.0
        return 429, reason, max(1, round(retry))

    # -- what the request path reports back ------------------------------------------------------

    def report_success(self, pod: Pod, now: float | None = None) -> None:
        """A first token or a 2xx answer: the outlier breaker closes, and it is evidence of life."""
        pod.served_at = time.monotonic() if now is None else now
        if self.outcomes is not None:
            self.outcomes(pod.name, None, pod.served_at)
        if pod.outlier.success() is not None:
            self._transition(pod, "outlier", CLOSED, "a request succeeded")

    def report_failure(self, pod: Pod, what: str, now: float | None = None) -> None:
        """A gateway-visible failure: connect error, reset, 5xx or a gateway timeout."""
        now = time.monotonic() if now is None else now
        if self.outcomes is not None:
            self.outcomes(pod.name, what, now)
        ejected = sum(p.outlier.state != CLOSED for p in self.pods)
        may_eject = ejected * 100.0 < self.health_config.outlier.max_ejection_percent * len(self.pods)
        if pod.outlier.failure(what, now, may_eject) == OPEN:
            self._transition(pod, "outlier", OPEN, pod.outlier.reason)

    # -- what the monitor reports ------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Let ejections that have run their time go half-open."""
        for pod in self.pods:
            if pod.outlier.tick(now) is not None:
                self._transition(pod, "outlier", HALF_OPEN, pod.outlier.reason)

    def health_changed(self, pod: Pod, new_state: str | None) -> None:
        if new_state is not None:
            self._transition(pod, "health", new_state, pod.health.reason)
            for model in pod.models:  # enter or leave a panic now, not at the next request
                self._routable(model, self._by_model.get(model, ()))

    def load_changed(self, pod: Pod, opened: bool | None) -> None:
        if self.metrics is not None:
            if pod.load.kv_cache_usage is not None:
                self.metrics.pod_kv_cache_usage.labels(pod.name).set(pod.load.kv_cache_usage)
            if pod.load.waiting is not None:
                self.metrics.pod_waiting.labels(pod.name).set(pod.load.waiting)
        if opened is not None:
            why = pod.pressure.reason or "pressure eased"
            self._transition(pod, "pressure", OPEN if opened else CLOSED, why)

    def _transition(self, pod: Pod, kind: str, to: str, why: str) -> None:
        log.warning("pod %s: %s -> %s (%s)", pod.name, kind, to, why)
        if self.metrics is not None:
            self.metrics.pod_transitions.labels(pod.name, kind, to).inc()
        self._publish(pod)

    def _publish(self, pod: Pod) -> None:
        if self.metrics is None:
            return
        for state in HEALTH_STATES:
            self.metrics.pod_state.labels(pod.name, state).set(1 if pod.health.state == state else 0)
        pressure = OPEN if pod.pressure.open else CLOSED
        for cause, current in (("pressure", pressure), ("outlier", pod.outlier.state)):
            for state in BREAKER_STATES:
                self.metrics.pod_breaker.labels(pod.name, cause, state).set(1 if current == state else 0)

    def _unpublish(self, name: str) -> None:
        """Drop a departed pod's gauges, so they do not report it as it last was forever."""
        if self.metrics is None:
            return
        metrics = self.metrics
        for state in HEALTH_STATES:
            metrics.pod_state.remove(name, state)
        for cause in ("pressure", "outlier"):
            for state in BREAKER_STATES:
                metrics.pod_breaker.remove(name, cause, state)
        for gauge in (metrics.pod_up, metrics.pod_kv_cache_usage, metrics.pod_waiting):
            gauge.remove(name)

    def get(self, name: str) -> Pod | None:
        for pod in self.pods:
            if pod.name == name:
                return pod
        return None

    def ready(self) -> bool:
        return any(self._routable(model, pods) for model, pods in self._by_model.items())

    def snapshot(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        stale = self.health_config.scrape.stale_after_s
        return [pod.snapshot(now, stale) for pod in self.pods]


def _weight(key: str, pod_name: str) -> int:
    """A pod's rendezvous weight for a key: stable across processes (Python's ``hash`` is not)."""
    digest = hashlib.blake2b(pod_name.encode(), digest_size=8, key=key.encode()[:64]).digest()
    return int.from_bytes(digest, "big")
