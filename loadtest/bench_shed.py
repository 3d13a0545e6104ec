"""Shedding benchmark: how fast a client hears "429, come back later" when every pod is full.

Two simulated pods report a 97 % full KV cache (the ``kv_usage`` fault), so the gateway's pressure
breaker is open on both. Clients then send chat requests, one at a time and 50 at once, and time
the full answer. The promise under test: a 429 with Retry-After in well under 10 ms, never a queue.

    python -m loadtest.bench_shed [--requests 2000] [--write-md FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.loadgen import percentile
from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from loadtest.report import replace_marked_section

MD_BEGIN = "<!-- bench:shed:begin -->"
MD_END = "<!-- bench:shed:end -->"
CHAT = {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
CHAT["stream"] = True


def _breakers_open(url: str) -> bool:
    with urllib.request.urlopen(url + "/admin/pods", timeout=5) as resp:
        pods = json.loads(resp.read())["pods"]
    return all(p["state"]["breaker"]["pressure"] == "open" for p in pods)


async def _fire(url: str, requests: int, concurrency: int) -> tuple[list[float], dict[int, int], int]:
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    with_retry_after = 0
    queue = iter(range(requests))
    async with aiohttp.ClientSession() as session:

        async def worker() -> None:
            nonlocal with_retry_after
            for _ in queue:
                started = time.perf_counter()
                async with session.post(url + "/v1/chat/completions", json=CHAT) as resp:
                    await resp.read()
                latencies.append((time.perf_counter() - started) * 1000)
                statuses[resp.status] = statuses.get(resp.status, 0) + 1
                with_retry_after += "retry-after" in resp.headers

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, statuses, with_retry_after


def run(requests: int) -> list[dict[str, Any]]:
    pods = [PodsimProcess(["--model", "llama-8b", "--fault", "kv_usage=0.97"]) for _ in range(2)]
    for pod in pods:
        pod.start()
    try:
        config = {
            "server": {"host": "127.0.0.1", "access_log": False},
            "pods": [{"name": f"pod-{i}", "url": p.url, "models": ["llama-8b"]} for i, p in enumerate(pods)],
        }
        # The gateway alone on core 1; this client and the pods on core 0 (as in the main benchmark).
        pin = len(os.sched_getaffinity(0)) >= 2
        with GatewayProcess(config, cpu=1 if pin else None) as gw:
            deadline = time.monotonic() + 10
            while not _breakers_open(gw.url):
                if time.monotonic() > deadline:
                    raise RuntimeError("the pressure breakers never opened")
                time.sleep(0.1)
            rows = []
            for concurrency in (1, 50):
                lat, statuses, retry_after = asyncio.run(_fire(gw.url, requests, concurrency))
                rows.append(
                    {
                        "concurrency": concurrency,
                        "requests": requests,
                        "statuses": statuses,
                        "with_retry_after": retry_after,
                        "p50_ms": percentile(lat, 50),
                        "p99_ms": percentile(lat, 99),
                        "max_ms": max(lat),
                    }
                )
            return rows
    finally:
        for pod in pods:
            pod.stop()


def render(rows: list[dict[str, Any]], command: str) -> str:
    lines = [
        f"Command: `{command}`",
        "",
        "| clients at once | requests | answers | with Retry-After | p50 ms | p99 ms | max ms |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        answers = ", ".join(f"{n} x {status}" for status, n in sorted(r["statuses"].items()))
        lines.append(
            f"| {r['concurrency']} | {r['requests']} | {answers} | {r['with_retry_after']} | "
            f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['max_ms']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_shed", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--write-md", metavar="FILE")
    args = parser.parse_args(argv)
    if len(os.sched_getaffinity(0)) >= 2:
        os.sched_setaffinity(0, {0})
    rows = run(args.requests)
    command = "python -m loadtest.bench_shed " + " ".join(argv if argv is not None else sys.argv[1:])
    section = render(rows, command.strip())
    print(section)
    if args.write_md:
        replace_marked_section(Path(args.write_md), MD_BEGIN, MD_END, section)
    return 0 if all(r["statuses"] == {429: r["requests"]} for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
