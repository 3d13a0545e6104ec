"""``serve --workers N``: what a second worker process buys on this machine.

One pod simulator, as fast as it can go (no pacing), and the gateway with every feature on (as the
``gateway`` target of ``loadtest.bench``) run with one worker and with two, and the pod straight.
Nothing is pinned: the workers are meant to use every core, and they share this 2-core machine with
the pod and the load generator, so the figures are what the whole host delivers at saturation:

- tokens/s received by the load generator;
- the gateway's CPU per 1000 tokens (every process of it: with two workers, the supervisor, both
  workers and the private ``redis-server`` that carries their shared quota counters);
- the cores the gateway kept busy (its CPU seconds over the wall time).

    python -m loadtest.bench_workers [--streams 256] [--tokens 512] [--repeats 3] [--write-md FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from gateway.rlimits import raise_open_file_limit
from loadtest.bench import (
    Scenario,
    auth_headers,
    cpu_delta_s,
    cpu_ticks,
    gateway_config,
    process_tree,
    run_loadgen,
    start_gateway,
    start_pod,
    warm_up,
)
from loadtest.report import command_line, publish

TARGETS = {"direct": 0, "1 worker": 1, "2 workers": 2}


def run_once(target: str, scenario: Scenario, scratch: Path) -> dict[str, Any]:
    """A fresh pod (and gateway), a warm-up, then the load; tokens/s and the gateway's CPU."""
    workers = TARGETS[target]
    with tempfile.TemporaryDirectory(dir=scratch) as work:
        pod = start_pod(scenario, pin=False)
        gateway = None
        try:
            base, headers = pod.url, {}
            if workers:
                config, key = gateway_config(pod.url, Path(work) / "keys.yaml")
                gateway = start_gateway(pod.url, False, config, workers=workers)
                base, headers = gateway.url, auth_headers(key)
            warm_up(base, headers=headers)
            url = base + "/v1/chat/completions"
            run_loadgen(url, scenario, False, requests=1, max_tokens=2, headers=headers)
            pids = process_tree(gateway.pid) if gateway else []
            before = cpu_ticks(pids)
            load = run_loadgen(url, scenario, False, headers=headers)
            user, system = cpu_delta_s(before, cpu_ticks(process_tree(gateway.pid) if gateway else []))
        finally:
            if gateway is not None:
                gateway.__exit__(None, None, None)
            pod.stop()
            pod.close()
    tokens, wall = load["tokens"], load["wall_s"] or 1.0
    return {
        "target": target, "errors": load["errors"], "tokens_per_s": load["tokens_per_s"],
        "cpu_ms_per_1k": (user + system) * 1e6 / tokens if workers and tokens else None,
        "cores": (user + system) / wall if workers else None,
    }


def render(rows: list[dict[str, Any]], scenario: Scenario, repeats: int, argv: list[str] | None) -> str:
    out = [
        f"Command: `{command_line('loadtest.bench_workers', argv)}`  ",
        f"{scenario.streams} concurrent streams of {scenario.max_tokens} tokens, {scenario.requests} each, "
        f"from a pod with no pacing; nothing pinned; medians of {repeats} interleaved runs.",
        "",
        "| target | errors | tokens/s | gateway CPU-ms per 1000 tokens | gateway cores busy |",
        "| --- | --- | --- | --- | --- |",
    ]
    for target in TARGETS:
        mine = [r for r in rows if r["target"] == target]
        if not mine:
            continue
        tps = statistics.median(r["tokens_per_s"] for r in mine)
        cpu = [r["cpu_ms_per_1k"] for r in mine if r["cpu_ms_per_1k"] is not None]
        cores = [r["cores"] for r in mine if r["cores"] is not None]
        out.append(
            f"| {target} | {sum(r['errors'] for r in mine)} | {tps:.0f} "
            f"| {statistics.median(cpu):.1f} | {statistics.median(cores):.2f} |" if cpu else
            f"| {target} | {sum(r['errors'] for r in mine)} | {tps:.0f} | — | — |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_workers", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--requests", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write-md", metavar="FILE")
    args = parser.parse_args(argv)
    raise_open_file_limit()
    scenario = Scenario("w", "saturation", args.streams, args.requests, args.tokens, itl_ms=0.0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-workers-") as scratch:
        for repeat in range(args.repeats):
            for target in TARGETS:
                row = run_once(target, scenario, Path(scratch))
                print(f"bench_workers: {target} #{repeat + 1}: {row}", file=sys.stderr)
                rows.append(row)
    publish(render(rows, scenario, args.repeats, argv), args.write_md, "workers")
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
