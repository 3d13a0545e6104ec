"""Read a vLLM pod's ``/metrics`` page as the few numbers routing needs (sans-IO).

A pod that answers ``/health`` can still be saturated: its KV cache full, requests queueing, first
tokens slow. The gateway scrapes each pod and keeps a :class:`PodLoad` to score and shed on. vLLM renamed
some series over time (``gpu_cache_usage_perc`` became ``kv_cache_usage_perc``, ``time_per_output_token``
became ``inter_token_latency``); the new name is read first and the old one accepted.

A pod may run several engines (data parallel) and serve several models: series are summed over
``engine`` (the KV-cache ratio is averaged) and, when a model is named, only its series are counted.
A metric the pod does not export is None, never an error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.health.dcgm import iter_samples

KV_CACHE_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
RUNNING = ("vllm:num_requests_running",)
WAITING = ("vllm:num_requests_waiting",)
TTFT = ("vllm:time_to_first_token_seconds",)
ITL = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
_WANTED = frozenset(
    [*KV_CACHE_USAGE, *RUNNING, *WAITING]
    + [name + suffix for name in (*TTFT, *ITL) for suffix in ("_sum", "_count")]
    + [name + "_bucket" for name in ITL]
)


@dataclass(frozen=True, slots=True)
class PodLoad:
    """One scrape of a vLLM pod. Histogram counts and sums are cumulative since the pod started."""

    kv_cache_usage: float | None = None  # 0..1
    num_requests_running: int | None = None
    num_requests_waiting: int | None = None
    ttft_count: int | None = None
    ttft_sum_s: float | None = None
    itl_count: int | None = None
    itl_sum_s: float | None = None
    itl_buckets: tuple[tuple[float, float], ...] | None = None  # (upper bound s, cumulative count)

    def ttft_mean_since(self, earlier: PodLoad) -> float | None:
        """Mean time to first token (s) of the requests that got one between ``earlier`` and this scrape."""
        return _mean_between(earlier.ttft_count, earlier.ttft_sum_s, self.ttft_count, self.ttft_sum_s)

    def itl_mean_since(self, earlier: PodLoad) -> float | None:
        """Mean inter-token latency (s) over the tokens streamed between ``earlier`` and this scrape."""
        return _mean_between(earlier.itl_count, earlier.itl_sum_s, self.itl_count, self.itl_sum_s)

    def itl_quantile_since(self, earlier: PodLoad, q: float, min_tokens: int = 1) -> float | None:
        """The ``q`` quantile (s) of the inter-token gaps observed between ``earlier`` and this scrape.

        Estimated from the histogram's bucket counts as Prometheus's ``histogram_quantile`` does:
        linear within the bucket the rank falls in, the bucket's lower bound when it is the last
        (+Inf) one. None with fewer than ``min_tokens`` new gaps, no histogram, or a restarted pod.
        """
        if self.itl_buckets is None or earlier.itl_buckets is None:
            return None
        before = dict(earlier.itl_buckets)
        deltas = [(le, count - before.get(le, 0.0)) for le, count in self.itl_buckets]
        if any(delta < 0 for _, delta in deltas) or not deltas:
            return None
        total = deltas[-1][1]
        if total < max(1, min_tokens):
            return None
        rank = q * total
        lower, below = 0.0, 0.0
        for le, cumulative in deltas:
            if cumulative >= rank:
                if le == math.inf:
                    return lower
                inside = cumulative - below
                return lower + (le - lower) * ((rank - below) / inside if inside else 1.0)
            lower, below = le, cumulative
        return lower


def _mean_between(c0: int | None, s0: float | None, c1: int | None, s1: float | None) -> float | None:
    """None when either scrape lacks the histogram, nothing new was observed, or the pod restarted."""
    if c0 is None or s0 is None or c1 is None or s1 is None or c1 <= c0 or s1 < s0:
        return None
    return (s1 - s0) / (c1 - c0)


def parse_vllm_metrics(text: str | bytes, model: str | None = None) -> PodLoad:
    """The pod's load from one ``/metrics`` scrape, for ``model`` only when given.

    Series without a ``model_name`` label count for every model. Malformed text in the series read
    raises ValueError.
    """
    values: dict[str, list[float]] = {}
    buckets: dict[str, dict[float, float]] = {}
    for _family, name, labels, value in iter_samples(text, "vLLM", _WANTED):
        if model is not None and labels.get("model_name", model) != model:
            continue
        if name.endswith("_bucket"):
            try:
                le = float(labels["le"])
            except (KeyError, ValueError):
                raise ValueError(f"malformed vLLM metrics text: {name} without a numeric le") from None
            per_le = buckets.setdefault(name, {})
            per_le[le] = per_le.get(le, 0.0) + value  # summed over engines
            continue
        values.setdefault(name, []).append(value)

    def pick(names: tuple[str, ...], suffix: str = "") -> list[float] | None:
        for name in names:
            if name + suffix in values:
                return values[name + suffix]
        return None

    def total(names: tuple[str, ...], suffix: str = "") -> float | None:
        found = pick(names, suffix)
        return None if found is None else sum(found)

    def count(names: tuple[str, ...], suffix: str = "") -> int | None:
        found = total(names, suffix)
        if found is not None and not math.isfinite(found):  # round() would raise Overflow/ValueError
            raise ValueError(f"malformed vLLM metrics text: {names[0]}{suffix} is {found}, not a count")
        return None if found is None else round(found)

    kv = pick(KV_CACHE_USAGE)
    itl_buckets = next((buckets[n + "_bucket"] for n in ITL if n + "_bucket" in buckets), None)
    return PodLoad(
        kv_cache_usage=sum(kv) / len(kv) if kv else None,
        num_requests_running=count(RUNNING),
        num_requests_waiting=count(WAITING),
        ttft_count=count(TTFT, "_count"),
        ttft_sum_s=total(TTFT, "_sum"),
        itl_count=count(ITL, "_count"),
        itl_sum_s=total(ITL, "_sum"),
        itl_buckets=tuple(sorted(itl_buckets.items())) if itl_buckets else None,
    )
