"""Overload benchmark: 500 streams through one pod whose core is saturated, gateway and nginx alike.

The pod simulator (256 tokens per answer at 5 ms a token, room for every sequence) shares core 0
with the load generator; 500 closed-loop clients ask it for far more tokens per second than one
Python core can produce, so the pod's event loop lags, and its ``/health`` answers late. The proxy
under test runs alone on core 1. This is overload, not failure: the pod streams to every client it
admitted, and the promise is that the gateway answers every request with either a whole stream or
a fast 429 with Retry-After, never an error and never a 503 (issue 10: nginx and the Rust vLLM
router answered every request; the gateway had marked the pod unhealthy on slow probes).

Besides the answers, each run records what the gateway thought of the pod (health transitions, probe
timeouts excused because live traffic vouched for the pod, panic routing) and the probe round trip
twice: as the gateway's probe thread timed it, and as an independent prober process beside the pod
timed the same ``GET /health`` at the same time.

    python -m loadtest.bench_overload [--streams 500] [--seconds 20] [--soak-seconds 60] [--write-md FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gateway.rlimits import raise_open_file_limit
from loadtest.bench import LOAD_CORE, PROXY_CORE, can_pin, cpu_delta_s, cpu_ticks, pin_prefix, process_tree
from loadtest.loadgen import LoadSpec, percentile, run_load
from loadtest.nginx import NginxProcess, nginx_binary
from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from loadtest.report import command_line, publish

MODEL = "bench-model"

# An independent prober: its own process (its own interpreter lock), one GET /health every 0.5 s,
# printing each round trip in ms, or "timeout" past 1 s (the gateway's default probe timeout).
_PROBER = r"""
import http.client, sys, time
host, port = sys.argv[1], int(sys.argv[2])
while True:
    started = time.perf_counter()
    try:
        conn = http.client.HTTPConnection(host, port, timeout=1.0)
        conn.request("GET", "/health")
        conn.getresponse().read()
        conn.close()
        print(f"{(time.perf_counter() - started) * 1000:.2f}", flush=True)
    except OSError:
        print("timeout", flush=True)
    time.sleep(max(0.0, 0.5 - (time.perf_counter() - started)))
"""


def start_pod(pin: bool, health_delay_ms: float = 0) -> PodsimProcess:
    faults = ["--fault", f"health_delay_ms={health_delay_ms:g}"] if health_delay_ms else []
    args = [*faults, "--model", MODEL, "--ttft-ms", "20", "--itl-ms", "5", "--itl-per-seq-ms", "0",
            "--max-num-seqs", "1024", "--kv-blocks", "400000", "--host", "127.0.0.1",
            "--log-level", "warning"]
    return PodsimProcess(args, command_prefix=pin_prefix(LOAD_CORE, pin)).start()


def gateway_config(pod_url: str) -> dict[str, Any]:
    """Defaults everywhere (probe every 2 s, 1 s timeout, 3 failures out): what an operator runs."""
    return {"server": {"host": "127.0.0.1", "access_log": False},
            "pods": [{"name": "pod", "url": pod_url, "models": [MODEL]}]}


def bucket_quantile(samples: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus-style quantile from cumulative (upper bound, count) buckets, in the bound's unit."""
    samples = sorted(samples)
    total = samples[-1][1] if samples else 0
    if not total:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in samples:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            span = count - lower_count
            return lower_bound + (bound - lower_bound) * ((rank - lower_count) / span if span else 1.0)
        lower_bound, lower_count = bound, count
    return lower_bound


def gateway_view(admin_url: str) -> dict[str, Any]:
    """What the gateway thought of the pod: health transitions, excused timeouts, probe round trips."""
    with urllib.request.urlopen(admin_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    view: dict[str, Any] = {"to_unhealthy": 0.0, "to_degraded": 0.0, "excused": 0.0, "panic": 0.0,
                            "shed_503": 0.0}
    buckets: dict[float, float] = {}  # probes the pod answered (a timeout's time is the timeout)
    timeouts = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "sluicegate_pod_transitions_total" and s.labels.get("kind") == "health":
                key = f"to_{s.labels['to']}"
                if key in view:
                    view[key] += s.value
            elif s.name == "sluicegate_probe_timeouts_excused_total":
                view["excused"] += s.value
            elif s.name == "sluicegate_panic":
                view["panic"] = max(view["panic"], s.value)
            elif s.name == "sluicegate_probe_duration_seconds_bucket" and s.labels["outcome"] != "timeout":
                bound = float(s.labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + s.value
            elif s.name == "sluicegate_probe_duration_seconds_count" and s.labels["outcome"] == "timeout":
                timeouts += s.value
            elif s.name == "sluicegate_shed_total" and s.labels.get("reason") == "no_healthy_pod":
                view["shed_503"] += s.value
    pairs = list(buckets.items())
    view["probe_p50_ms"] = _ms(bucket_quantile(pairs, 0.5))
    view["probe_p99_ms"] = _ms(bucket_quantile(pairs, 0.99))
    view["probe_timeouts"] = timeouts
    view["probes"] = max((c for _, c in pairs), default=0) + timeouts
    return view


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def run_target(name: str, url: str, proxy_pids: list[int], pod: PodsimProcess, streams: int,
               seconds: float, tokens: int, hogs: int = 0) -> dict[str, Any]:
    pin = can_pin()
    # other work on the pod's core (a noisy neighbour): the pod gets a smaller share of it
    burners = [subprocess.Popen([*pin_prefix(LOAD_CORE, pin), sys.executable, "-c", "while True: pass"])
               for _ in range(hogs)]
    try:
        return _measure(name, url, proxy_pids, pod, streams, seconds, tokens)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


def _measure(name: str, url: str, proxy_pids: list[int], pod: PodsimProcess, streams: int,
             seconds: float, tokens: int) -> dict[str, Any]:
    prober = subprocess.Popen(
        [*pin_prefix(LOAD_CORE, can_pin()), sys.executable, "-c", _PROBER, pod.host, str(pod.port)],
        stdout=subprocess.PIPE, text=True,
    )
    spec = LoadSpec(url=url + "/v1/chat/completions", model=MODEL, streams=streams, requests=10**9,
                    max_tokens=tokens, duration_s=seconds, timeout_s=120.0, ramp_s=1.0)
    before = cpu_ticks(proxy_pids)
    summary = asyncio.run(run_load(spec))
    user, system = cpu_delta_s(before, cpu_ticks(proxy_pids))
    prober.terminate()
    out, _ = prober.communicate(timeout=10)
    rtts = [float(line) for line in out.split() if line != "timeout"]
    kinds = dict(summary["error_kinds"])
    shed = kinds.pop("status_429", 0)
    sent = summary["ok"] + summary["errors"]
    row = {
        "target": name, "streams": streams, "seconds": seconds, "requests": sent, "ok": summary["ok"],
        "shed_429": shed, "shed_share": shed / sent if sent else 0.0, "errors": sum(kinds.values()),
        "error_kinds": kinds, "error_samples": summary["error_samples"], "tokens": summary["tokens"],
        "tokens_per_s": summary["tokens_per_s"], "ttft_p50_ms": summary["ttft_ms"]["p50"],
        "ttft_p99_ms": summary["ttft_ms"]["p99"],
        "cpu_ms_per_1k_tokens": (user + system) * 1e6 / summary["tokens"] if summary["tokens"] else None,
        "pod_probe_p50_ms": percentile(rtts, 50), "pod_probe_p99_ms": percentile(rtts, 99),
        "pod_probe_timeouts": out.split().count("timeout"), "pod_probes": len(out.split()),
    }
    return row


def run(streams: int, seconds: float, soak_seconds: float, tokens: int, pin: bool,
        hogs: int = 0, targets: list[str] | None = None, health_delay_ms: float = 0) -> list[dict[str, Any]]:
    rows = []
    plan: list[tuple[str, float]] = [(t, seconds) for t in targets or ("nginx", "gateway")]
    if soak_seconds > 0:
        plan.append(("gateway (soak)", soak_seconds))
    for name, duration in plan:
        if name == "nginx" and nginx_binary() is None:
            print("bench_overload: nginx is not installed; its row is skipped", file=sys.stderr)
            continue
        pod = start_pod(pin, health_delay_ms)
        try:
            if name == "nginx":
                with tempfile.TemporaryDirectory(prefix="sluicegate-nginx-") as tmp:
                    prefix = pin_prefix(PROXY_CORE, pin)
                    nginx = NginxProcess(pod.url, Path(tmp), command_prefix=prefix).start()
                    try:
                        pids = process_tree(nginx.pid)
                        row = run_target(name, nginx.url, pids, pod, streams, duration, tokens, hogs)
                    finally:
                        nginx.stop()
            else:
                with GatewayProcess(gateway_config(pod.url), cpu=PROXY_CORE if pin else None) as gw:
                    row = run_target(name, gw.url, [gw.pid], pod, streams, duration, tokens, hogs)
                    row.update(gateway_view(gw.admin_url))
        finally:
            pod.stop()
        rows.append(row)
        print(f"  {name}: {row['requests']} requests, {row['ok']} whole, {row['shed_429']} x 429, "
              f"{row['errors']} errors {row['error_kinds'] or ''}", file=sys.stderr, flush=True)
    return rows


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render(rows: list[dict[str, Any]], command: str) -> str:
    lines = [
        f"Command: `{command}`",
        "",
        "| target | seconds | requests | whole streams | 429 (share) | errors | tokens/s | TTFT p50 / p99 ms "
        "| proxy CPU ms / 1000 tokens | pod marked unhealthy / degraded | probe timeouts excused "
        "| gateway's probe p50 / p99 ms (timeouts) | independent probe p50 / p99 ms (timeouts) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        gateway = "to_unhealthy" in r
        marked = f"{r['to_unhealthy']:.0f} / {r['to_degraded']:.0f}" if gateway else "n/a"
        excused = f"{r['excused']:.0f}" if gateway else "n/a"
        probe = (f"{_f(r.get('probe_p50_ms'))} / {_f(r.get('probe_p99_ms'))} ({r['probe_timeouts']:.0f} of "
                 f"{r['probes']:.0f})") if gateway else "n/a"
        errors = str(r["errors"]) + (f" ({', '.join(f'{k}: {v}' for k, v in r['error_kinds'].items())})"
                                     if r["error_kinds"] else "")
        lines.append(
            f"| {r['target']} | {r['seconds']:g} | {r['requests']} | {r['ok']} | {r['shed_429']} "
            f"({r['shed_share']:.1%}) | {errors} | {r['tokens_per_s']:.0f} | {_f(r['ttft_p50_ms'])} / "
            f"{_f(r['ttft_p99_ms'])} | {_f(r['cpu_ms_per_1k_tokens'])} | {marked} | {excused} | {probe} | "
            f"{_f(r['pod_probe_p50_ms'])} / {_f(r['pod_probe_p99_ms'])} ({r['pod_probe_timeouts']} of "
            f"{r['pod_probes']}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_overload",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--soak-seconds", type=float, default=60.0, help="0: no soak")
    parser.add_argument("--hogs", type=int, default=0,
                        help="busy processes beside the pod on its core (a noisy neighbour)")
    parser.add_argument("--targets", default="nginx,gateway", help="comma-separated: nginx, gateway")
    parser.add_argument("--health-delay-ms", type=float, default=0,
                        help="the pod's /health answers this late (vLLM's API server, busy streaming)")
    parser.add_argument("--write-md", metavar="FILE")
    parser.add_argument("--section", default="overload", help="the marked section of --write-md to replace")
    args = parser.parse_args(argv)
    raise_open_file_limit()
    pin = can_pin()
    if pin:  # the pods, the prober and this load generator stay off the proxy's core
        os.sched_setaffinity(0, {LOAD_CORE})
    rows = run(args.streams, args.seconds, args.soak_seconds, args.tokens, pin, args.hogs,
               args.targets.split(","), args.health_delay_ms)
    command = command_line("loadtest.bench_overload", argv)
    publish(render(rows, command), args.write_md, args.section)
    failed = [r for r in rows if r["target"] != "nginx" and (r["errors"] or r["to_unhealthy"])]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
