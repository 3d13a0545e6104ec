"""What keys and quotas cost per request: the h1 100-stream load with admission off, and on.

Keys and quotas are decisions on every request's path, so their price is read where ``make bench``
reads the gateway's: the same pod pacing and load as its 100-stream row (scenario b: 256 tokens at
5 ms a token), the gateway alone on core 1, the pod, the load generator and Redis on core 0, and the
gateway's CPU from ``/proc`` around the load. Three configurations run one after another, each with a
fresh pod and a fresh gateway:

- **off**: ``auth: {enabled: false}`` and no quotas (the baseline, as in ``make bench``);
- **memory**: auth on with a store of 1,000 keys, the load spread over 100 of them (one key per
  stream, round robin), a tier whose quota (requests and tokens per minute, streams at once) is far
  out of reach, counters in the gateway's memory;
- **redis**: the same with ``quotas.redis_url`` pointing at a real ``redis-server`` this script starts.

Each stream sends its requests back to back for ``--duration`` seconds. Reported per configuration:
requests, errors, gateway CPU-ms per request (and per 1000 tokens, the unit of ``make bench``'s
table), TTFT p50/p99, and how each differs from the baseline; the quota decisions and Redis round
trips the gateway counted show that admission really ran. The verdict: CPU per request with keys and
quotas on within ``--budget`` (10 %) of the baseline's.

    python -m loadtest.bench_admission [--duration 15] [--streams 100] [--tokens 256] [--write-md FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gateway.rlimits import raise_open_file_limit
from loadtest.bench import (
    LOAD_CORE,
    MODEL,
    PROXY_CORE,
    SCENARIOS,
    can_pin,
    cpu_delta_s,
    cpu_ticks,
    make_key_store,
    process_tree,
    start_pod,
    wait_ready,
)
from loadtest.loadgen import LoadGenerator, LoadSpec, _Exchange
from loadtest.procs import GatewayProcess
from loadtest.redis_server import RedisServer, redis_server_binary
from loadtest.report import command_line, publish

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a project dependency on Linux
    uvloop = None  # type: ignore[assignment]

CONFIGS = ("off", "memory", "redis")
TITLES = {
    "off": "auth off, no quotas (baseline)",
    "memory": "keys + quotas, in-memory counters",
    "redis": "keys + quotas, Redis counters",
}
TIER = "bench"
OUT_OF_REACH = 10**12  # a quota limit no run of this benchmark can reach


# --------------------------------------------------------------------------- load with keys


class KeyedLoadGenerator(LoadGenerator):
    """``loadgen``'s lean streams, each connection sending ``Authorization: Bearer KEY`` with its own
    key (round robin over ``keys``), so admission sees many callers at once as in production."""

    def __init__(self, spec: LoadSpec, keys: list[str]) -> None:
        super().__init__(spec)
        head, _, body = self.request.partition(b"\r\n\r\n")
        self._requests = itertools.cycle(
            [head + f"\r\nAuthorization: Bearer {key}".encode() + b"\r\n\r\n" + body for key in keys]
            or [self.request]
        )

    async def _connect(self) -> _Exchange:
        conn = await super()._connect()
        conn.request = next(self._requests)  # type: ignore[attr-defined]
        return conn

    async def _one_request(self, conn: _Exchange) -> tuple[bool, bool]:
        # The base class writes self.request before its first await: this connection's own key.
        self.request = conn.request  # type: ignore[attr-defined]
        return await super()._one_request(conn)


def run_keyed_load(spec: LoadSpec, keys: list[str]) -> dict[str, Any]:
    """Run the load on uvloop in this process, the collector kept out of the per-token path."""
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        runner = uvloop.run if uvloop is not None else asyncio.run
        return runner(KeyedLoadGenerator(spec, keys).run())
    finally:
        gc.enable()
        gc.unfreeze()


# --------------------------------------------------------------------------- configurations


def gateway_config(
    config: str, pod_url: str, keys_file: Path, tokens: int, redis_url: str | None
) -> dict[str, Any]:
    """``make bench``'s gateway (defaults, one pod), plus keys and an unreachable quota unless ``off``."""
    base: dict[str, Any] = {"pods": [{"name": "pod", "url": pod_url}]}
    if config == "off":
        return {**base, "auth": {"enabled": False}}
    quota = {"requests_per_minute": OUT_OF_REACH, "tokens_per_minute": OUT_OF_REACH, "max_concurrent": 10**6}
    # Redis shares core 0 with the pod and the load generator, both busy: its round trips reach
    # tens of ms there, past the 20 ms default that would (rightly) open the breaker. A Redis of its
    # own answers in well under a millisecond; give this one room so the row measures Redis, not the
    # store-down fallback.
    quotas: dict[str, Any] = {"redis_url": redis_url, "timeout_ms": 100} if config == "redis" else {}
    return {
        **base,
        "auth": {"enabled": True, "keys_file": str(keys_file)},
        # A token quota needs a max_tokens cap; this one never shortens the benchmark's answers.
        "tiers": {TIER: {"max_tokens": tokens, "quota": quota}},
        "quotas": quotas,
    }


def admission_view(admin_url: str) -> dict[str, float]:
    """What the gateway counted: quota decisions by outcome, Redis round trips and their mean."""
    with urllib.request.urlopen(admin_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    view: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "sluicegate_quota_decisions_total":
                view[s.labels["outcome"]] = view.get(s.labels["outcome"], 0.0) + s.value
            elif s.name in ("sluicegate_quota_redis_seconds_count", "sluicegate_quota_redis_seconds_sum"):
                key = f"redis_{s.labels['outcome']}_{s.name.rsplit('_', 1)[1]}"
                view[key] = view.get(key, 0.0) + s.value
    return view


@dataclasses.dataclass(slots=True)
class Run:
    """One configuration's measured load."""

    config: str
    repeat: int
    load: dict[str, Any]
    gateway_cpu_s: float
    redis_cpu_s: float | None
    view: dict[str, float]

    @property
    def requests(self) -> int:
        return int(self.load["ok"]) + int(self.load["errors"])

    @property
    def cpu_ms_per_request(self) -> float | None:
        return self.gateway_cpu_s * 1000 / self.requests if self.requests else None

    @property
    def cpu_ms_per_1k_tokens(self) -> float | None:
        tokens = int(self.load["tokens"])
        return self.gateway_cpu_s * 1e6 / tokens if tokens else None


def run_config(
    config: str, repeat: int, *, streams: int, tokens: int, duration_s: float, pin: bool,
    keys: list[str], keys_file: Path, redis: RedisServer | None,
) -> Run:
    """Fresh pod and gateway, warm-up with the same keys, then ``duration_s`` of measured load."""
    scenario = dataclasses.replace(SCENARIOS["b"], streams=streams, max_tokens=tokens)
    pod = start_pod(scenario, pin)
    try:
        redis_url = redis.url if redis is not None else None
        settings = gateway_config(config, pod.url, keys_file, tokens, redis_url)
        with GatewayProcess(settings, cpu=PROXY_CORE if pin else None) as gateway:
            wait_ready(gateway)
            url = gateway.url + "/v1/chat/completions"
            callers = [] if config == "off" else keys
            # Three sequential streams, then one 2-token request per stream at once: first-request
            # costs (imports, the Redis script's load) stay out, and the pod pool is warm.
            for warm in (LoadSpec(url, MODEL, 1, 3, 4), LoadSpec(url, MODEL, streams, 1, 2)):
                done = run_keyed_load(warm, callers)
                if done["errors"]:
                    raise RuntimeError(f"{config}: warm-up failed: {done['error_samples']}")
            pids = process_tree(gateway.pid)
            redis_pids = [redis.process.pid] if redis is not None and redis.process is not None else []
            counted = admission_view(gateway.admin_url)  # the warm-up's decisions, left out below
            before, redis_before = cpu_ticks(pids), cpu_ticks(redis_pids)
            spec = LoadSpec(url, MODEL, streams, requests=10**9, max_tokens=tokens, duration_s=duration_s,
                            timeout_s=max(60.0, duration_s * 4))
            load = run_keyed_load(spec, callers)
            user, system = cpu_delta_s(before, cpu_ticks(process_tree(gateway.pid)))
            redis_cpu = sum(cpu_delta_s(redis_before, cpu_ticks(redis_pids))) if redis_pids else None
            view = {k: v - counted.get(k, 0.0) for k, v in admission_view(gateway.admin_url).items()}
    finally:
        pod.stop()
        pod.close()
    return Run(config, repeat, load, user + system, redis_cpu, view)


@contextlib.contextmanager
def maybe_redis(wanted: bool) -> Iterator[RedisServer | None]:
    """A redis-server for the ``redis`` configuration, on the load core with everything but the
    gateway (this process's affinity), stopped at the end."""
    if not wanted:
        yield None
        return
    with RedisServer() as server:
        yield server


def run(
    streams: int = 100, tokens: int = 256, duration_s: float = 15.0, repeats: int = 1, key_count: int = 1000,
    load_keys: int = 100, configs: tuple[str, ...] = CONFIGS, pin: bool = False,
) -> tuple[list[Run], list[str]]:
    """Every configuration ``repeats`` times, interleaved so slow drifts hit each alike; and notes."""
    notes: list[str] = []
    configs = tuple(configs)
    if "redis" in configs and redis_server_binary() is None:
        configs = tuple(c for c in configs if c != "redis")
        notes.append("redis-server is not installed (Debian: apt-get install redis-server): no Redis row.")
    runs: list[Run] = []
    with (
        tempfile.TemporaryDirectory(prefix="sluicegate-admission-") as scratch,
        maybe_redis("redis" in configs) as redis,
    ):
        keys_file = Path(scratch) / "keys.yaml"
        keys = make_key_store(keys_file, key_count, TIER)[: max(1, min(load_keys, key_count))]
        for repeat in range(1, repeats + 1):
            for config in configs:
                started = time.monotonic()
                done = run_config(
                    config, repeat, streams=streams, tokens=tokens, duration_s=duration_s, pin=pin, keys=keys,
                    keys_file=keys_file, redis=redis if config == "redis" else None,
                )
                runs.append(done)
                print(f"bench_admission: {config} #{repeat}: {done.requests} requests, {done.load['errors']} "
                      f"errors, {_f(done.cpu_ms_per_request, 3)} CPU-ms/request "
                      f"[{time.monotonic() - started:.1f} s]", file=sys.stderr, flush=True)
    return runs, notes


# --------------------------------------------------------------------------- report


@dataclasses.dataclass(slots=True)
class Row:
    """Medians over a configuration's repeats (requests and errors summed)."""

    config: str
    requests: int
    errors: int
    error_samples: list[str]
    cpu_ms_per_request: float | None
    cpu_ms_per_1k_tokens: float | None
    ttft_p50: float | None
    ttft_p99: float | None
    admitted: float
    refused: float
    store_down: float
    redis_round_trips: float
    redis_mean_ms: float | None
    redis_errors: float
    redis_cpu_ms_per_request: float | None


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def aggregate(runs: list[Run]) -> list[Row]:
    rows = []
    for config in CONFIGS:
        mine = [r for r in runs if r.config == config]
        if not mine:
            continue
        def total(key: str, mine: list[Run] = mine) -> float:
            return sum(r.view.get(key, 0.0) for r in mine)

        trips, trip_s = total("redis_ok_count"), total("redis_ok_sum")
        redis_cpu = [r.redis_cpu_s * 1000 / r.requests for r in mine
                     if r.redis_cpu_s is not None and r.requests]
        rows.append(Row(
            config=config,
            requests=sum(r.requests for r in mine),
            errors=sum(int(r.load["errors"]) for r in mine),
            error_samples=[s for r in mine for s in r.load["error_samples"]][:3],
            cpu_ms_per_request=_median([r.cpu_ms_per_request for r in mine]),
            cpu_ms_per_1k_tokens=_median([r.cpu_ms_per_1k_tokens for r in mine]),
            ttft_p50=_median([r.load["ttft_ms"]["p50"] for r in mine]),
            ttft_p99=_median([r.load["ttft_ms"]["p99"] for r in mine]),
            admitted=total("admitted"),
            refused=total("refused") + total("store_down_refused"),
            store_down=total("store_down_admitted") + total("store_down_refused"),
            redis_round_trips=trips + total("redis_error_count"),
            redis_mean_ms=trip_s * 1000 / trips if trips else None,
            redis_errors=total("redis_error_count"),
            redis_cpu_ms_per_request=_median(list(redis_cpu)),
        ))
    return rows


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _vs(value: float | None, base: float | None) -> str:
    if value is None or not base:
        return "-"
    return f"{(value - base) / base:+.1%}"


def _added_ms(value: float | None, base: float | None) -> str:
    if value is None or base is None:
        return "-"
    return f"{value - base:+.2f} ms ({_vs(value, base)})"


def verdicts(rows: list[Row], budget: float) -> list[str]:
    """Per configuration with admission on: met when it had no errors and no refusals, admission
    really ran, and its CPU per request is within ``budget`` of the baseline's."""
    base = next((r for r in rows if r.config == "off"), None)
    lines = []
    for row in rows:
        if row.config == "off":
            continue
        if base is None or base.cpu_ms_per_request is None or row.cpu_ms_per_request is None:
            lines.append(f"- not measured: {TITLES[row.config]} (needs the baseline and this row's CPU)")
            continue
        added = (row.cpu_ms_per_request - base.cpu_ms_per_request) / base.cpu_ms_per_request
        ran = row.admitted > 0 and (row.config != "redis" or row.redis_round_trips > 0)
        ok = added <= budget and row.errors == 0 and row.refused == 0 and row.store_down == 0 and ran
        why = [] if ran else ["admission never ran"]
        why += [f"{row.errors} errors"] if row.errors else []
        why += [f"{row.refused:.0f} refused"] if row.refused else []
        why += [f"{row.store_down:.0f} decided with Redis down"] if row.store_down else []
        lines.append(
            f"- {'met' if ok else 'MISSED'}: {TITLES[row.config]}: gateway CPU per request {added:+.1%} "
            f"vs auth off (<= {budget:+.0%}), added TTFT p50 {_added_ms(row.ttft_p50, base.ttft_p50)}"
            + (f" ({'; '.join(why)})" if why else "")
        )
    return lines


def render(rows: list[Row], command: str, notes: list[str], machine: str, budget: float) -> str:
    base = next((r for r in rows if r.config == "off"), None)
    lines = [f"Command: `{command}`  ", f"Machine: {machine}", *(f"Note: {n}" for n in notes), ""]
    lines += [
        "| configuration | requests | errors | gateway CPU-ms per request | vs off | CPU-ms per 1000 tokens "
        "| TTFT p50 / p99 ms | added TTFT p50 | quota admitted / refused | Redis round trips (mean ms, "
        "errors) | Redis CPU-ms per request |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        cpu_base = base.cpu_ms_per_request if base else None
        ttft_base = base.ttft_p50 if base else None
        redis = "-" if r.config != "redis" else (
            f"{r.redis_round_trips:.0f} ({_f(r.redis_mean_ms, 2)}, {r.redis_errors:.0f})")
        lines.append(
            f"| {TITLES[r.config]} | {r.requests} | {r.errors} | {_f(r.cpu_ms_per_request, 3)} "
            f"| {'-' if r.config == 'off' else _vs(r.cpu_ms_per_request, cpu_base)} "
            f"| {_f(r.cpu_ms_per_1k_tokens)} "
            f"| {_f(r.ttft_p50, 2)} / {_f(r.ttft_p99, 2)} "
            f"| {'-' if r.config == 'off' else _added_ms(r.ttft_p50, ttft_base)} "
            f"| {'-' if r.config == 'off' else f'{r.admitted:.0f} / {r.refused:.0f}'} | {redis} "
            f"| {_f(r.redis_cpu_ms_per_request, 3)} |"
        )
    samples = [f"{r.config}: {s}" for r in rows for s in r.error_samples]
    if samples:
        lines += ["", "Errors seen: " + "; ".join(samples)]
    return "\n".join([*lines, "", "Targets:", "", *verdicts(rows, budget)])


def machine_summary(pin: bool) -> str:
    redis = "not installed"
    binary = redis_server_binary()
    if binary:
        probe = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
        redis = probe.stdout.split(" v=", 1)[-1].split(" ", 1)[0] or "unknown version"
    pinning = (f"gateway alone on core {PROXY_CORE}; pod, load generator and Redis on core {LOAD_CORE}"
               if pin else "no CPU pinning")
    return f"{os.cpu_count()} cores, redis-server {redis}; loopback; {pinning}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_admission", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--duration", type=float, default=15.0, help="seconds of load per configuration")
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=256, help="max_tokens (each answer's length)")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved repeats; medians are reported")
    parser.add_argument("--keys", type=int, default=1000, help="keys in the store")
    parser.add_argument("--load-keys", type=int, default=100, help="keys the load is spread over")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated: " + ", ".join(CONFIGS))
    parser.add_argument("--budget", type=float, default=0.10, help="allowed added CPU per request")
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    parser.add_argument("--write-md", metavar="FILE")
    parser.add_argument("--section", default="admission", help="the marked section of --write-md to replace")
    args = parser.parse_args(argv)
    configs = tuple(c.strip() for c in args.configs.split(",") if c.strip())
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        parser.error(f"--configs: choose from {', '.join(CONFIGS)} (got {args.configs!r})")
    raise_open_file_limit()
    pin = not args.no_pin and can_pin()
    if pin:  # the pod, the load, Redis and this harness stay off the gateway's core
        os.sched_setaffinity(0, {LOAD_CORE})
    runs, notes = run(
        args.streams, args.tokens, args.duration, args.repeats, args.keys, args.load_keys, configs, pin
    )
    rows = aggregate(runs)
    command = command_line("loadtest.bench_admission", argv)
    section = render(rows, command, notes, machine_summary(pin), args.budget)
    publish(section, args.write_md, args.section)
    # As make bench: a cost over budget is reported MISSED; only failed requests fail the run.
    return 1 if any(r.errors or r.refused for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
