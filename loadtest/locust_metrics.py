"""What the Locust scenario measures, kept apart from Locust so that it can be tested without it.

Locust keeps response times in rounded millisecond buckets (and importing it monkey-patches the
process with gevent), which is too coarse for a gateway that adds tens of microseconds per token.
So the scenario also keeps its own histograms here: integer microseconds, exact below 2,048 µs
and within 1/2,048 (0.05 %) above, merged by adding bucket counts, so that a master can add up
its workers' reports without shipping every sample.

It also holds the one reading of an OpenAI-style SSE stream that decides what a token is: time to
first token is the first event whose delta carries non-empty ``content`` or ``reasoning_content``
(not the first byte, not vLLM's role-only opening chunk); output tokens come from the server's
``usage`` and are compared with the content events seen.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field
from typing import Any

EXACT_BELOW = 2048  # values under this are their own bucket; above, 11 significant bits are kept
METRICS = ("ttft", "itl", "tpot", "e2e", "dispatch_delay")  # microsecond histograms
TOKENS = "output_tokens"  # a histogram of counts, not times


class Histogram:
    """Log-bucketed counts of non-negative integers (HDR-like: constant relative precision)."""

    __slots__ = ("buckets", "count", "max", "min", "total")

    def __init__(self) -> None:
        self.buckets: dict[int, int] = {}
        self.count = 0
        self.total = 0
        self.min: int | None = None
        self.max: int | None = None

    @staticmethod
    def bucket_of(value: int) -> int:
        """The lower bound of the bucket ``value`` falls in."""
        if value < EXACT_BELOW:
            return value
        shift = value.bit_length() - EXACT_BELOW.bit_length() + 1
        return (value >> shift) << shift

    @staticmethod
    def width_of(bucket: int) -> int:
        if bucket < EXACT_BELOW:
            return 1
        return 1 << (bucket.bit_length() - EXACT_BELOW.bit_length() + 1)

    def add(self, value: float) -> None:
        v = max(0, round(value))
        key = self.bucket_of(v)
        self.buckets[key] = self.buckets.get(key, 0) + 1
        self.count += 1
        self.total += v
        self.min = v if self.min is None else min(self.min, v)
        self.max = v if self.max is None else max(self.max, v)

    def merge(self, other: Histogram) -> None:
        for key, n in other.buckets.items():
            self.buckets[key] = self.buckets.get(key, 0) + n
        self.count += other.count
        self.total += other.total
        if other.min is not None:
            self.min = other.min if self.min is None else min(self.min, other.min)
        if other.max is not None:
            self.max = other.max if self.max is None else max(self.max, other.max)

    def percentile(self, q: float) -> int | None:
        """Nearest-rank percentile (0 < q <= 100): the middle of its bucket, within [min, max]."""
        if not self.count:
            return None
        rank = max(1, math.ceil(self.count * q / 100.0))
        seen = 0
        for key in sorted(self.buckets):
            seen += self.buckets[key]
            if seen >= rank:
                middle = key + (self.width_of(key) - 1) // 2
                return min(max(middle, self.min or 0), self.max or 0)
        return self.max

    def summary(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "min": self.min,
            "mean": round(self.total / self.count, 1) if self.count else None,
            "p50": self.percentile(50),
            "p90": self.percentile(90),
            "p99": self.percentile(99),
            "max": self.max,
        }

    def to_wire(self) -> list[list[int]]:
        """Plain lists (msgpack- and JSON-safe) for a worker's report to its master."""
        totals = [[-1, self.total], [-2, self.min or 0], [-3, self.max or 0]]
        return [[key, n] for key, n in self.buckets.items()] + totals

    @classmethod
    def from_wire(cls, pairs: list[list[int]]) -> Histogram:
        hist = cls()
        extra = {key: n for key, n in pairs if key < 0}
        hist.buckets = {key: n for key, n in pairs if key >= 0}
        hist.count = sum(hist.buckets.values())
        hist.total = extra.get(-1, 0)
        if hist.count:
            hist.min, hist.max = extra.get(-2, 0), extra.get(-3, 0)
        return hist


@dataclass(slots=True)
class Targets:
    """Goodput targets in milliseconds; ``None`` means that dimension is not judged."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def met_by(self, stream: StreamTiming) -> bool:
        checks = ((self.ttft_ms, stream.ttft_s), (self.tpot_ms, stream.tpot_s), (self.e2e_ms, stream.e2e_s))
        return all(limit is None or (value is not None and value * 1000 <= limit) for limit, value in checks)

    def as_dict(self) -> dict[str, float | None]:
        return {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "e2e_ms": self.e2e_ms}


@dataclass(slots=True)
class StreamTiming:
    """One streamed answer read line by line; times are ``perf_counter`` seconds from the send."""

    sent: float
    token_times: list[float] = field(default_factory=list)
    usage_tokens: int | None = None
    done_at: float | None = None
    error: str | None = None

    def feed(self, line: bytes, now: float) -> None:
        """Take one SSE line as it arrives (blank lines, comments and ``event:`` lines are ignored)."""
        if not line.startswith(b"data:") or self.error is not None:
            return
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self.done_at = now
            return
        try:
            event = json.loads(payload)
        except ValueError:
            self.error = f"an event that is not JSON: {payload[:80]!r}"
            return
        if not isinstance(event, dict):
            self.error = f"an event that is not an object: {payload[:80]!r}"
            return
        if "error" in event:
            self.error = f"error event: {json.dumps(event['error'])[:200]}"
            return
        usage = event.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.usage_tokens = usage["completion_tokens"]
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"):
                self.token_times.append(now)
                break

    def failure(self) -> str | None:
        """Why this stream does not count as a complete answer, or None."""
        if self.error:
            return self.error
        if self.done_at is None:
            return "the stream ended without data: [DONE]"
        if not self.token_times:
            return "the stream carried no content"
        return None

    @property
    def tokens(self) -> int:
        """Output tokens: the server's usage when it sent one, else the content events seen."""
        return self.usage_tokens if self.usage_tokens is not None else len(self.token_times)

    @property
    def mismatch(self) -> bool:
        return self.usage_tokens is not None and self.usage_tokens != len(self.token_times)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def e2e_s(self) -> float | None:
        if self.done_at is not None:
            return self.done_at - self.sent
        return self.token_times[-1] - self.sent if self.token_times else None

    @property
    def tpot_s(self) -> float | None:
        ttft, e2e = self.ttft_s, self.e2e_s
        if ttft is None or e2e is None or self.tokens < 2:
            return None
        return (e2e - ttft) / (self.tokens - 1)

    def gaps_s(self) -> list[float]:
        """Inter-token latencies: the gaps between successive content events."""
        times = self.token_times
        return [b - a for a, b in itertools.pairwise(times)]


class Recorder:
    """All the histograms and counters of one process (a worker's, or everything on the master)."""

    def __init__(self) -> None:
        self.hists: dict[str, Histogram] = {name: Histogram() for name in (*METRICS, TOKENS)}
        self.counters: dict[str, int] = {"ok": 0, "failed": 0, "mismatches": 0, "with_usage": 0,
                                         "goodput": 0, "tokens": 0}

    def record(self, stream: StreamTiming, targets: Targets, dispatch_delay_s: float | None) -> None:
        if dispatch_delay_s is not None:
            self.hists["dispatch_delay"].add(dispatch_delay_s * 1e6)
        if stream.ttft_s is not None:
            self.hists["ttft"].add(stream.ttft_s * 1e6)
        for gap in stream.gaps_s():
            self.hists["itl"].add(gap * 1e6)
        if stream.failure() is not None:
            self.counters["failed"] += 1
            return
        self.counters["ok"] += 1
        self.hists["e2e"].add((stream.e2e_s or 0.0) * 1e6)
        if stream.tpot_s is not None:
            self.hists["tpot"].add(stream.tpot_s * 1e6)
        self.hists[TOKENS].add(stream.tokens)
        self.counters["tokens"] += stream.tokens
        self.counters["with_usage"] += stream.usage_tokens is not None
        self.counters["mismatches"] += stream.mismatch
        self.counters["goodput"] += targets.met_by(stream)

    def merge(self, other: Recorder) -> None:
        for name, hist in other.hists.items():
            self.hists[name].merge(hist)
        for name, n in other.counters.items():
            self.counters[name] += n

    def to_wire(self) -> dict[str, Any]:
        hists = {name: hist.to_wire() for name, hist in self.hists.items()}
        return {"hists": hists, "counters": dict(self.counters)}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Recorder:
        recorder = cls()
        for name, pairs in data.get("hists", {}).items():
            if name in recorder.hists:
                recorder.hists[name] = Histogram.from_wire(pairs)
        for name, n in data.get("counters", {}).items():
            if name in recorder.counters:
                recorder.counters[name] = int(n)
        return recorder

    def report(self, duration_s: float, targets: Targets) -> dict[str, Any]:
        """The JSON summary: latencies in integer microseconds, throughput per second of the run."""
        c = self.counters
        per_s = (lambda n: round(n / duration_s, 3)) if duration_s > 0 else (lambda n: None)
        return {
            "unit": "microseconds",
            "precision": f"exact below {EXACT_BELOW} us, within 1/{EXACT_BELOW} above",
            "duration_s": round(duration_s, 3),
            "requests": {"ok": c["ok"], "failed": c["failed"], "per_s": per_s(c["ok"])},
            "latency_us": {name: self.hists[name].summary() for name in METRICS},
            "output_tokens": {
                "total": c["tokens"],
                "per_s": per_s(c["tokens"]),
                "per_request": self.hists[TOKENS].summary(),
                "requests_with_usage": c["with_usage"],
                "usage_mismatches": c["mismatches"],
            },
            "goodput": {"targets": targets.as_dict(), "requests": c["goodput"], "per_s": per_s(c["goodput"])},
        }
