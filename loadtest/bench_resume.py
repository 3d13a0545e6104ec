"""Resume benchmark: what a client notices when its stream is continued on another pod.

Two pod simulators at 20 ms per token; one drops every stream after 20 tokens. ``--streams``
concurrent chat streams of 60 tokens go through a gateway with resume on. Reported: streams whose
text came out whole, resumes, and the longest silence each client saw (the resume gap) against
the pods' ordinary inter-token gap.

    python -m loadtest.bench_resume [--streams 50] [--write-md FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp

from gateway.rlimits import raise_open_file_limit
from loadtest.loadgen import percentile
from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from loadtest.report import replace_marked_section

MD_BEGIN = "<!-- bench:resume:begin -->"
MD_END = "<!-- bench:resume:end -->"
POD_ARGS = ["--model", "llama-8b", "--ttft-ms", "20", "--itl-ms", "20", "--itl-per-seq-ms", "0"]
BODY = {
    "model": "llama-8b",
    "messages": [{"role": "user", "content": "resume me"}],
    "max_tokens": 60,
    "stream": True,
}


async def _stream(session: aiohttp.ClientSession, url: str) -> tuple[str, float]:
    """The text received and the longest gap between two reads after the first token."""
    text: list[str] = []
    longest = 0.0
    last: float | None = None
    pending = b""
    async with session.post(url + "/v1/chat/completions", json=BODY) as resp:
        async for chunk in resp.content.iter_any():
            now = time.monotonic()
            if last is not None:
                longest = max(longest, now - last)
            last = now
            pending += chunk
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if event.startswith(b"data: {"):
                    for choice in json.loads(event[6:]).get("choices", []):
                        text.append((choice.get("delta") or {}).get("content") or "")
    return "".join(text), longest


async def _run(url: str, direct: str, streams: int) -> dict[str, float]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        expected, normal_gap = await _stream(session, direct)
        results = await asyncio.gather(*(_stream(session, url) for _ in range(streams)))
    whole = sum(text == expected for text, _ in results)
    gaps = sorted(gap * 1000 for _, gap in results)
    return {
        "streams": streams,
        "whole": whole,
        "normal_gap_ms": normal_gap * 1000,
        "gap_p50_ms": percentile(gaps, 50) or 0.0,
        "gap_p99_ms": percentile(gaps, 99) or 0.0,
    }


def _resumes(admin_url: str) -> float:
    with urllib.request.urlopen(admin_url + "/metrics") as resp:
        lines = resp.read().decode().splitlines()
    return sum(
        float(x.rsplit(" ", 1)[1])
        for x in lines
        if x.startswith('sluicegate_stream_resumes_total{outcome="ok"}')
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_resume", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--streams", type=int, default=50)
    parser.add_argument("--write-md", metavar="FILE")
    args = parser.parse_args(argv)
    raise_open_file_limit()
    with PodsimProcess(POD_ARGS) as good, PodsimProcess([*POD_ARGS, "--fault", "drop_after=20"]) as bad:
        config = {
            "server": {"host": "127.0.0.1", "access_log": False},
            "resume": {"models": ["*"]},
            "pods": [
                {"name": "good", "url": good.url, "models": ["llama-8b"]},
                {"name": "bad", "url": bad.url, "models": ["llama-8b"]},
            ],
        }
        with GatewayProcess(config) as gw:
            result = asyncio.run(_run(gw.url, good.url, args.streams))
            result["resumes"] = _resumes(gw.admin_url)
    section = (
        f"Command: `python -m loadtest.bench_resume --streams {args.streams}`\n\n"
        "| streams | text whole | resumes | ordinary gap ms | longest gap p50 ms | longest gap p99 ms |\n"
        "| --- | --- | --- | --- | --- | --- |\n"
        f"| {result['streams']} | {result['whole']} | {result['resumes']:.0f} | "
        f"{result['normal_gap_ms']:.1f} | {result['gap_p50_ms']:.1f} | {result['gap_p99_ms']:.1f} |"
    )
    print(section)
    if args.write_md:
        replace_marked_section(Path(args.write_md), MD_BEGIN, MD_END, section)
    return 0 if result["whole"] == result["streams"] else 1


if __name__ == "__main__":
    sys.exit(main())
