"""``/metrics`` with vLLM's names, types and labels (``engine="0"``, ``model_name``).

Counters and histograms live as plain numbers on the engine's :class:`ModelStats` and are turned
into metric families only when scraped, so the per-token path never touches prometheus_client.
Counter families are named without ``_total``; the exposition adds it (``vllm:num_preemptions_total``),
and no ``_created`` series are emitted, as with vLLM. The simulator's own series use ``podsim:``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from loadtest.podsim.engine import FINISHED_REASONS, Engine, Histogram, ModelStats
from loadtest.podsim.faults import NO_FAULTS, Faults

LABELS = ["engine", "model_name"]


def _histogram(name: str, doc: str, pairs: Iterable[tuple[list[str], Histogram]]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=LABELS)
    for labels, hist in pairs:
        buckets, running = [], 0
        for bound, count in zip((*hist.bounds, float("inf")), hist.counts, strict=True):
            running += count
            buckets.append((floatToGoString(bound), running))
        family.add_metric(labels, buckets, hist.sum)
    return family


class PodsimCollector(Collector):
    """Renders the engine state and per-model stats at scrape time."""

    def __init__(
        self,
        engine: Engine,
        stats: dict[str, ModelStats],
        info: Callable[[], dict[str, str]],
        faults: Callable[[], Faults] = lambda: NO_FAULTS,
    ) -> None:
        self.engine = engine
        self.stats = stats
        self.info = info
        self.faults = faults

    def collect(self) -> Iterator[Metric]:
        engine, stats = self.engine, list(self.stats.values())
        counts = engine.counts_by_model()
        kv = engine.kv_usage()
        faults = self.faults()
        if faults.kv_usage is not None:
            kv = faults.kv_usage
        if faults.waiting is not None:
            counts = {s.model: (counts.get(s.model, (0, 0))[0], faults.waiting) for s in stats}
        label = {s.model: ["0", s.model] for s in stats}

        def gauge(name: str, doc: str, value: Callable[[ModelStats], float]) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            for s in stats:
                family.add_metric(label[s.model], value(s))
            return family

        def counter(name: str, doc: str, value: Callable[[ModelStats], float]) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=LABELS)
            for s in stats:
                family.add_metric(label[s.model], value(s))
            return family

        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            lambda s: counts.get(s.model, (0, 0))[0],
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            lambda s: counts.get(s.model, (0, 0))[1],
        )
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lambda s: kv)
        yield counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            lambda s: s.preemptions,
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            lambda s: s.prompt_tokens,
        )
        yield counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", lambda s: 0
        )
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", lambda s: s.prompt_tokens)
        yield counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", lambda s: s.generation_tokens
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=["engine", "finished_reason", "model_name"],
        )
        for s in stats:
            for reason in FINISHED_REASONS:
                success.add_metric(["0", reason, s.model], s.success[reason])
        yield success
        yield _histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            ((label[s.model], s.ttft) for s in stats),
        )
        yield _histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ((label[s.model], s.itl) for s in stats),
        )
        yield _histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            ((label[s.model], s.e2e) for s in stats),
        )
        yield _histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            ((label[s.model], s.queue_time) for s in stats),
        )
        yield counter(
            "podsim:aborts",
            "Requests whose client went away mid-generation or while waiting (vLLM counts none of these).",
            lambda s: s.aborts,
        )
        faults = CounterMetricFamily(
            "podsim:faults_injected", "Fault knobs that fired, by knob.", labels=[*LABELS, "fault"]
        )
        for s in stats:
            for name, count in sorted(s.faults.items()):
                faults.add_metric(["0", s.model, name], count)
        yield faults
        info = GaugeMetricFamily(
            "podsim:info", "The simulated pod's MIG identity (always 1).", labels=sorted(self.info())
        )
        values = self.info()
        info.add_metric([values[k] for k in sorted(values)], 1)
        yield info


def build_registry(collector: PodsimCollector) -> CollectorRegistry:
    """The simulator's own registry: its collector plus the process/GC/platform ones vLLM also has."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    ProcessCollector(registry=registry)
    GCCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry
