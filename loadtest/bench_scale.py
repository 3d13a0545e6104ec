"""The scale curve: 100 to 10,000 mostly idle streams through one gateway process.

A real deployment holds many slow streams (a GPU emits a token every few tens to hundreds of ms per
sequence, and clients read slowly), so what limits one gateway process is less its CPU per token
than what each open stream costs it: memory, and the event loop's time to visit every stream. Each
level starts fresh slow pods (``ceil(streams / --streams-per-pod)`` pod simulators: one simulator
cannot keep its pacing at 10,000 streams) and a fresh gateway, then runs ``loadtest.loadgen`` with
every stream's first request spread over one request's duration (``--ramp-s``), two requests per
stream, so that for a whole request's time all streams are in flight at once.

Per level: the gateway's peak RSS (``VmHWM``) and memory per stream (its growth over the smallest
level, per added stream); the gateway's CPU per 1,000 tokens (utime + stime, as ``loadtest.bench``);
the gateway's own event-loop lag (its ``sluicegate_event_loop_lag_seconds`` histogram, scraped
before and after); TTFT; errors. The curve "breaks" at the first level with errors, TTFT p99 above
``--ttft-bound-ms`` or lag p99 above ``--lag-bound-ms``. Pods and the load generator share core 0,
the gateway has core 1 (``loadtest.bench``'s pinning); "core 0 busy" near 100 % means the load side,
not the gateway, set the pace at that level.

Over HTTP/1.1 every stream holds two of the gateway's descriptors (the client's and the pod's). A
level that would need more than the gateway's open-file limit (20,000 on the machine the project
measures on, which not even root may raise) is driven over HTTP/2 instead: Debian's ``h2load``, 100
streams per connection, so the gateway holds one descriptor per stream plus one per 100. ``h2load``
reports no time to first token, so such a level has none; its tokens are the gateway's own count
(``sluicegate_tokens_total``), which counts every ending.

    python -m loadtest.bench_scale [--levels 100,500,1000,2000,5000,10000] [--json F] [--write-md F]
    python -m loadtest.bench_scale --levels 20,40 --tokens 4 --itl-ms 100 --ttft-ms 50   # smoke
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gateway.rlimits import raise_open_file_limit
from loadtest.bench import (
    LOAD_CORE,
    MODEL,
    Scenario,
    can_pin,
    cpu_delta_s,
    cpu_ticks,
    machine_summary,
    peak_rss_kib,
    pin_prefix,
    process_tree,
    run_loadgen,
    start_gateway,
    warm_up,
)
from loadtest.bench_overload import bucket_quantile
from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from loadtest.report import command_line, publish, read_saved

SCHEMA = "sluicegate.bench_scale/1"
DEFAULT_LEVELS = (100, 500, 1000, 2000, 5000, 10000)
LAG_METRIC = "sluicegate_event_loop_lag_seconds"


@dataclass(frozen=True, slots=True)
class ScaleSpec:
    """The pods' pacing and the bounds that decide where the curve breaks."""

    tokens: int = 20
    itl_ms: float = 750.0
    ttft_ms: float = 500.0
    requests: int = 2
    streams_per_pod: int = 2000
    ttft_bound_ms: float = 1500.0
    lag_bound_ms: float = 100.0

    @property
    def request_s(self) -> float:
        return (self.ttft_ms + self.tokens * self.itl_ms) / 1000


@dataclass(slots=True)
class Level:
    """What one level measured (sizes in KiB, times in ms unless named otherwise)."""

    streams: int
    pods: int
    client: str = "loadgen (h1)"
    requests: int = 0
    ok: int = 0
    errors: int = 0
    completed_streams: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    ttft_ms: dict[str, float | None] = field(default_factory=dict)
    gateway_cpu_s: float | None = None
    cpu_ms_per_1k_tokens: float | None = None
    gateway_core_busy: float | None = None
    peak_rss_kib: int | None = None
    live_rss_kib: int | None = None
    mem_per_stream_kib: float | None = None
    lag_ms: dict[str, float | None] = field(default_factory=dict)
    core0_busy: float | None = None
    error_samples: list[str] = field(default_factory=list)
    failure: str | None = None
    broke: str | None = None


# --------------------------------------------------------------------------- measuring


def _rss_kib(pid: int) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class RssSampler:
    """The gateway's largest ``VmRSS`` while the load runs (``VmHWM`` also counts start-up peaks)."""

    def __init__(self, pid: int, period_s: float = 0.25) -> None:
        self.pid, self.period_s = pid, period_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.peak = max(self.peak, _rss_kib(self.pid))

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _metrics_text(admin_url: str) -> str:
    """The gateway's ``/metrics`` page."""
    parts = urlsplit(admin_url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=10)
    try:
        conn.request("GET", "/metrics")
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def scrape_histogram(admin_url: str, name: str = LAG_METRIC) -> dict[float, float]:
    """Cumulative bucket counts (upper bound -> count) of histogram ``name`` from ``/metrics``."""
    text = _metrics_text(admin_url)
    buckets: dict[float, float] = {}
    prefix = f'{name}_bucket{{le="'
    for line in text.splitlines():
        if line.startswith(prefix):
            bound, _, value = line[len(prefix):].partition('"} ')
            buckets[math.inf if bound == "+Inf" else float(bound)] = float(value)
    return buckets


def histogram_quantile(q: float, before: dict[float, float], after: dict[float, float]) -> float | None:
    """The ``q`` quantile (0-1) of what was observed between two scrapes, interpolated inside its
    bucket as Prometheus' ``histogram_quantile`` does; None when nothing was observed."""
    observed = sorted((bound, count - before.get(bound, 0.0)) for bound, count in after.items())
    return bucket_quantile(observed, q) if observed and observed[-1][1] > 0 else None


def lag_summary(before: dict[float, float], after: dict[float, float]) -> dict[str, float | None]:
    """p50 / p99 of the lag in ms, and the upper bound of the highest bucket anything landed in."""
    out: dict[str, float | None] = {}
    for name, q in (("p50", 0.5), ("p99", 0.99)):
        got = histogram_quantile(q, before, after)
        out[name] = None if got is None else round(got * 1000, 3)
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    top = next((b for b, c in zip(bounds, counts, strict=True) if counts and c >= counts[-1] > 0), None)
    out["max_le"] = None if top is None or math.isinf(top) else round(top * 1000, 3)
    out["samples"] = counts[-1] if counts else 0
    return out


# --------------------------------------------------------------------------- one level


def start_pods(count: int, streams: int, spec: ScaleSpec, pin: bool) -> list[PodsimProcess]:
    """``count`` slow pods on the load core, each with room for its share of the streams."""
    each = math.ceil(streams / count)
    args = [
        "--model", MODEL, "--host", "127.0.0.1", "--log-level", "warning",
        "--ttft-ms", f"{spec.ttft_ms:g}", "--itl-ms", f"{spec.itl_ms:g}", "--itl-per-seq-ms", "0",
        "--max-num-seqs", str(max(256, each * 2)), "--kv-blocks", str(max(100_000, each * 64)),
    ]
    pods: list[PodsimProcess] = []
    try:
        for _ in range(count):
            pods.append(PodsimProcess(args, command_prefix=pin_prefix(LOAD_CORE, pin)).start())
    except Exception:
        for pod in pods:
            pod.stop()
            pod.close()
        raise
    return pods


H2_STREAMS_PER_CONN = 100
TOKENS_METRIC = 'sluicegate_tokens_total{'
_H2LOAD_REQUESTS = re.compile(
    r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, (\d+) errored"
)
_H2LOAD_FINISHED = re.compile(r"finished in ([\d.]+)(m?s)")
_TIME = r"\s+([\d.]+)(us|ms|s)"
_H2LOAD_REQUEST_TIME = re.compile(r"time for request:" + _TIME * 3)


def needs_h2(streams: int) -> bool:
    """Whether ``streams`` HTTP/1.1 streams would need more descriptors than the gateway may open."""
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[1]  # the gateway raises its soft limit to this
    return limit != resource.RLIM_INFINITY and 2 * streams + 512 > limit


def scrape_counter(admin_url: str, prefix: str) -> float:
    """The sum of every series of the counter whose lines start with ``prefix`` in ``/metrics``."""
    text = _metrics_text(admin_url)
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)
               and 'kind="completion"' in line)  # fmt: skip


def _ms(value: str, unit: str) -> float:
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


def run_h2load(url: str, streams: int, spec: ScaleSpec, pin: bool) -> dict[str, Any]:
    """``streams`` concurrent streams over h2c with ``h2load`` (``spec.requests`` each), summarised
    in ``loadtest.loadgen``'s keys (no TTFT: ``h2load`` times whole requests only)."""
    if shutil.which("h2load") is None:
        raise RuntimeError("h2load is not installed (Debian: nghttp2-client); levels above the open-file "
                           "limit need it")  # fmt: skip
    body = json.dumps({
        "model": MODEL, "stream": True, "max_tokens": spec.tokens,
        "messages": [{"role": "user", "content": "Hold this stream open."}],
    }).encode()  # fmt: skip
    conns = math.ceil(streams / H2_STREAMS_PER_CONN)
    with tempfile.NamedTemporaryFile(suffix=".json") as data:
        data.write(body)
        data.flush()
        argv = [
            *pin_prefix(LOAD_CORE, pin), "h2load", "-n", str(streams * spec.requests), "-c", str(conns),
            "-m", str(H2_STREAMS_PER_CONN), "-d", data.name, "-H", "content-type: application/json",
            "-T", "120", "-N", "120", url,
        ]  # fmt: skip
        cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
        cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = done.stdout
    counts = _H2LOAD_REQUESTS.search(out)
    finished = _H2LOAD_FINISHED.search(out)
    if counts is None or finished is None:
        raise RuntimeError(f"h2load gave no summary (exit {done.returncode}): {(done.stderr or out)[-500:]}")
    total, _started, _done, succeeded, _failed, _errored = map(int, counts.groups())
    wall = _ms(*finished.groups()) / 1000
    timing = _H2LOAD_REQUEST_TIME.search(out)
    e2e = {} if timing is None else {"min": _ms(*timing.groups()[0:2]), "max": _ms(*timing.groups()[2:4]),
                                     "mean": _ms(*timing.groups()[4:6])}  # fmt: skip
    return {
        "requests": total, "ok": succeeded, "errors": total - succeeded,
        "completed_streams": streams if succeeded == total else succeeded // max(1, spec.requests),
        "wall_s": round(wall, 3), "ttft_ms": {}, "e2e_ms": e2e,
        "loadgen_cpu_s": {"user": cpu1.ru_utime - cpu0.ru_utime, "sys": cpu1.ru_stime - cpu0.ru_stime},
        "error_samples": [] if succeeded == total else [out[-300:]],
    }


def run_level(streams: int, spec: ScaleSpec, pin: bool) -> Level:
    """Fresh pods and a fresh gateway; the ramped load; what the gateway spent and how it held up."""
    level = Level(streams, max(1, math.ceil(streams / spec.streams_per_pod)))
    pods: list[PodsimProcess] = []
    gateway: GatewayProcess | None = None
    try:
        pods = start_pods(level.pods, streams, spec, pin)
        config = {"pods": [{"name": f"pod-{i}", "url": p.url, "models": [MODEL]} for i, p in enumerate(pods)]}
        gateway = start_gateway(pods[0].url, pin, config)
        warm_up(gateway.url, count=2)  # first-request costs (imports, pools) stay out of the numbers
        scenario = Scenario(
            "scale", f"{streams} slow streams", streams, spec.requests, spec.tokens,
            itl_ms=spec.itl_ms, ttft_ms=spec.ttft_ms, ramp_s=spec.request_s,
        )
        pids = process_tree(gateway.pid)
        pod_pids = [p.pid for p in pods]
        lag0 = scrape_histogram(gateway.admin_url)
        cpu0, pod0 = cpu_ticks(pids), cpu_ticks(pod_pids)
        url = gateway.url + "/v1/chat/completions"
        over_h2 = needs_h2(streams)
        tokens0 = scrape_counter(gateway.admin_url, TOKENS_METRIC) if over_h2 else 0.0
        with RssSampler(gateway.pid) as sampler:
            if over_h2:
                level.client = f"h2load (h2c, {H2_STREAMS_PER_CONN} streams a connection)"
                load = run_h2load(url, streams, spec, pin)
                load["tokens"] = int(scrape_counter(gateway.admin_url, TOKENS_METRIC) - tokens0)
            else:
                load = run_loadgen(url, scenario, pin)
        user, system = cpu_delta_s(cpu0, cpu_ticks(pids))
        pod_user, pod_sys = cpu_delta_s(pod0, cpu_ticks(pod_pids))
        lag1 = scrape_histogram(gateway.admin_url)
        level.peak_rss_kib = peak_rss_kib(pids)
        level.live_rss_kib = sampler.peak or None
        level.lag_ms = lag_summary(lag0, lag1)
        level.requests, level.ok, level.errors = load["requests"], load["ok"], load["errors"]
        level.completed_streams, level.tokens = load["completed_streams"], load["tokens"]
        level.wall_s, level.ttft_ms = load["wall_s"], load["ttft_ms"]
        level.error_samples = load.get("error_samples", [])[:3]
        level.gateway_cpu_s = round(user + system, 3)
        if level.tokens:
            level.cpu_ms_per_1k_tokens = round((user + system) * 1e6 / level.tokens, 2)
        if level.wall_s:
            level.gateway_core_busy = round((user + system) / level.wall_s, 3)
            lg = load.get("loadgen_cpu_s", {})
            load_side = pod_user + pod_sys + lg.get("user", 0.0) + lg.get("sys", 0.0)
            level.core0_busy = round(load_side / level.wall_s, 3)
    except (RuntimeError, OSError, ValueError, KeyError, http.client.HTTPException) as exc:
        level.failure = f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        if gateway is not None:
            gateway.__exit__(None, None, None)
        for pod in pods:
            pod.stop()
            pod.close()
    return level


# --------------------------------------------------------------------------- verdicts and report


def judge(levels: list[Level], spec: ScaleSpec) -> None:
    """Memory per stream over the smallest level, and why each level counts as broken (or not)."""
    base = next((lv for lv in levels if lv.peak_rss_kib and lv.failure is None), None)
    for level in levels:
        if base is not None and level is not base and level.peak_rss_kib and level.streams > base.streams:
            grown = level.peak_rss_kib - base.peak_rss_kib
            level.mem_per_stream_kib = round(grown / (level.streams - base.streams), 2)
        reasons = []
        if level.failure:
            reasons.append("the level could not run")
        if level.errors or level.completed_streams < level.streams:
            complete = f"{level.completed_streams}/{level.streams} streams complete"
            reasons.append(f"{level.errors} errors, {complete}")
        p99 = level.ttft_ms.get("p99")
        if p99 is not None and p99 > spec.ttft_bound_ms:
            reasons.append(f"TTFT p99 {p99:.0f} ms > {spec.ttft_bound_ms:g}")
        lag = level.lag_ms.get("p99")
        if lag is not None and lag > spec.lag_bound_ms:
            reasons.append(f"loop lag p99 {lag:.0f} ms > {spec.lag_bound_ms:g}")
        level.broke = "; ".join(reasons) or None


def plan_streams_per_core(levels: list[Level], spec: ScaleSpec) -> dict[str, Any]:
    """Streams one gateway core can be planned for at this pacing: the largest level that held,
    capped by the CPU estimate (the core at 70 % busy at the measured CPU per token)."""
    held = [lv for lv in levels if lv.broke is None]
    if not held:
        return {"streams": None, "held_up_to": None, "cpu_estimate": None}
    top = max(held, key=lambda lv: lv.streams)
    estimate = None
    if top.cpu_ms_per_1k_tokens:
        tokens_per_s_per_stream = 1000 / spec.itl_ms
        core_tokens_per_s = 0.7 * 1e6 / top.cpu_ms_per_1k_tokens
        estimate = int(core_tokens_per_s / tokens_per_s_per_stream)
    broke = next((lv for lv in levels if lv.broke is not None and lv.streams > top.streams), None)
    streams = top.streams if estimate is None else min(top.streams, estimate)
    return {
        "streams": streams, "held_up_to": top.streams, "cpu_estimate": estimate,
        "first_broken": None if broke is None else {"streams": broke.streams, "why": broke.broke},
    }


def _f(value: float | None, digits: int = 1, scale: float = 1.0) -> str:
    return "—" if value is None else f"{value * scale:.{digits}f}"


def render(saved: dict[str, Any]) -> str:
    """The Markdown ``bench:scale`` section."""
    spec = ScaleSpec(**saved["spec"])
    levels = [Level(**lv) for lv in saved["levels"]]
    plan = saved["plan"]
    out = [
        f"Command: `{saved['command']}`  ",
        f"Machine: {saved['machine']}  ",
        f"Pods: {spec.tokens} tokens a request, {spec.ttft_ms:g} ms to the first token then one every "
        f"{spec.itl_ms:g} ms ({1000 / spec.itl_ms:.2f} tokens/s a stream), one pod simulator per "
        f"{spec.streams_per_pod} streams; {spec.requests} requests a stream, first requests spread over "
        f"{spec.request_s:g} s; total time {saved.get('elapsed_s', 0):.0f} s.",
        "",
        "| streams | client | pods | ok / requests | errors | TTFT p50 / p99 ms "
        "| gateway CPU-ms per 1k tokens | gateway core busy | peak RSS MiB | memory per stream KiB "
        "| loop lag p50 / p99 ms | core 0 busy | held? |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for lv in levels:
        if lv.failure:
            out.append(f"| {lv.streams} | {lv.client} | {lv.pods} | — | — | — | — | — | — | — | — | — "
                       f"| no: {lv.failure} |")  # fmt: skip
            continue
        ttft = f"{_f(lv.ttft_ms.get('p50'), 0)} / {_f(lv.ttft_ms.get('p99'), 0)}"
        lag = f"{_f(lv.lag_ms.get('p50'), 1)} / {_f(lv.lag_ms.get('p99'), 1)}"
        rss = None if lv.peak_rss_kib is None else lv.peak_rss_kib / 1024
        out.append(
            f"| {lv.streams} | {lv.client} | {lv.pods} | {lv.ok} / {lv.requests} | {lv.errors} | {ttft} "
            f"| {_f(lv.cpu_ms_per_1k_tokens)} | {_f(lv.gateway_core_busy, 0, 100)} % | {_f(rss)} "
            f"| {_f(lv.mem_per_stream_kib)} | {lag} | {_f(lv.core0_busy, 0, 100)} % "
            f"| {'yes' if lv.broke is None else 'no: ' + lv.broke} |"
        )
    out.append("")
    out.append(
        f"Memory per stream: growth of the gateway's peak RSS over the {levels[0].streams}-stream level, per "
        f"added stream. Held: no errors, every stream complete, TTFT p99 <= {spec.ttft_bound_ms:g} ms, "
        f"event-loop lag p99 <= {spec.lag_bound_ms:g} ms (the gateway's own histogram)."
    )
    samples = [f"{lv.streams}: {s}" for lv in levels for s in lv.error_samples]
    if samples:
        out.append(f"Errors seen: {'; '.join(samples[:4])}.")
    if plan["streams"] is None:
        out.append("\n**Plan:** no level held; see the reasons above.")
    else:
        estimate = plan["cpu_estimate"]
        cpu = "" if estimate is None else (
            f"; at its measured CPU per token one core would be 70 % busy at ~{estimate} such streams")
        broke = plan.get("first_broken")
        where = "" if broke is None else f" It broke at {broke['streams']} streams ({broke['why']})."
        out.append(
            f"\n**Plan for {plan['streams']} streams per gateway core** at {1000 / spec.itl_ms:.2f} tokens/s "
            f"a stream (held up to {plan['held_up_to']}{cpu}); at faster pacing scale by the token rate, "
            f"since CPU follows tokens and memory follows streams.{where}"
        )
    return "\n".join(out)


# --------------------------------------------------------------------------- CLI


def _levels(text: str) -> list[int]:
    try:
        levels = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole numbers and commas, not {text!r}") from None
    if not levels or levels[0] < 1:
        raise argparse.ArgumentTypeError("levels must be whole numbers above 0")
    return levels


def build_parser() -> argparse.ArgumentParser:
    defaults = ScaleSpec()
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_scale", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--levels", type=_levels, default=list(DEFAULT_LEVELS),
                        help="concurrent streams per level (default 100,500,1000,2000,5000,10000)")
    parser.add_argument("--tokens", type=int, default=defaults.tokens, help="tokens a request (default 20)")
    parser.add_argument("--itl-ms", type=float, default=defaults.itl_ms, help="pod pacing (default 750)")
    parser.add_argument("--ttft-ms", type=float, default=defaults.ttft_ms, help="pod TTFT (default 500)")
    parser.add_argument("--streams-per-pod", type=int, default=defaults.streams_per_pod)
    parser.add_argument("--ttft-bound-ms", type=float, default=defaults.ttft_bound_ms)
    parser.add_argument("--lag-bound-ms", type=float, default=defaults.lag_bound_ms)
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    parser.add_argument("--json", metavar="FILE", help="write the levels' numbers here")
    parser.add_argument("--from-json", metavar="FILE", help="run nothing: report an earlier --json")
    parser.add_argument("--write-md", metavar="FILE", help="put the report in FILE's bench:scale section")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the levels (or re-read them), print and publish the report; 1 if a level could not run."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.from_json:
        publish(render(read_saved(parser, args.from_json, SCHEMA)), args.write_md, "scale")
        return 0
    for name in ("tokens", "streams_per_pod"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.itl_ms <= 0 or args.ttft_ms < 0:
        parser.error("--itl-ms must be above 0 and --ttft-ms at least 0")
    spec = ScaleSpec(args.tokens, args.itl_ms, args.ttft_ms, 2, args.streams_per_pod,
                     args.ttft_bound_ms, args.lag_bound_ms)
    soft, _ = raise_open_file_limit()
    pin = not args.no_pin and can_pin()
    if pin:
        os.sched_setaffinity(0, {LOAD_CORE})
    machine = machine_summary(pin)
    # Over HTTP/1.1 each stream holds two of the gateway's sockets (client and pod): levels that
    # would pass the open-files limit are driven over HTTP/2 (h2load) instead.
    fd_note = f"open-files limit {soft}"
    over = [n for n in args.levels if needs_h2(n)]
    if over:
        fd_note += (f": {', '.join(map(str, over))} streams over h2c with h2load ({H2_STREAMS_PER_CONN} a "
                    "connection; no TTFT), the rest over HTTP/1.1 with loadtest.loadgen")  # fmt: skip
    levels: list[Level] = []
    started = time.monotonic()
    for streams in args.levels:
        t0 = time.monotonic()
        level = run_level(streams, spec, pin)
        levels.append(level)
        print(f"bench_scale: {streams} streams: {level.ok}/{level.requests} ok, {level.errors} errors, "
              f"lag p99 {level.lag_ms.get('p99')} ms, {level.failure or ''} [{time.monotonic() - t0:.0f} s]",
              file=sys.stderr)
    judge(levels, spec)
    saved = {
        "schema": SCHEMA, "command": command_line("loadtest.bench_scale", argv),
        "machine": f"{machine}; {fd_note}", "elapsed_s": round(time.monotonic() - started, 1),
        "spec": asdict(spec), "levels": [asdict(lv) for lv in levels],
        "plan": plan_streams_per_core(levels, spec),
        "harness_max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(saved, indent=2) + "\n")
    publish(render(saved), args.write_md, "scale")
    return 1 if any(lv.failure for lv in levels) else 0


if __name__ == "__main__":
    sys.exit(main())
