"""Shedding benchmark: how fast a client hears "429, come back later" when every pod is full.

Two simulated pods report a 97 % full KV cache (the ``kv_usage`` fault), so the gateway's pressure
breaker is open on both. Clients then send chat requests and time the full answer: one at a time;
at a fixed rate (open loop, 500 and 1000 a second); and 50 at once back to back, which measures the
gateway's own ceiling. The promise under test: a 429 with Retry-After in well under 10 ms (issue 4:
p99 <= 5 ms under overload), never a queue.

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
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from loadtest.bench import LOAD_CORE, PROXY_CORE, can_pin, cpu_delta_s, cpu_ticks
from loadtest.loadgen import percentile
from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from loadtest.report import command_line, publish

CHAT = {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
CHAT["stream"] = True


def _breakers_open(admin_url: str) -> bool:
    with urllib.request.urlopen(admin_url + "/admin/pods", timeout=5) as resp:
        pods = json.loads(resp.read())["pods"]
    return all(p["state"]["breaker"]["pressure"] == "open" for p in pods)


@dataclass
class Answers:
    """Every answer's latency (ms, from its start or its schedule), statuses, and how many had Retry-After."""

    latencies: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    with_retry_after: int = 0

    async def ask(self, session: aiohttp.ClientSession, url: str, started: float) -> None:
        async with session.post(url + "/v1/chat/completions", json=CHAT) as resp:
            await resp.read()
        self.latencies.append((time.perf_counter() - started) * 1000)
        self.statuses[resp.status] = self.statuses.get(resp.status, 0) + 1
        self.with_retry_after += "retry-after" in resp.headers


async def _fire(url: str, requests: int, concurrency: int) -> Answers:
    """Closed loop: ``concurrency`` clients, each sending its next request when the last is answered."""
    answers = Answers()
    queue = iter(range(requests))
    async with aiohttp.ClientSession() as session:

        async def worker() -> None:
            for _ in queue:
                await answers.ask(session, url, time.perf_counter())

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return answers


async def _fire_at_rate(url: str, requests: int, rate: float, connections: int) -> Answers:
    """Open loop: requests start on a fixed schedule (``rate`` per second) whatever the answers do.

    Each latency runs from the request's scheduled start, so a gateway that falls behind is charged
    for the wait (no coordinated omission). This is overload as a pod sees it: more requests than
    capacity, arriving at the pace clients send them, not a flood paced by the gateway's own answers.
    """
    answers = Answers()
    connector = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=connector) as session:
        # Open the connections first, so the run measures answers, not TCP handshakes.
        await asyncio.gather(*(session.get(url + "/healthz") for _ in range(connections)))

        start = time.perf_counter()
        tasks = []
        for i in range(requests):
            scheduled = start + i / rate
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(answers.ask(session, url, scheduled)))
        await asyncio.gather(*tasks)
    return answers


def run(requests: int, pin: bool) -> list[dict[str, Any]]:
    pods = [PodsimProcess(["--model", "llama-8b", "--fault", "kv_usage=0.97"]) for _ in range(2)]
    for pod in pods:
        pod.start()
    try:
        config = {
            "server": {"host": "127.0.0.1", "access_log": False},
            "pods": [{"name": f"pod-{i}", "url": p.url, "models": ["llama-8b"]} for i, p in enumerate(pods)],
        }
        # The gateway alone on its core; this client and the pods on the load core (see main).
        with GatewayProcess(config, cpu=PROXY_CORE if pin else None) as gw:
            deadline = time.monotonic() + 10
            while not _breakers_open(gw.admin_url):
                if time.monotonic() > deadline:
                    raise RuntimeError("the pressure breakers never opened")
                time.sleep(0.1)
            rows = []
            runs = [("1 client, back to back", _fire(gw.url, requests, 1))]
            for rate in (500, 1000):
                runs.append((f"{rate}/s open loop", _fire_at_rate(gw.url, requests, rate, 64)))
            runs.append(("50 clients, back to back", _fire(gw.url, requests, 50)))
            for load, coro in runs:
                began = time.perf_counter()
                cpu_before = cpu_ticks([gw.pid])
                answers = asyncio.run(coro)
                user, system = cpu_delta_s(cpu_before, cpu_ticks([gw.pid]))
                lat = answers.latencies
                rows.append(
                    {
                        "load": load,
                        "requests": requests,
                        "per_s": requests / (time.perf_counter() - began),
                        "cpu_ms": (user + system) * 1000 / requests,
                        "statuses": answers.statuses,
                        "with_retry_after": answers.with_retry_after,
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
        "| load | requests | answered per s | answers | with Retry-After | gateway CPU ms each "
        "| p50 ms | p99 ms | max ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        answers = ", ".join(f"{n} x {status}" for status, n in sorted(r["statuses"].items()))
        lines.append(
            f"| {r['load']} | {r['requests']} | {r['per_s']:.0f} | {answers} | {r['with_retry_after']} | "
            f"{r['cpu_ms']:.2f} | "
            f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['max_ms']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_shed", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--write-md", metavar="FILE")
    args = parser.parse_args(argv)
    pin = can_pin()
    if pin:  # before starting anything: the pods, like this client, stay off the gateway's core
        os.sched_setaffinity(0, {LOAD_CORE})
    rows = run(args.requests, pin)
    command = command_line("loadtest.bench_shed", argv)
    publish(render(rows, command), args.write_md, "shed")
    return 0 if all(r["statuses"] == {429: r["requests"]} for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
