"""From per-request records to the summary numbers: percentiles, throughput, goodput, breakdowns.

Kept apart from the sending so that the arithmetic (goodput, TPOT, the sweep's knee) can be read
and tested without a network. The summary's schema is documented in loadtest/loadtest_cli.py.

Definitions (the same as docs/load-testing.md):
- TTFT: send to the first read carrying non-empty content; ITL: gaps between such reads;
  TPOT: (e2e - ttft) / (output_tokens - 1); output tokens from the server's ``usage`` when it sent
  one, else the content events seen (a mismatch between the two is counted).
- service latency (``e2e_ms``) is timed from the real send; response latency (``response_ms``) and
  ``ttft_from_schedule_ms`` from the scheduled send, so they include the dispatch delay.
- goodput: successful requests meeting every given target, where TTFT and e2e are measured from
  the *schedule* (what a user waiting since then saw), per second of the run.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from loadtest.drive import Record, RunResult
from loadtest.loadgen import percentile

GOODPUT_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms")
QUANTILES = (("p50", 50.0), ("p90", 90.0), ("p99", 99.0), ("max", 100.0))


def parse_goodput(spec: str) -> dict[str, float]:
    """``ttft_ms=500,tpot_ms=50,e2e_ms=10000`` (any subset) -> targets; ValueError says what is wrong."""
    targets: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in GOODPUT_KEYS:
            names = ", ".join(GOODPUT_KEYS)
            raise ValueError(f"goodput target {part!r}: expected KEY=MS with KEY one of {names}")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"goodput target {part!r}: {value!r} is not a number of milliseconds") from None
        if number <= 0:
            raise ValueError(f"goodput target {part!r}: must be above 0")
        targets[key] = number
    if not targets:
        raise ValueError("goodput targets are empty; e.g. --goodput ttft_ms=500,tpot_ms=50")
    return targets


def stats_ms(values: Iterable[float]) -> dict[str, float | None]:
    """p50/p90/p99/max and mean of seconds, in milliseconds (None for no values)."""
    seconds = list(values)
    out: dict[str, float | None] = {}
    for name, q in QUANTILES:
        got = percentile(seconds, q)
        out[name] = None if got is None else round(got * 1000, 3)
    out["mean"] = round(sum(seconds) / len(seconds) * 1000, 3) if seconds else None
    out["count"] = len(seconds)
    return out


def output_tokens(record: Record) -> int:
    """The server's count when it gave one, else what was seen."""
    return record.output_tokens if record.output_tokens is not None else record.tokens_seen


def tpot_s(record: Record) -> float | None:
    """Time per output token after the first, or None with fewer than two tokens."""
    tokens = output_tokens(record)
    if tokens < 2 or not record.first:
        return None
    return (record.end - record.first) / (tokens - 1)


def meets(record: Record, targets: dict[str, float]) -> bool:
    """Whether a successful request met every target (TTFT and e2e counted from its schedule)."""
    if not record.ok or not record.first:
        return False
    if "ttft_ms" in targets and (record.first - record.scheduled) * 1000 > targets["ttft_ms"]:
        return False
    if "e2e_ms" in targets and (record.end - record.scheduled) * 1000 > targets["e2e_ms"]:
        return False
    if "tpot_ms" in targets:
        tpot = tpot_s(record)
        if tpot is None or tpot * 1000 > targets["tpot_ms"]:
            return False
    return True


def _latencies(records: list[Record]) -> dict[str, Any]:
    good = [r for r in records if r.ok and r.first]
    itls = [b - a for r in good for a, b in zip(r.marks, r.marks[1:], strict=False)]
    return {
        "ttft_ms": stats_ms(r.first - r.sent for r in good),
        "ttft_from_schedule_ms": stats_ms(r.first - r.scheduled for r in good),
        "itl_ms": stats_ms(itls),
        "tpot_ms": stats_ms(t for t in map(tpot_s, good) if t is not None),
        "e2e_ms": stats_ms(r.end - r.sent for r in good),
        "response_ms": stats_ms(r.end - r.scheduled for r in good),
    }


def _breakdown(records: list[Record], key: str, wall: float) -> dict[str, Any]:
    groups: dict[str, list[Record]] = defaultdict(list)
    for record in records:
        groups[str(getattr(record, key))].append(record)
    out = {}
    for name, group in sorted(groups.items()):
        ok = sum(r.ok for r in group)
        out[name] = {
            "requests": len(group), "ok": ok, "requests_per_s": round(ok / wall, 3) if wall else 0.0,
            **_latencies(group),
        }
    return out


def summarize(result: RunResult, config: dict[str, Any], targets: dict[str, float] | None) -> dict[str, Any]:
    """The summary JSON object of one run (schema: loadtest/loadtest_cli.py)."""
    records = result.records
    wall = max(result.wall_s, 1e-9)
    ok = [r for r in records if r.ok]
    errors: dict[str, int] = defaultdict(int)
    for record in records:
        if record.error is not None:
            errors[record.error.split(":", 1)[0]] += 1
    seen = sum(r.tokens_seen for r in ok)
    produced = sum(output_tokens(r) for r in ok)
    mismatched = sum(1 for r in ok if r.output_tokens is not None and r.output_tokens != r.tokens_seen)
    sent = [r for r in records if r.sent]
    goodput = None
    if targets:
        met = sum(meets(r, targets) for r in records)
        goodput = {
            "targets": targets, "requests": met,
            "fraction": round(met / len(records), 4) if records else 0.0,
            "per_s": round(met / wall, 3),
        }
    lag = result.loop_lag_s
    return {
        "schema": "sluicegate.loadtest/1",
        "config": config,
        "wall_s": round(wall, 3),
        "requests": {
            "scheduled": len(records), "sent": len(sent), "ok": len(ok), "errors": len(records) - len(ok),
            "error_rate": round((len(records) - len(ok)) / len(records), 4) if records else 0.0,
            "error_kinds": dict(errors),
            "error_samples": sorted({r.error for r in records if r.error})[:5],
        },
        "throughput": {
            "requests_per_s": round(len(ok) / wall, 3),
            "output_tokens_per_s": round(produced / wall, 1),
            "tokens_seen_per_s": round(seen / wall, 1),
        },
        "tokens": {"output": produced, "seen": seen, "usage_mismatch_requests": mismatched,
                   "usage_missing_requests": sum(1 for r in ok if r.output_tokens is None)},
        **_latencies(records),
        "dispatch_delay_ms": stats_ms(r.sent - r.scheduled for r in sent),
        "goodput": goodput,
        "by_transport": _breakdown(records, "transport", wall),
        "by_variant": _breakdown(records, "variant", wall),
        "by_pod": _breakdown(records, "pod", wall),
        "loadgen": {
            "cpu_percent": round(100 * (result.cpu_user_s + result.cpu_sys_s) / wall, 1),
            "cpu_user_s": round(result.cpu_user_s, 3), "cpu_sys_s": round(result.cpu_sys_s, 3),
            "loop_lag_ms": stats_ms(lag),
            "peak_inflight": result.peak_inflight,
        },
    }


def sweep_metric(summary: dict[str, Any]) -> float:
    """What a sweep maximises: goodput per second when targets are given, else successful requests/s."""
    goodput = summary.get("goodput")
    return goodput["per_s"] if goodput else summary["throughput"]["requests_per_s"]


def collapsed(summary: dict[str, Any], best: float, max_error_rate: float = 0.1) -> str | None:
    """Why a sweep stops after this level: errors above ``max_error_rate``, or the metric fallen
    below half the best level's; None to go on."""
    if summary["requests"]["error_rate"] > max_error_rate:
        return f"error rate {summary['requests']['error_rate']:.0%} above {max_error_rate:.0%}"
    metric = sweep_metric(summary)
    if best > 0 and metric < best / 2:
        return f"{'goodput' if summary.get('goodput') else 'throughput'} fell to {metric:g}/s from {best:g}/s"
    return None


def knee(levels: list[float], metrics: list[float], share: float = 0.9) -> float | None:
    """The lowest level whose metric is within ``share`` of the best: where more load stops paying."""
    if not metrics or max(metrics) <= 0:
        return None
    best = max(metrics)
    return next(level for level, metric in zip(levels, metrics, strict=True) if metric >= share * best)
