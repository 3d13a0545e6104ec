"""Streaming load generator: N concurrent OpenAI-style SSE streams against one URL.

It runs as its own process (``python -m loadtest.loadgen``) so that the benchmark can pin it to a
core away from the proxy under test and read the proxy's CPU use without the client's mixed in.
It is deliberately lean, because the proxies it compares spend only tens of microseconds per
token and a heavyweight client would become the bottleneck: uvloop, one ``asyncio.Protocol`` per
keep-alive connection, httptools' C parser for the HTTP/1.1 framing, and tokens counted with a
byte-level regex over complete SSE events instead of decoding JSON per event.

Time to first token is measured from the moment the request is written to the read that completes
the first event carrying non-empty ``content`` or ``reasoning_content`` (chat) or ``text``
(completions): vLLM's opening role-only chunk does not count. Each such event counts as one token.

The summary is printed as one JSON object on stdout; ``loadtest.bench`` consumes it.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import re
import resource
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httptools

from gateway.rlimits import raise_open_file_limit

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a project dependency on Linux
    uvloop = None  # type: ignore[assignment]

# One match per SSE event whose delta carries text: `"content":"x` (or a reasoning model's
# `"reasoning_content":"x`, which also counts as output) but not `"content":""` (the role-only
# opening chunk).
TOKEN_PATTERN = re.compile(rb'"(?:reasoning_content|content|text)": ?"(?!")')
DONE_MARKER = b"data: [DONE]"
# The server's own count, from the usage event (``stream_options.include_usage``).
USAGE_PATTERN = re.compile(rb'"completion_tokens": ?(\d+)')
# Response headers worth keeping per request: which pod answered and, if the gateway says, the variant.
POD_HEADER = b"x-sluicegate-pod"
VARIANT_HEADER = b"x-sluicegate-variant"


def count_tokens(events: bytes) -> int:
    """Content-carrying SSE events in ``events`` (complete events only)."""
    return len(TOKEN_PATTERN.findall(events))


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(slots=True)
class LoadSpec:
    """What to run: ``streams`` connections, each sending ``requests`` streaming requests in turn."""

    url: str
    model: str
    streams: int = 1
    requests: int = 1
    max_tokens: int = 64
    ramp_s: float = 0.0
    think_s: float = 0.0
    duration_s: float = 0.0  # > 0: each stream stops sending after this long (``requests`` is then a cap)
    timeout_s: float = 300.0
    connect_timeout_s: float = 30.0
    check_tokens: bool = True
    prompt: str = "Tell me about sluice gates."
    headers: tuple[tuple[str, str], ...] = ()  # extra request headers (an API key, say)


@dataclass(slots=True)
class _Tally:
    """Results accumulated across all streams (the event loop is single-threaded: no locks)."""

    ttfts: list[float] = field(default_factory=list)
    durations: list[float] = field(default_factory=list)
    tokens: int = 0
    ok: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    samples: list[str] = field(default_factory=list)
    completed_streams: int = 0
    first_send: float = 0.0
    last_end: float = 0.0

    def fail(self, kind: str, detail: str) -> None:
        self.errors[kind] += 1
        if len(self.samples) < 5:
            self.samples.append(f"{kind}: {detail}")


class StreamProtocol(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection carrying one streaming request at a time.

    The per-chunk path is ``data_received`` → httptools → ``on_body``: one C parse, one ``rfind``
    and one regex scan per read, plus one clock read and one list append per read that carried
    tokens (``marks``: the inter-token latencies of ``sluicegate loadtest``).
    """

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.closed = False
        self.reset()

    def reset(self) -> None:
        self.status = 0
        self.keep_alive = True
        self.tokens = 0
        self.first = 0.0
        self.done = False
        self.pending = b""
        self.marks: list[float] = []
        self.usage_tokens: int | None = None
        self.pod: str | None = None
        self.variant: str | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._finish(ConnectionError(f"bad HTTP from server: {exc}"))
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._finish(exc or ConnectionError("server closed the connection mid-response"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) in (16, 20):  # cheap filter: len(POD_HEADER), len(VARIANT_HEADER)
            lowered = name.lower()
            if lowered == POD_HEADER:
                self.pod = value.decode("latin-1")
            elif lowered == VARIANT_HEADER:
                self.variant = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        if self.pending:
            body = self.pending + body
        cut = body.rfind(b"\n\n")
        if cut < 0:
            self.pending = body
            return
        cut += 2
        if cut < len(body):
            self.pending = body[cut:]
            body = body[:cut]
        else:
            self.pending = b""
        found = len(TOKEN_PATTERN.findall(body))
        if found:
            now = time.perf_counter()
            if not self.tokens:
                self.first = now
            self.marks.append(now)
            self.tokens += found
        if b'"usage"' in body:
            usage = USAGE_PATTERN.search(body)
            if usage is not None:
                self.usage_tokens = int(usage.group(1))
        if DONE_MARKER in body:
            self.done = True

    def on_message_complete(self) -> None:
        self._finish(None)

    def _finish(self, exc: BaseException | None) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            if exc is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(exc)


_Exchange = StreamProtocol  # the older name, which loadtest/bench_admission.py subclasses around


class LoadGenerator:
    """Runs a ``LoadSpec`` on the current event loop and summarises what the streams saw."""

    def __init__(self, spec: LoadSpec) -> None:
        self.spec = spec
        parts = urlsplit(spec.url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"only plain http:// URLs are supported, not {spec.url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        path = parts.path or "/v1/chat/completions"
        self.chat = not path.endswith("/v1/completions")
        # ignore_eos (a vLLM extension): every stream is exactly max_tokens long, as the pod simulator
        # would otherwise end an answer early with a stop token.
        payload: dict[str, Any] = {
            "model": spec.model, "max_tokens": spec.max_tokens, "stream": True, "ignore_eos": True
        }
        if self.chat:
            payload["messages"] = [{"role": "user", "content": spec.prompt}]
        else:
            payload["prompt"] = spec.prompt
        body = json.dumps(payload, separators=(",", ":")).encode()
        extra = "".join(f"{name}: {value}\r\n" for name, value in spec.headers)
        self.request = (
            f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\n{extra}Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        self.tally = _Tally()

    async def _connect(self) -> StreamProtocol:
        loop = asyncio.get_running_loop()
        _, proto = await asyncio.wait_for(
            loop.create_connection(StreamProtocol, self.host, self.port), self.spec.connect_timeout_s
        )
        return proto

    async def _one_request(self, conn: StreamProtocol) -> tuple[bool, bool]:
        """Send one request on ``conn`` and record its outcome: (succeeded, connection reusable)."""
        spec, tally = self.spec, self.tally
        conn.reset()
        waiter = asyncio.get_running_loop().create_future()
        conn.waiter = waiter
        sent = time.perf_counter()
        if not tally.first_send:
            tally.first_send = sent
        assert conn.transport is not None
        conn.transport.write(self.request)
        try:
            await asyncio.wait_for(waiter, spec.timeout_s)
        except TimeoutError:
            tally.fail("timeout", f"no complete answer within {spec.timeout_s:.0f} s")
            return False, False
        except (ConnectionError, OSError) as exc:
            tally.fail("closed", str(exc) or type(exc).__name__)
            return False, False
        finally:
            conn.waiter = None
        end = time.perf_counter()
        tally.last_end = max(tally.last_end, end)
        tally.tokens += conn.tokens
        if conn.status != 200:
            tally.fail(f"status_{conn.status}", f"HTTP {conn.status}")
        elif not conn.done:
            tally.fail("no_done", f"stream ended without [DONE] after {conn.tokens} tokens")
        elif spec.check_tokens and conn.tokens != spec.max_tokens:
            tally.fail("short", f"{conn.tokens} content tokens, expected {spec.max_tokens}")
        else:
            tally.ok += 1
            tally.ttfts.append(conn.first - sent)
            tally.durations.append(end - sent)
            return True, conn.keep_alive
        return False, conn.keep_alive

    async def _stream(self, index: int, conn: StreamProtocol | None, start: float) -> None:
        spec = self.spec
        if spec.ramp_s > 0 and spec.streams > 1:
            delay = start + spec.ramp_s * index / spec.streams - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        succeeded = 0
        try:
            for number in range(spec.requests):
                if spec.duration_s > 0 and time.perf_counter() - start >= spec.duration_s:
                    break
                if number and spec.think_s > 0:
                    await asyncio.sleep(spec.think_s)
                if conn is None or conn.closed:
                    try:
                        conn = await self._connect()
                    except (OSError, TimeoutError) as exc:
                        self.tally.fail("connect", str(exc) or type(exc).__name__)
                        conn = None
                        continue
                ok, reusable = await self._one_request(conn)
                succeeded += ok
                if not reusable:
                    if conn.transport is not None:
                        conn.transport.close()
                    conn = None
        finally:
            if conn is not None and conn.transport is not None:
                conn.transport.close()
        if succeeded == spec.requests:
            self.tally.completed_streams += 1

    async def run(self) -> dict[str, Any]:
        """Open every connection first (not timed), then start all streams together."""
        spec = self.spec
        opened = await asyncio.gather(*(self._connect() for _ in range(spec.streams)), return_exceptions=True)
        conns: list[StreamProtocol | None] = []
        for item in opened:
            if isinstance(item, BaseException):
                self.tally.fail("connect", str(item) or type(item).__name__)
                conns.append(None)
            else:
                conns.append(item)
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        await asyncio.gather(*(self._stream(i, c, start) for i, c in enumerate(conns)))
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        return self._summary(cpu1.ru_utime - cpu0.ru_utime, cpu1.ru_stime - cpu0.ru_stime)

    def _summary(self, user_s: float, sys_s: float) -> dict[str, Any]:
        tally, spec = self.tally, self.spec
        wall = max(tally.last_end - tally.first_send, 1e-9) if tally.first_send else 0.0

        def ms(values: list[float], q: float) -> float | None:
            got = percentile(values, q)
            return None if got is None else round(got * 1000, 3)

        return {
            "url": spec.url,
            "streams": spec.streams,
            "requests_per_stream": spec.requests,
            "max_tokens": spec.max_tokens,
            "requests": spec.streams * spec.requests,
            "ok": tally.ok,
            "errors": sum(tally.errors.values()),
            "error_kinds": dict(tally.errors),
            "error_samples": tally.samples,
            "completed_streams": tally.completed_streams,
            "tokens": tally.tokens,
            "wall_s": round(wall, 4),
            "tokens_per_s": round(tally.tokens / wall, 1) if wall else 0.0,
            "ttft_ms": {q: ms(tally.ttfts, v) for q, v in (("p50", 50), ("p90", 90), ("p99", 99))}
            | {"max": ms(tally.ttfts, 100)},
            "duration_ms": {"p50": ms(tally.durations, 50), "p99": ms(tally.durations, 99)},
            "loadgen_cpu_s": {"user": round(user_s, 3), "sys": round(sys_s, 3)},
        }


async def run_load(spec: LoadSpec) -> dict[str, Any]:
    """Run ``spec`` on the running loop and return the summary (for in-process callers and tests)."""
    return await LoadGenerator(spec).run()


def build_parser() -> argparse.ArgumentParser:
    """The load shape as flags, so the harness and a person at a shell drive it the same way."""
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.loadgen",
        description="Concurrent OpenAI-style streaming requests; prints a JSON summary on stdout.",
    )
    parser.add_argument("url", help="full URL, e.g. http://127.0.0.1:8080/v1/chat/completions")
    parser.add_argument("--model", required=True, help="model name to request")
    parser.add_argument("--streams", type=int, default=1, help="concurrent connections (default 1)")
    parser.add_argument("--requests", type=int, default=1, help="sequential requests per stream (default 1)")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request (default 64)")
    parser.add_argument(
        "--ramp-s", type=float, default=0.0, help="spread the streams' first requests over this many seconds"
    )
    parser.add_argument(
        "--think-ms", type=float, default=0.0, help="pause between a stream's requests (default 0)"
    )
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per-request time limit (default 300)")
    parser.add_argument(
        "--no-check-tokens", action="store_true",
        help="do not count a stream with fewer than max_tokens content tokens as an error",
    )
    parser.add_argument(
        "--prompt-chars", type=int, default=0, metavar="N",
        help="make each request's prompt N characters long (real prompts run to many KB; default: one line)",
    )
    parser.add_argument(
        "--header", action="append", default=[], metavar="'NAME: VALUE'",
        help="an extra request header (repeatable), e.g. 'Authorization: Bearer KEY'",
    )
    parser.add_argument("--pretty", action="store_true", help="indent the JSON summary")
    return parser


def long_prompt(chars: int) -> str:
    """A prompt of exactly ``chars`` characters: numbered sentences, so that it is not one sentence
    repeated (which would compress to nothing) and a tokenizer sees ordinary words."""
    parts: list[str] = []
    size = 0
    n = 0
    while size < chars:
        n += 1
        sentence = f"Sentence {n} is about sluice gates and the water they hold back. "
        parts.append(sentence)
        size += len(sentence)
    return "".join(parts)[:chars]


def _header(raw: str) -> tuple[str, str]:
    name, sep, value = raw.partition(":")
    if not sep or not name.strip() or any(c in raw for c in "\r\n"):
        raise SystemExit(f"loadgen: --header must be 'NAME: VALUE' on one line, not {raw!r}")
    return name.strip(), value.strip()


def main(argv: list[str] | None = None) -> int:
    """Run the load and print the JSON summary; exit 1 if any stream failed."""
    args = build_parser().parse_args(argv)
    if args.prompt_chars < 0:
        raise SystemExit("loadgen: --prompt-chars must be 0 or more")
    raise_open_file_limit()
    spec = LoadSpec(
        url=args.url,
        model=args.model,
        streams=args.streams,
        requests=args.requests,
        max_tokens=args.max_tokens,
        ramp_s=args.ramp_s,
        think_s=args.think_ms / 1000.0,
        timeout_s=args.timeout_s,
        check_tokens=not args.no_check_tokens,
        headers=tuple(_header(raw) for raw in args.header),
    )
    if args.prompt_chars:
        spec.prompt = long_prompt(args.prompt_chars)
    # A short-lived process: keep the collector out of the per-token path.
    gc.freeze()
    gc.disable()
    runner = uvloop.run if uvloop is not None else asyncio.run
    summary = runner(run_load(spec))
    print(json.dumps(summary, indent=2 if args.pretty else None), flush=True)
    return 0 if summary["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
