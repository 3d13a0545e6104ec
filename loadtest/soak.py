"""Soak: mixed faults on pods under steady load; every request must end cleanly and in time.

Three pod simulators, a gateway with short timeouts, retries and resume, and ``--concurrency``
clients sending streaming requests for ``--duration`` seconds. Each request draws a fault (pod
drops or stalls mid-stream, answers 503, reports an error mid-stream, holds its first token past
the timeout) or a client that leaves early, or nothing. Checked: every request ends within its
total deadline plus one second, as a success or a clean error in the protocol's own form (an
OpenAI error body, or an SSE error event followed by ``[DONE]``); afterwards the gateway's open
fds, asyncio tasks and in-flight count are back at their baseline.

    python -m loadtest.soak [--duration 60] [--concurrency 40]   # make soak
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import sys
import time
from typing import Any

import aiohttp

from gateway.rlimits import raise_open_file_limit
from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess

TOTAL_S = 4.0
FAULTS = [
    (0.40, None),
    (0.10, "drop_after=4"),
    (0.10, "stall_after=4"),
    (0.08, "status=503"),
    (0.08, "error_after=3"),
    (0.08, "first_token_delay_ms=3000"),
    (0.06, "refuse=1"),
    (0.10, "client_leaves"),
]


def _draw(rng: random.Random) -> str | None:
    x = rng.random()
    for weight, fault in FAULTS:
        if x < weight:
            return fault
        x -= weight
    return None


def _classify(status: int, body: bytes) -> str:
    """ok, clean_error, or a description of what was not clean."""
    if status != 200:
        try:
            error = json.loads(body)["error"]
            return "clean_error" if error.get("message") else "error_without_message"
        except (ValueError, KeyError, TypeError):
            return f"HTTP {status} without an OpenAI error body"
    if not body.endswith(b"data: [DONE]\n\n"):
        return "stream ended without [DONE]"
    return "clean_error" if b'data: {"error"' in body else "ok"


async def _one(session: aiohttp.ClientSession, url: str, fault: str | None) -> tuple[str, float]:
    body = {
        "model": "llama-8b",
        "messages": [{"role": "user", "content": "soak"}],
        "max_tokens": 40,
        "stream": True,
    }
    headers = {"x-podsim-fault": fault} if fault and fault != "client_leaves" else {}
    started = time.monotonic()
    try:
        async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
            if fault == "client_leaves":
                await resp.content.read(200)
                return "client_left", time.monotonic() - started
            data = await resp.read()
            return _classify(resp.status, data), time.monotonic() - started
    except (aiohttp.ClientError, TimeoutError) as exc:
        return f"transport error: {type(exc).__name__}", time.monotonic() - started


async def _drive(
    url: str, duration_s: float, concurrency: int, seed: int
) -> tuple[collections.Counter, float]:
    rng = random.Random(seed)
    outcomes: collections.Counter[str] = collections.Counter()
    slowest = 0.0
    stop_at = time.monotonic() + duration_s
    timeout = aiohttp.ClientTimeout(total=TOTAL_S + 10)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def worker() -> None:
            nonlocal slowest
            while time.monotonic() < stop_at:
                outcome, elapsed = await _one(session, url, _draw(rng))
                slowest = max(slowest, elapsed)
                late = elapsed > TOTAL_S + 1.0
                outcomes["late: " + outcome if late else outcome] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes, slowest


def _runtime(admin_url: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(admin_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    values: dict[str, float] = collections.defaultdict(float)
    for line in text.splitlines():
        for name in (
            "sluicegate_asyncio_tasks",
            "process_open_fds",
            "sluicegate_in_flight_requests",
            "sluicegate_upstream_connections",
        ):
            if line.startswith(name + " ") or line.startswith(name + "{"):
                values[name] += float(line.rsplit(" ", 1)[1])
    return dict(values)


def _unexplained_fds(runtime: dict[str, float]) -> float:
    """Open fds less the pod connections the gateway keeps alive on purpose (idle, pooled, bounded
    by ``max_idle_per_pod`` and closed after ``keepalive_timeout_s``): two descriptors each, its
    socket and, once it has served an HTTP/1.1 request (all of this soak's), the hang-up watch's
    copy of it (``PodConnection.watch_fd``)."""
    return runtime["process_open_fds"] - 2 * runtime.get("sluicegate_upstream_connections", 0)


def run(duration_s: float, concurrency: int, seed: int = 7) -> dict[str, Any]:
    raise_open_file_limit()
    pods = [PodsimProcess(["--model", "llama-8b", "--ttft-ms", "20", "--itl-ms", "10"]) for _ in range(3)]
    for pod in pods:
        pod.start()
    try:
        config = {
            "server": {"host": "127.0.0.1", "access_log": False},
            "timeouts": {"connect_s": 1, "first_token_s": 1.0, "stall_s": 0.5, "total_s": TOTAL_S},
            "retries": {"max_attempts": 3, "budget_ratio": 0.5},
            "resume": {"models": ["*"], "max_per_request": 2},
            "pods": [{"name": f"pod-{i}", "url": p.url, "models": ["llama-8b"]} for i, p in enumerate(pods)],
        }
        with GatewayProcess(config) as gw:
            baseline = _runtime(gw.admin_url)
            outcomes, slowest = asyncio.run(_drive(gw.url, duration_s, concurrency, seed))
            deadline = time.monotonic() + 10
            after = _runtime(gw.admin_url)
            while time.monotonic() < deadline and (
                after.get("sluicegate_in_flight_requests", 0) > 0
                or after["sluicegate_asyncio_tasks"] > baseline["sluicegate_asyncio_tasks"]
                or _unexplained_fds(after) > _unexplained_fds(baseline) + 3
            ):
                time.sleep(0.2)
                after = _runtime(gw.admin_url)
    finally:
        for pod in pods:
            pod.stop()
    bad = {k: v for k, v in outcomes.items() if k not in ("ok", "clean_error", "client_left")}
    leaks = {
        "tasks": (baseline["sluicegate_asyncio_tasks"], after["sluicegate_asyncio_tasks"]),
        "fds": (baseline["process_open_fds"], after["process_open_fds"]),
        "idle_pod_connections": (
            baseline.get("sluicegate_upstream_connections", 0),
            after.get("sluicegate_upstream_connections", 0),
        ),
        "in_flight": after.get("sluicegate_in_flight_requests", 0),
    }
    leaked = (
        after["sluicegate_asyncio_tasks"] > baseline["sluicegate_asyncio_tasks"]
        or _unexplained_fds(after) > _unexplained_fds(baseline) + 3
        or leaks["in_flight"] > 0
    )
    return {
        "requests": sum(outcomes.values()),
        "outcomes": dict(outcomes),
        "not_clean": bad,
        "slowest_s": round(slowest, 3),
        "limit_s": TOTAL_S + 1.0,
        "runtime": leaks,
        "leaked": leaked,
        "passed": not bad and not leaked,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    parser.add_argument("--concurrency", type=int, default=40)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    result = run(args.duration, args.concurrency, args.seed)
    print(json.dumps(result, indent=2))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
