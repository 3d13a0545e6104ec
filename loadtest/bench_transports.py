"""Per-transport benchmark: what each way in costs the gateway, per token and in time to first token.

One simulated pod, one gateway (alone on core 1) listening for HTTP/1.1 and h2c in cleartext, for
HTTP/1.1 and HTTP/2 over TLS, and for HTTP/3 over QUIC, and serving gRPC-Web. For each transport:

- **added TTFT**: one stream at a time, the client's time to the first body byte through the gateway
  (the gateway holds its response headers until the first token) minus the same measured directly
  against the pod over HTTP/1.1 with aiohttp. Each stream starts after a random pause of up to 1 ms:
  the pod simulator's timers tick in whole milliseconds, and back-to-back streams would otherwise all
  reach it at the same point between two ticks, moving a row by up to a millisecond either way
  depending on its transport's latency modulo 1 ms.
- **CPU per 1000 tokens**: the gateway process's user + system CPU while ``--streams`` concurrent
  streams of ``--tokens`` tokens go through it, per 1000 tokens relayed; ``--repeats`` times round
  the transports (a load is ~10 of ``/proc``'s 10-ms clock ticks, so one alone resolves to ~10 %),
  with each row's ratio to h1 (cleartext) taken within a repeat.

The clients are the cheapest at hand for each protocol, so that the figures are the gateway's rather
than a client library's: aiohttp for HTTP/1.1 (and the direct baseline); ``H2Client`` below for
HTTP/2, the ``h2`` state machine on an asyncio protocol, one write per request (HEADERS and DATA);
``transports.h3_client`` (aioquic) for HTTP/3. What the client still adds, from packet timestamps on
loopback (its time from the call to the request's first packet, plus from the answer's first packet
to the first byte in hand): ``H2Client`` as much as aiohttp (~0.6 ms), so the HTTP/2 rows are the
gateway's own; the HTTP/3 client ~0.5 ms more than aiohttp (aioquic decrypts and parses the packet,
then runs its own transmit, before the reader wakes), which the HTTP/3 row includes. A full client
library costs far more: with httpx (httpcore, HTTP/2), used here before, each HTTP/2 row read ~1.7 ms
higher: ~1.4 ms of httpx's own work around the request, and ~0.3 ms of the gateway waiting for a
request that httpx writes in three pieces (HEADERS, DATA, an empty END_STREAM) ~0.2 ms apart.

    python -m loadtest.bench_transports [--streams 50] [--tokens 200] [--write-md FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import ssl
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import h2.config
import h2.connection
import h2.events

from loadtest.bench import LOAD_CORE, PROXY_CORE, can_pin, cpu_delta_s, cpu_ticks
from loadtest.loadgen import percentile
from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess, free_tcp_and_udp_port
from loadtest.report import command_line, publish
from transports import grpc_web
from transports.h3_client import H3ClientConnection
from transports.proto.sluicegate.v1 import inference_pb2 as pb
from transports.tls import self_signed

MODEL = "llama-8b"
H1_ROW = "h1 (cleartext)"  # the row the other transports' CPU is compared with
CHAT_PATH = "/v1/chat/completions"
GRPC_PATH = "/sluicegate.v1.Inference/StreamChatCompletion"

# A stream through one transport: awaits the first body byte, calls ``first()``, then reads to the end.
Streamer = Callable[[int, Callable[[], None]], Awaitable[None]]


def _chat(tokens: int) -> bytes:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
    }
    return json.dumps(body).encode()


def _grpc_request(tokens: int) -> bytes:
    message = pb.ChatCompletionRequest(
        model=MODEL, messages=[pb.ChatMessage(role="user", content="hi")], max_tokens=tokens, ignore_eos=True
    )
    return grpc_web.encode_message(message.SerializeToString())


def _insecure_context(alpn: list[str] | None = None) -> ssl.SSLContext:
    """A client context that accepts the gateway's throwaway certificate."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    if alpn:
        context.set_alpn_protocols(alpn)
    return context


class H2Client(asyncio.Protocol):
    """A minimal HTTP/2 client: one connection, concurrent streams, one write per request.

    The ``h2`` state machine and nothing else (no pool, no request or response objects), so that
    the bench's HTTP/2 rows show what the gateway costs rather than what a client library does."""

    def __init__(self) -> None:
        config = h2.config.H2Configuration(client_side=True, header_encoding=None)
        self.conn = h2.connection.H2Connection(config)
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, _H2Stream] = {}
        self.lost: BaseException | None = None

    @classmethod
    async def connect(cls, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> H2Client:
        loop = asyncio.get_running_loop()
        transport, client = await loop.create_connection(cls, host, port, ssl=ssl_context)
        if ssl_context is not None:
            alpn = transport.get_extra_info("ssl_object").selected_alpn_protocol()
            assert alpn == "h2", f"ALPN chose {alpn!r}"
        return client

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.conn.initiate_connection()
        self.transport.write(self.conn.data_to_send())

    def data_received(self, data: bytes) -> None:
        for event in self.conn.receive_data(data):
            stream = self.streams.get(getattr(event, "stream_id", 0))
            if isinstance(event, h2.events.DataReceived):
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                if stream is not None and event.data:
                    stream.chunks += 1
                    stream.wake()
            elif stream is None:
                continue
            elif isinstance(event, h2.events.ResponseReceived):
                stream.status = int(dict(event.headers)[b":status"])
            elif isinstance(event, h2.events.StreamEnded):
                stream.ended = True
                stream.wake()
            elif isinstance(event, h2.events.StreamReset):
                stream.fail(ConnectionError(f"stream reset by the server (error {event.error_code})"))
        out = self.conn.data_to_send()
        if out and self.transport is not None:
            self.transport.write(out)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc or ConnectionError("connection closed")
        for stream in self.streams.values():
            stream.fail(self.lost)

    async def post(self, authority: str, path: str, body: bytes, first: Callable[[], None]) -> int:
        """Send a POST, call ``first()`` when the first body byte arrives, read to the end; the status."""
        assert self.transport is not None and self.lost is None
        conn = self.conn
        sid = conn.get_next_available_stream_id()
        stream = self.streams[sid] = _H2Stream()
        headers = [
            (b":method", b"POST"),
            (b":scheme", b"https" if self.transport.get_extra_info("ssl_object") else b"http"),
            (b":authority", authority.encode()),
            (b":path", path.encode()),
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
        ]
        conn.send_headers(sid, headers)
        conn.send_data(sid, body, end_stream=True)  # the bench's bodies fit the initial window
        self.transport.write(conn.data_to_send())
        try:
            while not stream.chunks and not stream.ended:
                await stream.wait()
            if stream.chunks:
                first()
            while not stream.ended:
                await stream.wait()
        finally:
            del self.streams[sid]
        assert stream.status is not None
        return stream.status

    def close(self) -> None:
        if self.transport is not None:
            self.conn.close_connection()
            self.transport.write(self.conn.data_to_send())
            self.transport.close()


class _H2Stream:
    __slots__ = ("chunks", "ended", "error", "status", "waiter")

    def __init__(self) -> None:
        self.status: int | None = None
        self.chunks = 0
        self.ended = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.ended = True
        self.wake()

    async def wait(self) -> None:
        self.waiter = asyncio.get_running_loop().create_future()
        await self.waiter
        self.waiter = None
        if self.error is not None:
            raise self.error


class Clients:
    """One client per transport, each able to run many streams at once on its connection(s)."""

    def __init__(self, http_url: str, tls_port: int, h3_port: int) -> None:
        self.http_url = http_url
        self.https_url = f"https://127.0.0.1:{tls_port}"
        self.tls_port = tls_port
        self.h3_port = h3_port
        self._insecure = _insecure_context()
        self.aiohttp: aiohttp.ClientSession | None = None
        self.h2: H2Client | None = None
        self.h2c: H2Client | None = None
        self._h2_lock = asyncio.Lock()
        self.h3: H3ClientConnection | None = None

    async def __aenter__(self) -> Clients:
        self.aiohttp = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self.h3 = await H3ClientConnection.connect("127.0.0.1", self.h3_port, verify=False)
        return self

    async def __aexit__(self, *_exc: object) -> None:
        assert self.aiohttp and self.h3
        await self.aiohttp.close()
        for client in (self.h2, self.h2c):
            if client is not None:
                client.close()
        await self.h3.aclose()

    async def _h2_client(self, tls: bool) -> H2Client:
        """The HTTP/2 connection for a row, (re)opened when the gateway closed it while idle (the
        earlier rows take longer than its keep-alive timeout). HTTP/2 multiplexes: one connection
        for all of a row's streams, as browsers do."""
        async with self._h2_lock:  # a row's streams start together: one of them connects
            client = self.h2 if tls else self.h2c
            if client is None or client.lost is not None:
                if tls:
                    context = _insecure_context(["h2"])
                    client = self.h2 = await H2Client.connect("127.0.0.1", self.tls_port, context)
                else:
                    host, _, port = self.http_url.removeprefix("http://").rpartition(":")
                    client = self.h2c = await H2Client.connect(host, int(port))
        return client

    def streamers(self, pod_url: str) -> dict[str, Streamer]:
        return {
            "direct to the pod (HTTP/1.1)": lambda n, first: self._aiohttp(pod_url + CHAT_PATH, n, first),
            H1_ROW: lambda n, first: self._aiohttp(self.http_url + CHAT_PATH, n, first),
            "h1 (TLS)": lambda n, first: self._aiohttp(self.https_url + CHAT_PATH, n, first, tls=True),
            "h2c (cleartext)": lambda n, first: self._h2(False, self.http_url, n, first),
            "h2 (TLS)": lambda n, first: self._h2(True, self.https_url, n, first),
            "h3 (QUIC)": self._h3,
            "gRPC-Web (h1)": self._grpc_web,
        }

    async def _aiohttp(self, url: str, tokens: int, first: Callable[[], None], tls: bool = False) -> None:
        assert self.aiohttp is not None
        headers = {"content-type": "application/json"}
        ssl_arg: Any = self._insecure if tls else None
        async with self.aiohttp.post(url, data=_chat(tokens), headers=headers, ssl=ssl_arg) as resp:
            assert resp.status == 200, resp.status
            seen = False
            async for chunk in resp.content.iter_any():
                if not seen and chunk:
                    first()
                    seen = True
            assert seen

    async def _h2(self, tls: bool, base: str, tokens: int, first: Callable[[], None]) -> None:
        client = await self._h2_client(tls)
        seen: list[bool] = []

        def on_first() -> None:
            first()
            seen.append(True)

        status = await client.post(base.split("//", 1)[1], CHAT_PATH, _chat(tokens), on_first)
        assert status == 200, status
        assert seen

    async def _h3(self, tokens: int, first: Callable[[], None]) -> None:
        assert self.h3 is not None
        headers = [("content-type", "application/json")]
        resp = await self.h3.request("POST", f"127.0.0.1:{self.h3_port}", CHAT_PATH, headers, _chat(tokens))
        assert resp.status == 200, resp.status
        seen = False
        async for chunk in resp.aiter_bytes():
            if not seen and chunk:
                first()
                seen = True
        assert seen

    async def _grpc_web(self, tokens: int, first: Callable[[], None]) -> None:
        assert self.aiohttp is not None
        headers = {"content-type": "application/grpc-web+proto", "x-grpc-web": "1"}
        url = self.http_url + GRPC_PATH
        async with self.aiohttp.post(url, data=_grpc_request(tokens), headers=headers) as resp:
            assert resp.status == 200, resp.status
            body = b""
            async for chunk in resp.content.iter_any():
                if not body and chunk:
                    first()
                body += chunk
        trailers = [f for f in grpc_web.decode_frames(body) if f.flag & grpc_web.FLAG_TRAILERS]
        assert trailers and grpc_web.parse_trailers(trailers[-1].payload).get("grpc-status") == "0"


async def _ttft(streamer: Streamer, tokens: int, runs: int) -> list[float]:
    out = []
    marks: list[float] = []
    rng = random.Random(runs)
    for _ in range(runs):
        # a random phase against the pod's 1-ms timer ticks (see the module doc); nanosleep, since
        # an event-loop timer would round to whole milliseconds and keep the phase
        time.sleep(rng.random() / 1000)  # noqa: ASYNC251 -- on purpose: nothing else runs meanwhile
        marks.clear()
        started = time.perf_counter()
        await streamer(tokens, lambda: marks.append(time.perf_counter()))
        out.append((marks[0] - started) * 1000)
    return out


async def _concurrent(streamer: Streamer, streams: int, tokens: int) -> None:
    await asyncio.gather(*(streamer(tokens, lambda: None) for _ in range(streams)))


async def _measure(
    clients: Clients, pod_url: str, gateway_pid: int, streams: int, tokens: int, runs: int, repeats: int
) -> list[dict[str, Any]]:
    streamers = clients.streamers(pod_url)
    rows = []
    for name, streamer in streamers.items():
        await _concurrent(streamer, 4, 8)  # warm up connections and caches
        ttft = await _ttft(streamer, 16, runs)
        p50, p99 = percentile(ttft, 50), percentile(ttft, 99)
        rows.append({"transport": name, "ttft_p50": p50, "ttft_p99": p99, "cpu_runs": []})
    # The CPU loads go round the transports ``repeats`` times, so that a drift of the machine's speed
    # falls on every row alike; each load is ~10 clock ticks of CPU, so one alone moves by ~10 %.
    for _ in range(repeats):
        for row in rows:
            if row["transport"].startswith("direct"):
                continue
            before = cpu_ticks([gateway_pid])
            await _concurrent(streamers[row["transport"]], streams, tokens)
            user, system = cpu_delta_s(before, cpu_ticks([gateway_pid]))
            row["cpu_runs"].append((user + system) * 1000 / (streams * tokens) * 1000)
    direct = rows[0]["ttft_p50"]
    h1 = next((r["cpu_runs"] for r in rows if r["transport"] == H1_ROW), [])
    for row in rows:
        row["added_ttft"] = row["ttft_p50"] - direct
        cpu_runs = row["cpu_runs"]
        row["cpu"] = statistics.median(cpu_runs) if cpu_runs else None
        # each repeat's row against the same repeat's h1: the ratio the HTTP/3 and gRPC-Web targets name
        paired = [c / base for c, base in zip(cpu_runs, h1, strict=False) if base > 0]
        row["x_h1"] = statistics.median(paired) if paired else None
    return rows


def run(streams: int, tokens: int, runs: int, pin: bool, repeats: int = 5) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp, PodsimProcess(
        ["--model", MODEL, "--ttft-ms", "20", "--itl-ms", "5"]
    ) as pod:
        cert, key = self_signed(tmp)
        tls_port = h3_port = free_tcp_and_udp_port()
        config = {
            "server": {
                "host": "127.0.0.1",
                "access_log": False,
                "tls": {"cert": str(cert), "key": str(key), "port": tls_port, "h3_port": h3_port},
            },
            "pods": [{"name": "pod-0", "url": pod.url, "models": [MODEL]}],
        }
        with GatewayProcess(config, cpu=PROXY_CORE if pin else None) as gw:

            async def main() -> list[dict[str, Any]]:
                async with Clients(gw.url, tls_port, h3_port) as clients:
                    return await _measure(clients, pod.url, gw.pid, streams, tokens, runs, repeats)

            return asyncio.run(main())


def render(rows: list[dict[str, Any]], command: str, streams: int, tokens: int, repeats: int) -> str:
    lines = [
        f"Command: `{command}`  ",
        f"One pod (20 ms to the first token, then 5 ms a token); {streams} concurrent streams of {tokens} "
        f"tokens for the CPU columns, {repeats} times round the transports: medians, the range, and the "
        f"median of each repeat's ratio to the same repeat's {H1_ROW}.",
        "",
        "| transport | TTFT p50 ms | TTFT p99 ms | added TTFT p50 ms | gateway CPU ms / 1000 tokens "
        "| its range | x h1 |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        runs = r.get("cpu_runs") or []
        cpu = "-" if r["cpu"] is None else f"{r['cpu']:.1f}"
        spread = f"{min(runs):.1f}-{max(runs):.1f}" if runs else "-"
        ratio = "-" if r.get("x_h1") is None else f"{r['x_h1']:.2f}"
        added = "-" if r["transport"].startswith("direct") else f"{r['added_ttft']:.2f}"
        lines.append(
            f"| {r['transport']} | {r['ttft_p50']:.2f} | {r['ttft_p99']:.2f} | {added} | {cpu} | {spread} "
            f"| {ratio} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_transports", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--streams", type=int, default=50)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--runs", type=int, default=30, help="sequential streams for the TTFT columns")
    parser.add_argument("--repeats", type=int, default=5, help="times round the transports for CPU")
    parser.add_argument("--write-md", metavar="FILE")
    args = parser.parse_args(argv)
    pin = can_pin()
    if pin:  # before starting anything: the pod, like the clients, stays off the gateway's core
        os.sched_setaffinity(0, {LOAD_CORE})
    rows = run(args.streams, args.tokens, args.runs, pin, args.repeats)
    command = command_line("loadtest.bench_transports", argv)
    publish(render(rows, command, args.streams, args.tokens, args.repeats), args.write_md, "transports")
    return 0


if __name__ == "__main__":
    sys.exit(main())
