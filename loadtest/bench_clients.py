"""Which HTTP client should the gateway use upstream? Measured, not assumed.

The gateway holds one upstream stream per client stream, so the client library's cost per read and
per concurrent connection is paid on every token. This reads N concurrent paced streams from the
pod simulator with each candidate (aiohttp ``ClientSession``; httpx ``AsyncClient``; httpx on
``httpx_aiohttp.AiohttpTransport``) and reports wall time and the client process's CPU seconds.
Each client runs in its own process pinned to the proxy core (the pod on the other), as the
gateway would, and every pool limit is lifted so that no client queues streams behind a cap.

Run it with ``python -m loadtest.bench --clients`` or ``python -m loadtest.bench_clients``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from importlib import metadata
from pathlib import Path
from typing import Any

from gateway.rlimits import raise_open_file_limit
from loadtest.loadgen import count_tokens, percentile
from loadtest.report import replace_marked_section

CLIENTS = ("sluicegate", "aiohttp", "httpx", "httpx-aiohttp")
LABELS = {
    "sluicegate": "Sluicegate's `PodClient` (httptools; body spliced to a callback)",
    "aiohttp": "aiohttp `ClientSession` (`content.readany`)",
    "httpx": "httpx `AsyncClient` (`aiter_raw`)",
    "httpx-aiohttp": "httpx + `httpx_aiohttp.AiohttpTransport` (`aiter_raw`)",
}
PACKAGES = {
    "sluicegate": ("httptools",),
    "aiohttp": ("aiohttp",),
    "httpx": ("httpx",),
    "httpx-aiohttp": ("httpx", "httpx-aiohttp"),
}
MD_BEGIN = "<!-- bench:clients:begin -->"
MD_END = "<!-- bench:clients:end -->"


class _Counter:
    """Content tokens in a byte stream, counted over complete SSE events only."""

    __slots__ = ("first", "pending", "tokens")

    def __init__(self) -> None:
        self.pending = b""
        self.tokens = 0
        self.first = 0.0

    def feed(self, chunk: bytes) -> None:
        data = self.pending + chunk if self.pending else chunk
        cut = data.rfind(b"\n\n") + 2
        if cut < 2:
            self.pending = data
            return
        self.pending = data[cut:]
        found = count_tokens(data[:cut])
        if found and not self.tokens:
            self.first = time.perf_counter()
        self.tokens += found


ReadOne = Callable[[bytes], Awaitable[tuple[int, float]]]


def _aiohttp_client(url: str) -> AbstractAsyncContextManager[ReadOne]:
    import contextlib

    import aiohttp

    @contextlib.asynccontextmanager
    async def opened() -> AsyncIterator[ReadOne]:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:

            async def read(body: bytes) -> tuple[int, float]:
                counter = _Counter()
                sent = time.perf_counter()
                async with session.post(url, data=body, headers={"content-type": "application/json"}) as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"HTTP {resp.status}")
                    readany = resp.content.readany
                    while chunk := await readany():
                        counter.feed(chunk)
                return counter.tokens, counter.first - sent

            yield read

    return opened()


def _pod_client(url: str) -> AbstractAsyncContextManager[ReadOne]:
    """The gateway's own hot-path client, used as the relay uses it: the body goes to a sink."""
    import contextlib
    from urllib.parse import urlsplit

    from transports.pod_client import PodClient

    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    headers = [(b"content-type", b"application/json")]

    @contextlib.asynccontextmanager
    async def opened() -> AsyncIterator[ReadOne]:
        client = PodClient(connect_timeout_s=10.0, keepalive_timeout_s=60.0, max_idle_per_pod=100_000)

        async def read(body: bytes) -> tuple[int, float]:
            counter = _Counter()
            sent = time.perf_counter()
            resp = await client.request(host, port, parts.path, headers, body)
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}")
            resp.splice(counter.feed)
            await resp.done
            resp.release()
            return counter.tokens, counter.first - sent

        try:
            yield read
        finally:
            await client.close()

    return opened()


def _httpx_client(url: str, on_aiohttp: bool) -> AbstractAsyncContextManager[ReadOne]:
    import contextlib

    import httpx

    @contextlib.asynccontextmanager
    async def opened() -> AsyncIterator[ReadOne]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        transport: httpx.AsyncBaseTransport | None = None
        if on_aiohttp:
            import aiohttp
            from httpx_aiohttp import AiohttpTransport

            # The transport's own default caps aiohttp at 100 connections; hand it an uncapped session.
            transport = AiohttpTransport(
                limits=limits, client=lambda: aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
            )
        async with httpx.AsyncClient(limits=limits, timeout=None, transport=transport) as client:

            async def read(body: bytes) -> tuple[int, float]:
                counter = _Counter()
                sent = time.perf_counter()
                headers = {"content-type": "application/json"}
                async with client.stream("POST", url, content=body, headers=headers) as resp:
                    if resp.status_code != 200:
                        raise RuntimeError(f"HTTP {resp.status_code}")
                    async for chunk in resp.aiter_raw():
                        counter.feed(chunk)
                return counter.tokens, counter.first - sent

            yield read

    return opened()


async def _run_worker(client: str, url: str, model: str, streams: int, max_tokens: int) -> dict[str, Any]:
    body = json.dumps({
        "model": model, "messages": [{"role": "user", "content": "Tell me about sluice gates."}],
        "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
    }).encode()
    if client == "sluicegate":
        opened = _pod_client(url)
    elif client == "aiohttp":
        opened = _aiohttp_client(url)
    else:
        opened = _httpx_client(url, client == "httpx-aiohttp")
    async with opened as read:
        await read(body)  # one warm-up stream: imports and first-connection costs stay out
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        outcomes = await asyncio.gather(*(read(body) for _ in range(streams)), return_exceptions=True)
        wall = time.perf_counter() - start
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    good = [o for o in outcomes if not isinstance(o, BaseException) and o[0] == max_tokens]
    failures = [repr(o) for o in outcomes if isinstance(o, BaseException)][:3]
    ttft = percentile([o[1] for o in good], 50)
    return {
        "client": client,
        "streams": streams,
        "ok": len(good),
        "errors": streams - len(good),
        "error_samples": failures,
        "wall_s": round(wall, 3),
        "cpu_user_s": round(cpu1.ru_utime - cpu0.ru_utime, 3),
        "cpu_sys_s": round(cpu1.ru_stime - cpu0.ru_stime, 3),
        "ttft_p50_ms": None if ttft is None else round(ttft * 1000, 2),
    }


def client_available(client: str) -> str | None:
    """None when the client's packages import, else why not."""
    for package in PACKAGES[client]:
        try:
            metadata.version(package)
        except metadata.PackageNotFoundError:
            return f"`{package}` is not installed (`pip install {package}`)"
    return None


def client_version(client: str) -> str:
    """Package versions, since client performance changes between releases."""
    return " + ".join(f"{p} {metadata.version(p)}" for p in PACKAGES[client])


def _worker_main(args: argparse.Namespace) -> int:
    raise_open_file_limit()
    try:
        import uvloop

        runner: Callable[..., Any] = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run
    summary = runner(_run_worker(args.worker, args.url, args.model, args.streams, args.max_tokens))
    print(json.dumps(summary), flush=True)
    return 0


def run_comparison(
    streams: int, max_tokens: int, itl_ms: float, repeats: int, pin: bool
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Every available client against a fresh pod per repeat; returns runs and skipped clients."""
    from loadtest.bench import MODEL, PROXY_CORE, Scenario, pin_prefix, start_pod

    skipped = {c: why for c in CLIENTS if (why := client_available(c))}
    clients = [c for c in CLIENTS if c not in skipped]
    scenario = Scenario("clients", "client comparison", streams, 1, max_tokens, itl_ms=itl_ms)
    runs: list[dict[str, Any]] = []
    for repeat in range(1, repeats + 1):
        for client in clients:
            pod = start_pod(scenario, pin)
            try:
                argv = [
                    *pin_prefix(PROXY_CORE, pin), sys.executable, "-m", "loadtest.bench_clients",
                    "--worker", client, "--url", pod.url + "/v1/chat/completions", "--model", MODEL,
                    "--streams", str(streams), "--max-tokens", str(max_tokens),
                ]
                done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
            finally:
                pod.close()
            try:
                run = json.loads(done.stdout.strip().splitlines()[-1])
            except (IndexError, ValueError):
                run = {"client": client, "failed": done.stderr[-1500:]}
            run["repeat"] = repeat
            runs.append(run)
            print(f"bench_clients: {json.dumps(run)[:300]}", file=sys.stderr)
    return runs, skipped


def render(
    runs: list[dict[str, Any]], skipped: dict[str, str], streams: int, max_tokens: int, itl_ms: float,
    repeats: int,
) -> str:
    """The comparison as a markdown table (medians over repeats)."""
    ideal = max_tokens * itl_ms / 1000
    lines = [
        f"{streams} concurrent streams of {max_tokens} tokens at {itl_ms:g} ms/token from the pod simulator "
        f"(ideal wall time ~{ideal:.1f} s); medians of {repeats} interleaved runs; each client in its own "
        "process on the proxy core, its CPU from getrusage.",
        "",
        "| client | versions | wall s | client CPU s (user + sys) | TTFT p50 ms | streams ok |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for client in CLIENTS:
        if client in skipped:
            lines.append(f"| {LABELS[client]} | — | not run: {skipped[client]} | | | |")
            continue
        mine = [r for r in runs if r.get("client") == client and "wall_s" in r]
        if not mine:
            failed = next((r.get("failed", "") for r in runs if r.get("client") == client), "")
            lines.append(f"| {LABELS[client]} | {client_version(client)} | failed: {failed[-200:]} | | | |")
            continue
        wall = statistics.median(r["wall_s"] for r in mine)
        user = statistics.median(r["cpu_user_s"] for r in mine)
        system = statistics.median(r["cpu_sys_s"] for r in mine)
        ttfts = [r["ttft_p50_ms"] for r in mine if r["ttft_p50_ms"] is not None]
        ttft = f"{statistics.median(ttfts):.1f}" if ttfts else "—"
        ok = min(r["ok"] for r in mine)
        lines.append(
            f"| {LABELS[client]} | {client_version(client)} | {wall:.2f} | {user + system:.2f} "
            f"({user:.2f} + {system:.2f}) | {ttft} | {ok} / {streams} (worst run) |"
        )
    return "\n".join(lines)


def write_markdown(path: Path, section: str) -> None:
    replace_marked_section(path, MD_BEGIN, MD_END, section)


def build_parser() -> argparse.ArgumentParser:
    """Public flags for the comparison; hidden ones run one client in a worker process."""
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_clients",
        description="Wall time and CPU of upstream HTTP clients reading many concurrent SSE streams.",
    )
    parser.add_argument("--streams", type=int, default=300, help="concurrent streams (default 300)")
    parser.add_argument("--max-tokens", type=int, default=100, help="tokens per stream (default 100)")
    parser.add_argument("--itl-ms", type=float, default=20.0, help="pod's ms per token (default 20)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default 3)")
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    parser.add_argument("--write-md", metavar="FILE", help="write the comparison into this markdown file")
    parser.add_argument("--worker", choices=CLIENTS, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None, command: str | None = None) -> int:
    """Run the comparison (or, with ``--worker``, one client) and print markdown."""
    args = build_parser().parse_args(argv)
    if args.worker:
        return _worker_main(args)
    from loadtest.bench import LOAD_CORE, can_pin

    raise_open_file_limit()
    pin = not args.no_pin and can_pin()
    if pin:
        os.sched_setaffinity(0, {LOAD_CORE})
    runs, skipped = run_comparison(args.streams, args.max_tokens, args.itl_ms, args.repeats, pin)
    section = render(runs, skipped, args.streams, args.max_tokens, args.itl_ms, args.repeats)
    if command is None:
        command = " ".join([".venv/bin/python -m loadtest.bench_clients", *(argv or sys.argv[1:])])
    section = f"Command: `{command}`\n\n{section}"
    print(section)
    if args.write_md:
        write_markdown(Path(args.write_md), section)
    failed = any("wall_s" not in r or r.get("errors") for r in runs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
