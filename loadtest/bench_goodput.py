"""Goodput against offered load: an open-loop sweep straight at a pod, through the gateway, through nginx.

Closed-loop load cannot show saturation honestly (a slow server just gets fewer requests), so this
runs ``sluicegate loadtest --rate ... --sweep`` (open loop, times from the schedule) at rising
rates. The pod is made to saturate on this box the way a GPU does, not by burning CPU: continuous
batching with at most ``--max-num-seqs`` sequences, each token slower by ``--itl-per-seq-ms`` per
running sequence, and a FIFO queue beyond. Past its capacity, requests wait in that queue, their
time to first token *from the schedule* grows, and goodput (requests meeting every target, per
second) falls while throughput stays flat. A proxy that costs nothing draws the same curve as
direct; the chart and table show whether the gateway and nginx do.

Each target gets a fresh pod (an empty queue); the pod and the load generator run on core 0, the
proxy alone on core 1. The lowest level's per-request TTFTs are kept for the report's TTFT
distribution chart.

    python -m loadtest.bench_goodput [--rates 4,8,...] [--seconds 10] [--json F] [--write-md F]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loadtest.bench import (
    LOAD_CORE,
    MODEL,
    PROXY_CORE,
    TARGETS,
    can_pin,
    machine_summary,
    pin_prefix,
    start_gateway,
)
from loadtest.nginx import NginxProcess, nginx_binary
from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from loadtest.report import command_line, publish, read_saved

SCHEMA = "sluicegate.bench_goodput/1"
DEFAULT_RATES = (4, 8, 12, 16, 20, 24, 28)
GOODPUT = "ttft_ms=500,tpot_ms=40"
MAX_TOKENS = 64
# 32 sequences at most, 10 ms + 0.5 ms per running sequence a token: ~19 requests/s of 64 tokens.
POD_ARGS = ["--ttft-ms", "50", "--itl-ms", "10", "--itl-per-seq-ms", "0.5", "--max-num-seqs", "32",
            "--kv-blocks", "100000"]


def sweep(base_url: str, rates: list[float], seconds: float, pin: bool, workdir: Path) -> dict[str, Any]:
    """``sluicegate loadtest`` (as ``python -m loadtest.loadtest_cli``) on the load core; its sweep JSON
    plus the lowest level's per-request TTFTs."""
    out, raw = workdir / "sweep.json", workdir / "raw.jsonl"
    argv = [
        *pin_prefix(LOAD_CORE, pin), sys.executable, "-m", "loadtest.loadtest_cli", base_url,
        "--model", MODEL, "--rate", "1", "--sweep", ",".join(f"{r:g}" for r in rates),
        "--duration", f"{seconds:g}", "--max-tokens", str(MAX_TOKENS), "--goodput", GOODPUT,
        "--timeout-s", "120", "--json", str(out), "--raw", str(raw),
    ]
    limit = len(rates) * (seconds + 130) + 60
    done = subprocess.run(argv, capture_output=True, text=True, timeout=limit, check=False)
    if not out.exists():
        detail = f"exit {done.returncode}: {done.stderr[-1500:]}"
        raise RuntimeError(f"sluicegate loadtest wrote no summary ({detail})")
    result = json.loads(out.read_text())
    lowest = min(rates)
    ttfts = []
    for line in raw.read_text().splitlines():
        row = json.loads(line)
        if row.get("level") == lowest and row.get("ttft_ms") is not None:
            ttfts.append(row["ttft_ms"])
    result["lowest_level_ttft_ms"] = ttfts
    return result


def run_target(target: str, rates: list[float], seconds: float, pin: bool, scratch: Path) -> dict[str, Any]:
    """A fresh pod, the target in front of it, the sweep."""
    workdir = Path(tempfile.mkdtemp(prefix=f"goodput-{target}-", dir=scratch))
    with PodsimProcess(["--model", MODEL, "--host", "127.0.0.1", *POD_ARGS],
                       command_prefix=pin_prefix(LOAD_CORE, pin)) as pod:
        if target == "direct":
            return sweep(pod.url, rates, seconds, pin, workdir)
        if target == "gateway":
            gateway: GatewayProcess = start_gateway(pod.url, pin)
            try:
                return sweep(gateway.url, rates, seconds, pin, workdir)
            finally:
                gateway.__exit__(None, None, None)
        with NginxProcess(pod.url, workdir / "nginx", command_prefix=pin_prefix(PROXY_CORE, pin)) as nginx:
            return sweep(nginx.url, rates, seconds, pin, workdir)


def render(saved: dict[str, Any]) -> str:
    """The Markdown ``bench:goodput`` section: goodput and throughput per offered rate and target."""
    targets = saved["targets"]
    names = [t for t in TARGETS if t in targets]
    out = [
        f"Command: `{saved['command']}`  ",
        f"Machine: {saved['machine']}  ",
        f"Pod: `{' '.join(POD_ARGS)}` (saturates near 19 requests/s); open-loop constant arrivals, "
        f"{saved['seconds']:g} s a level, {MAX_TOKENS} tokens a request; goodput targets `{GOODPUT}` "
        f"(TTFT from the schedule); total time {saved.get('elapsed_s', 0):.0f} s.",
        "",
        "| offered req/s | " + " | ".join(f"{n} goodput / ok req/s" for n in names) + " |",
        "| --- | " + " | ".join("---" for _ in names) + " |",
    ]
    for rate in saved["rates"]:
        cells = []
        for name in names:
            level = next((lv for lv in targets[name].get("levels", []) if lv["config"]["rate"] == rate), None)
            if level is None:
                cells.append("— (stopped)")
                continue
            errors = level["requests"]["errors"]
            cells.append(f"{level['goodput']['per_s']:.1f} / {level['throughput']['requests_per_s']:.1f}"
                         + (f" ({errors} errors)" if errors else ""))
        out.append(f"| {rate:g} | " + " | ".join(cells) + " |")
    out.append("")
    knees = ", ".join(f"{n} {targets[n].get('knee')}" for n in names)
    out.append(f"Knee (lowest rate within 90 % of the best goodput): {knees} requests/s.")
    stops = [f"{n}: {targets[n]['stopped']}" for n in names if targets[n].get("stopped")]
    if stops:
        out.append(f"Sweeps stopped early: {'; '.join(stops)}.")
    failed = [f"{n}: {e}" for n, e in saved.get("failures", {}).items()]
    if failed:
        out.append(f"Not measured: {'; '.join(failed)}.")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Sweep each target (or re-read an earlier ``--json``); print and publish the section."""
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_goodput", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--rates", default=",".join(map(str, DEFAULT_RATES)), help="offered requests/s")
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds a level (default 10)")
    parser.add_argument("--target", default=",".join(TARGETS), help="direct,gateway,nginx (default all)")
    parser.add_argument("--no-pin", action="store_true")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--from-json", metavar="FILE", help="run nothing: report an earlier --json")
    parser.add_argument("--write-md", metavar="FILE", help="put the report in FILE's bench:goodput section")
    args = parser.parse_args(argv)
    if args.from_json:
        publish(render(read_saved(parser, args.from_json, SCHEMA)), args.write_md, "goodput")
        return 0
    try:
        rates = sorted({float(r) for r in args.rates.split(",") if r.strip()})
    except ValueError:
        parser.error(f"--rates {args.rates!r}: expected numbers separated by commas")
    targets = [t.strip() for t in args.target.split(",") if t.strip()]
    unknown = [t for t in targets if t not in TARGETS]
    if not rates or rates[0] <= 0 or args.seconds <= 0 or unknown or not targets:
        parser.error(f"rates and --seconds must be above 0, targets among {', '.join(TARGETS)}")
    pin = not args.no_pin and can_pin()
    if pin:
        os.sched_setaffinity(0, {LOAD_CORE})
    failures = {}
    if "nginx" in targets and nginx_binary() is None:
        targets.remove("nginx")
        failures["nginx"] = "not installed"
    results: dict[str, Any] = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sluicegate-goodput-") as scratch:
        for target in targets:
            try:
                results[target] = run_target(target, rates, args.seconds, pin, Path(scratch))
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
                failures[target] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(f"bench_goodput: {target}: knee {results.get(target, {}).get('knee')}", file=sys.stderr)
    saved = {
        "schema": SCHEMA, "command": command_line("loadtest.bench_goodput", argv),
        "machine": machine_summary(pin), "elapsed_s": round(time.monotonic() - started, 1),
        "rates": rates, "seconds": args.seconds, "goodput": GOODPUT, "targets": results, "failures": failures,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(saved, indent=1) + "\n")
    publish(render(saved), args.write_md, "goodput")
    return 1 if failures.keys() - {"nginx"} else 0


if __name__ == "__main__":
    sys.exit(main())
