"""How much CPU the simulator spends per relayed token (it must never be a benchmark's bottleneck).

``python -m loadtest.podsim.selfbench [--streams 100 --tokens 256 --itl-ms 5 --rounds 4]`` starts a
simulator process, drives it with concurrent streaming chat requests from this process (aiohttp client),
and reads the simulator's CPU time from ``/proc/<pid>/stat`` (utime + stime, clock ticks) and
``/proc/<pid>/schedstat`` (nanoseconds on CPU) around the run. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Any

import aiohttp

from loadtest.podsim.launch import PodsimProcess

_TOKEN_MARK = b'"delta":{"content":"'


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` from /proc/<pid>/stat, in seconds (clock-tick resolution)."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2 :].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of the whole line)
    return ticks / os.sysconf("SC_CLK_TCK")


def proc_run_ns(pid: int) -> int:
    """Nanoseconds ``pid``'s main thread spent on a CPU (/proc/<pid>/schedstat), 0 if unavailable."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


async def _one_stream(session: aiohttp.ClientSession, url: str, tokens: int) -> int:
    body = {
        "model": "llama-8b",
        "messages": [{"role": "user", "content": "measure me"}],
        "max_tokens": tokens,
        "stream": True,
    }
    seen, carry = 0, b""
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for data in resp.content.iter_any():
            data = carry + data
            seen += data.count(_TOKEN_MARK)
            carry = data[-(len(_TOKEN_MARK) - 1) :]
    return seen


async def drive(url: str, streams: int, tokens: int, rounds: int) -> int:
    """``rounds`` waves of ``streams`` concurrent streams of ``tokens`` tokens; returns tokens received."""
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await _one_stream(session, url, 4)  # warm up the connection path
        total = 0
        for _ in range(rounds):
            counts = await asyncio.gather(*(_one_stream(session, url, tokens) for _ in range(streams)))
            total += sum(counts)
        return total


def measure(streams: int, tokens: int, itl_ms: float, rounds: int) -> dict[str, Any]:
    """Run the benchmark against a fresh simulator process."""
    args = [
        "--ttft-ms", "5", "--itl-ms", str(itl_ms), "--itl-per-seq-ms", "0",
        "--max-num-seqs", str(max(256, streams)), "--kv-blocks", "1000000", "--max-model-len", "65536",
    ]  # fmt: skip
    with PodsimProcess(args) as pod:
        asyncio.run(drive(pod.url, 4, 8, 1))
        cpu0, ns0, t0 = proc_cpu_seconds(pod.pid), proc_run_ns(pod.pid), time.perf_counter()
        received = asyncio.run(drive(pod.url, streams, tokens, rounds))
        cpu1, ns1, t1 = proc_cpu_seconds(pod.pid), proc_run_ns(pod.pid), time.perf_counter()
    expected = streams * tokens * rounds
    return {
        "streams": streams,
        "tokens_per_stream": tokens,
        "rounds": rounds,
        "itl_ms": itl_ms,
        "tokens": received,
        "tokens_expected": expected,
        "wall_s": round(t1 - t0, 3),
        "tokens_per_s": round(received / (t1 - t0)),
        "sim_cpu_s_proc_stat": round(cpu1 - cpu0, 3),
        "sim_cpu_ms_per_1000_tokens_proc_stat": round((cpu1 - cpu0) * 1e6 / received, 3),
        "sim_cpu_us_per_token_schedstat": round((ns1 - ns0) / 1e3 / received, 3) if ns1 else None,
    }


def main(argv: list[str] | None = None) -> int:
    """Print one JSON line of measurements."""
    parser = argparse.ArgumentParser(prog="python -m loadtest.podsim.selfbench", description=__doc__)
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--itl-ms", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.streams, args.tokens, args.itl_ms, args.rounds)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
