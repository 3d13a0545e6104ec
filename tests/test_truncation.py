"""No stream passes as whole unless it is: every shape of a short stream, on every transport.

A pod can end an answer early in ways HTTP calls clean: a chunked body terminated after two tokens,
a last chunk without finish_reason, a line of garbage, invalid UTF-8. Or it can never end it: a
line without a newline, one multi-megabyte event, keep-alive comments forever. Each shape, from the
pod simulator's fault knobs, goes through one gateway to an HTTP/1.1, HTTP/2 (TLS), HTTP/3 and
gRPC-Web client; each must see an error in its own protocol's form (an SSE error event and
``[DONE]``, or a gRPC status that is not OK), the gateway's memory must stay bounded, the pod's
connection must be closed, and the access log must say what happened.

Independent evidence: the same verdicts against a second server that shares no code with the
simulator, a raw asyncio socket server replaying vLLM's real bytes (../shared/wire) cut at
different points, with its own framings (chunked, Content-Length, read-until-close). No mock
OpenAI server on PyPI injects truncation: agentbreak 0.4.6 is the one with fault injection, and
skips its faults on streams (and as published, its fault catalog is not in the wheel at all).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess, free_tcp_and_udp_port
from tests.conftest import counter_totals, wait_for
from tests.test_grpc_web import grpc_web
from tests.test_h2_server import client_context
from tests.test_h3_server import h3_client
from transports.pod_client import PodBrokenError, PodClient, PodLineTooLong
from transports.sse import stream_incomplete
from transports.tls import self_signed

FAST = ["--model", "llama-8b", "--ttft-ms", "5", "--itl-ms", "1"]
CHAT = {
    "model": "llama-8b",
    "messages": [{"role": "user", "content": "Tell me about weirs."}],
    "max_tokens": 12,
}
STALL_S = 1.0
MiB = 1024 * 1024

# podsim knob -> the access log's outcome for it
SHAPES = {
    "end_after=2": "upstream_truncated",  # chunked body terminated: no finish_reason, no [DONE]
    "no_finish=1": "upstream_truncated",  # ends right after a finish_reason-less last chunk
    "garbage_after=2": "upstream_truncated",  # an HTML line, then a clean end
    "bad_utf8_after=2": "upstream_truncated",  # invalid UTF-8 in a data line, then a clean end
    "close_after=2": "upstream_broke_mid_stream",  # FIN without the terminating chunk
    "endless_line_after=2": "upstream_truncated",  # bytes forever, never a newline
    "huge_event_after=2": "upstream_truncated",  # one 4 MiB event
    "keepalive_after=2": "timeout_stall",  # comments forever: not progress
    "stall_after=2": "timeout_stall",  # nothing at all, connection open
}
BIG = ("endless_line_after=2", "huge_event_after=2")
OPEN_ENDED = ("endless_line_after=2", "keepalive_after=2", "stall_after=2")  # the pod sees the close
TRANSPORTS = ("h1", "h2", "h3", "grpc-web")


@dataclass
class Env:
    gw: GatewayProcess
    pod: PodsimProcess
    port: int  # TLS (TCP) and HTTP/3 (UDP)
    cert: Path


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    cert, key = self_signed(tmp_path_factory.mktemp("trunc-tls"))
    port = free_tcp_and_udp_port()
    with PodsimProcess(FAST) as pod:
        config = {
            "server": {"host": "127.0.0.1", "tls": {"cert": str(cert), "key": str(key), "port": port}},
            "timeouts": {"stall_s": STALL_S},
            "health": {"outlier": {"consecutive_failures": 1000}},  # every request here fails on purpose
            "pods": [{"name": "pod-a", "url": pod.url, "models": ["llama-8b"]}],
        }
        with GatewayProcess(config) as gw:
            yield Env(gw, pod, port, cert)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def gauge(admin_url: str, name: str) -> float:
    for line in httpx.get(admin_url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name}")


def sse_error(body: bytes) -> dict[str, Any]:
    """The error event that ends ``body``; fails unless the stream ends with it and ``[DONE]``."""
    events = [e for e in body.replace(b"\r\n", b"\n").split(b"\n\n") if e.strip()]
    assert events[-1] == b"data: [DONE]", body[-300:]
    assert events[-2].startswith(b'data: {"error"'), body[-600:]
    return json.loads(events[-2][6:])["error"]


def expect_error(error: dict[str, Any], outcome: str) -> None:
    if outcome == "timeout_stall":
        assert (error["type"], error["code"]) == ("timeout", "stall"), error
    else:
        assert (error["type"], error["code"]) == ("upstream_error", "upstream_truncated"), error


async def over(transport: str, env: Env, headers: dict[str, str]) -> dict[str, Any]:
    """One streamed request; the client's view of how it ended, as an error dict."""
    body = json.dumps({**CHAT, "stream": True}).encode()
    if transport != "grpc-web":
        headers = {**headers, "content-type": "application/json"}
    if transport == "h1":
        async with httpx.AsyncClient(timeout=20) as client:
            resp = await client.post(env.gw.url + "/v1/chat/completions", content=body, headers=headers)
        assert resp.status_code == 200 and resp.http_version == "HTTP/1.1"
        return sse_error(resp.content)
    if transport == "h2":
        verify = client_context(env.cert, ["h2"])
        async with httpx.AsyncClient(http1=False, http2=True, verify=verify, timeout=20) as client:
            resp = await client.post(
                f"https://localhost:{env.port}/v1/chat/completions", content=body, headers=headers
            )
        assert resp.status_code == 200 and resp.http_version == "HTTP/2"
        return sse_error(resp.content)
    if transport == "h3":
        h3_headers = [(k.encode(), v.encode()) for k, v in headers.items()]
        async with h3_client(env.port, env.cert) as client:
            h3 = client.request(
                "/v1/chat/completions", body=body,
                headers=[(b"content-type", b"application/json"), *h3_headers],
            )  # fmt: skip
            await h3.until(lambda: h3.ended, timeout_s=20)
        assert h3.status == 200
        return sse_error(bytes(h3.body))
    ask = CHAT
    resp, payloads, status = await asyncio.to_thread(
        grpc_web, env.gw.url, "StreamChatCompletion", ask, headers=headers
    )
    assert resp.status_code == 200 and payloads, status  # tokens came first, then the verdict
    return {"grpc-status": status["grpc-status"], "message": status.get("grpc-message", "")}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("knob", list(SHAPES))
async def test_every_short_stream_is_an_error_on_every_transport(env: Env, knob: str, transport: str) -> None:
    rid = f"trunc-{transport}-{knob.split('=')[0]}"
    rss_before = rss_bytes(env.gw.pid)
    outcome = SHAPES[knob]
    seen = await over(transport, env, {"x-podsim-fault": knob, "x-request-id": rid})
    if transport == "grpc-web":
        expected = "4" if outcome == "timeout_stall" else "14"  # DEADLINE_EXCEEDED, UNAVAILABLE; never 0
        assert seen["grpc-status"] == expected, seen
    else:
        expect_error(seen, outcome)
    # the pod's connection is closed, not parked for reuse; and the pod saw it go where it was still sending
    assert await asyncio.to_thread(
        wait_for, lambda: gauge(env.gw.admin_url, "sluicegate_upstream_connections") == 0
    )
    if knob in OPEN_ENDED:
        aborted = lambda: any(  # noqa: E731
            a["id"] == rid for a in httpx.get(env.pod.url + "/podsim/aborts").json()["aborts"]
        )
        assert await asyncio.to_thread(wait_for, aborted)
    if knob in BIG:  # megabytes from the pod, yet the gateway holds at most about one capped line
        assert rss_bytes(env.gw.pid) - rss_before < 48 * MiB
    assert await asyncio.to_thread(wait_for, lambda: f"rid={rid} " in env.gw.log())
    line = next(ln for ln in env.gw.log().splitlines() if f"rid={rid} " in ln)
    assert f"outcome={outcome} " in line and "status=200" in line, line


@pytest.mark.parametrize(
    ("knob", "raised"),
    [
        ("end_after=2", openai.APIError),
        ("no_finish=1", openai.APIError),
        ("garbage_after=2", openai.APIError),  # the SDK skips a line with no data field
        # cut inside an event (the 1 MiB cap): that partial event, already spliced through, is the
        # SDK's first complaint; the error event that follows it never gets read
        ("huge_event_after=2", json.JSONDecodeError),
    ],
)
def test_the_openai_sdk_raises_instead_of_returning_a_short_answer(
    env: Env, knob: str, raised: type[Exception]
) -> None:
    client = openai.OpenAI(base_url=env.gw.url + "/v1", api_key="sk-none", max_retries=0, timeout=20)
    text = ""
    with pytest.raises(raised) as caught:
        stream = client.chat.completions.create(**CHAT, stream=True, extra_headers={"x-podsim-fault": knob})
        for chunk in stream:
            text += "".join(c.delta.content or "" for c in chunk.choices)
    if raised is openai.APIError:
        assert "Upstream pod 'pod-a' failed" in str(caught.value)
    assert text  # the tokens before the cut arrived; the end is an exception, not a short answer


def test_truncation_is_counted(env: Env) -> None:
    def kinds() -> dict[str, float]:
        return counter_totals(env.gw.admin_url, "sluicegate_upstream_errors", "kind", pod="pod-a")

    before = kinds()
    for knob in ("end_after=2", "endless_line_after=2"):
        httpx.post(
            env.gw.url + "/v1/chat/completions",
            json={**CHAT, "stream": True},
            headers={"x-podsim-fault": knob},
        )
    after = kinds()
    assert after.get("truncated", 0) == before.get("truncated", 0) + 1
    assert after.get("protocol", 0) == before.get("protocol", 0) + 1


@pytest.mark.parametrize("knob", ["end_after=0", "garbage_after=0", "bad_utf8_after=0", "malformed_after=0"])
def test_a_whole_answer_that_is_not_json_is_a_502(env: Env, knob: str) -> None:
    resp = httpx.post(env.gw.url + "/v1/chat/completions", json=CHAT, headers={"x-podsim-fault": knob})
    assert resp.status_code == 502
    assert resp.json()["error"]["code"] == "upstream_truncated"


@pytest.mark.parametrize("knob", ["endless_line_after=0", "huge_event_after=0"])
def test_an_oversized_first_event_is_a_502_before_any_byte(env: Env, knob: str) -> None:
    rss_before = rss_bytes(env.gw.pid)
    resp = httpx.post(
        env.gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}, headers={"x-podsim-fault": knob}
    )
    assert (
        resp.status_code == 502
        and "malformed event before the first token" in resp.json()["error"]["message"]
    )
    assert rss_bytes(env.gw.pid) - rss_before < 48 * MiB


def test_a_short_stream_is_resumed_on_another_pod_where_resume_is_on() -> None:
    with PodsimProcess(FAST) as good, PodsimProcess(FAST) as bad:
        httpx.post(bad.url + "/admin/faults", json={"end_after": 3}).raise_for_status()
        config = {
            "server": {"host": "127.0.0.1", "access_log": False},
            "resume": {"models": ["*"], "max_per_request": 2},
            "health": {"outlier": {"consecutive_failures": 1000}},
            "pods": [{"name": "good", "url": good.url, "models": ["llama-8b"]},
                     {"name": "bad", "url": bad.url, "models": ["llama-8b"]}],
        }  # fmt: skip
        expected = httpx.post(good.url + "/v1/chat/completions", json={**CHAT, "stream": True}).content
        with GatewayProcess(config) as gw:
            for _ in range(3):  # ties rotate between the pods: some start on the bad one
                body = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}).content
                assert body.endswith(b"data: [DONE]\n\n") and b'"error"' not in body
                assert _text(body) == _text(expected)
            resumed = counter_totals(gw.admin_url, "sluicegate_stream_resumes", "outcome")
    assert resumed.get("ok", 0) >= 1


def _text(body: bytes) -> str:
    out = ""
    for event in body.split(b"\n\n"):
        if event.startswith(b"data: {"):
            for choice in json.loads(event[6:]).get("choices", []):
                out += (choice.get("delta") or {}).get("content") or ""
    return out


# -- independent evidence: a raw socket server replaying vLLM's own bytes ----------------------------

# ../shared/wire/vllm-chat-stream.txt, byte for byte (a test below holds the copy to the file)
VLLM_EVENTS = [
    b'data: {"id":"chatcmpl-9f1c","object":"chat.completion.chunk","created":1761566772,"model":"llama-8b",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
    b'"prompt_token_ids":null,"prompt_text":null}\n\n',
    b'data: {"id":"chatcmpl-9f1c","object":"chat.completion.chunk","created":1761566772,"model":"llama-8b",'
    b'"choices":[{"index":0,"delta":{"content":" Hello"},"logprobs":null,"finish_reason":null,'
    b'"token_ids":null}]}\n\n',
    b'data: {"id":"chatcmpl-9f1c","object":"chat.completion.chunk","created":1761566772,"model":"llama-8b",'
    b'"choices":[{"index":0,"delta":{"content":"."},"logprobs":null,"finish_reason":"stop","stop_reason":null,'
    b'"token_ids":null}]}\n\n',
    b'data: {"id":"chatcmpl-9f1c","object":"chat.completion.chunk","created":1761566772,"model":"llama-8b",'
    b'"choices":[],"usage":{"prompt_tokens":21,"total_tokens":23,"completion_tokens":2}}\n\n',
    b"data: [DONE]\n\n",
]
ROLE, HELLO, FINISH, USAGE, DONE = VLLM_EVENTS
WIRE = Path(__file__).resolve().parents[2] / "shared" / "wire" / "vllm-chat-stream.txt"


def _choice(index: int, content: str, finish: str | None = None) -> bytes:
    reason = "null" if finish is None else f'"{finish}"'
    return (
        b'data: {"id":"cmpl-n2","object":"chat.completion.chunk","created":1,"model":"llama-8b","choices":'
        b'[{"index":%d,"delta":{"content":"%b"},"finish_reason":%b}]}\n\n'
        % (index, content.encode(), reason.encode())
    )


# cut -> (framing, events sent one write each, whether the answer is whole)
CUTS: dict[str, tuple[str, list[bytes], bool]] = {
    "whole": ("chunked", VLLM_EVENTS, True),
    "no_done": ("chunked", [ROLE, HELLO, FINISH, USAGE], True),  # finish_reason seen: whole without [DONE]
    "between_events": ("chunked", [ROLE, HELLO], False),
    "mid_event": ("chunked", [ROLE, HELLO, FINISH[:60]], False),
    "usage_without_finish": ("chunked", [ROLE, HELLO, USAGE], False),
    "content_length": ("length", [ROLE, HELLO], False),
    "until_close": ("close", [ROLE, HELLO], False),
    "until_close_whole": ("close", VLLM_EVENTS, True),  # the close ends a body that has no length
    "fin_mid_body": ("fin", [ROLE, HELLO], False),
    # n=2: choice 0 finishes first, long before the stream's last reads
    "n2_whole": ("chunked", [_choice(0, "a"), _choice(1, "b"), _choice(0, "c", "stop"),
                             *(_choice(1, w) for w in "defgh"), _choice(1, "i", "length")], True),
    "n2_unfinished": ("chunked", [_choice(0, "a"), _choice(1, "b"), _choice(0, "c", "stop"),
                                  *(_choice(1, w) for w in "defgh")], False),
    # before any token: 2 MiB of keep-alive comments, every line short (not the line cap's case)
    "comment_flood": ("chunked", [ROLE, b": keep-alive\n\n" * (2 * MiB // 14), HELLO, DONE], False),
}  # fmt: skip


class RawPod:
    """An OpenAI-compatible pod on a bare asyncio socket server, in its own thread: no aiohttp, no
    HTTP library at all, one request per connection. ``x-cut`` picks what it sends."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self.closed_by_peer: list[str] = []
        started = threading.Event()
        threading.Thread(target=self._run, args=(started,), daemon=True).start()
        assert started.wait(10)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        started.set()
        self.loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            headers = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:] if b": " in line)
            await reader.readexactly(int(headers.get(b"content-length", b"0")))
            if head.startswith(b"GET "):  # discovery's /v1/models and the /health probe
                listing = b'{"object":"list","data":[{"id":"llama-8b","object":"model"}]}'
                answer = listing if head.startswith(b"GET /v1/models") else b""
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%b" % (len(answer), answer))  # fmt: skip
                await writer.drain()
                writer.close()
                return
            cut = headers.get(b"x-cut", b"whole").decode()
            framing, events, _ = CUTS[cut]
            status = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            if framing == "length":
                body = b"".join(events)
                writer.write(
                    status + b"content-length: %d\r\nconnection: close\r\n\r\n%b" % (len(body), body)
                )
            else:
                chunked = framing in ("chunked", "fin")
                writer.write(
                    status
                    + (b"transfer-encoding: chunked\r\n" if chunked else b"")
                    + b"connection: close\r\n\r\n"
                )
                for event in events:
                    writer.write(b"%x\r\n%b\r\n" % (len(event), event) if chunked else event)
                    await writer.drain()
                    await asyncio.sleep(0.005)  # one event per read at the gateway
                if framing == "chunked":
                    writer.write(b"0\r\n\r\n")
            await writer.drain()
            writer.close()  # "close" framing: the close is the body's end; "fin": it cuts the body
        except (ConnectionError, asyncio.IncompleteReadError):
            writer.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def raw_gateway() -> Iterator[str]:
    pod = RawPod()
    config = {
        "server": {"host": "127.0.0.1", "access_log": False},
        "health": {"outlier": {"consecutive_failures": 1000}, "probe": {"interval_s": 600}},
        "pods": [{"name": "raw", "url": f"http://127.0.0.1:{pod.port}", "models": ["llama-8b"]}],
    }
    try:
        with GatewayProcess(config) as gw:
            yield gw.url
    finally:
        pod.stop()


@pytest.mark.skipif(not WIRE.exists(), reason="shared wire samples not present")
def test_the_raw_pod_replays_vllms_bytes_exactly() -> None:
    assert b"".join(VLLM_EVENTS) == WIRE.read_bytes()


def test_megabytes_before_the_first_token_are_a_502_not_a_growing_buffer(raw_gateway: str) -> None:
    resp = httpx.post(
        raw_gateway + "/v1/chat/completions",
        json={**CHAT, "stream": True},
        headers={"x-cut": "comment_flood"},
    )
    assert resp.status_code == 502 and "no token" in resp.json()["error"]["message"]


@pytest.mark.parametrize("cut", [cut for cut in CUTS if cut != "comment_flood"])
def test_an_independent_pod_cut_anywhere_gets_the_same_verdict(raw_gateway: str, cut: str) -> None:
    _, events, whole = CUTS[cut]
    body = {**CHAT, "stream": True, **({"n": 2} if cut.startswith("n2") else {})}
    resp = httpx.post(raw_gateway + "/v1/chat/completions", json=body, headers={"x-cut": cut}, timeout=20)
    assert resp.status_code == 200
    if whole:  # passed on untouched, whether or not it ends with [DONE]
        assert resp.content == b"".join(events)
    else:
        error = sse_error(resp.content)
        assert error["code"] == "upstream_truncated", error
    # gRPC-Web: the same verdict, as the trailers' status
    ask = {**CHAT, **({"n": 2} if cut.startswith("n2") else {})}
    _, payloads, status = grpc_web(raw_gateway, "StreamChatCompletion", ask, headers={"x-cut": cut})
    assert payloads and status["grpc-status"] == ("0" if whole else "14"), status


# -- the pod client's own checks, over a real socket ---------------------------------------------------


async def _one_answer(answer: list[bytes], gap_s: float = 0.0) -> tuple[asyncio.Server, int]:
    """A loopback server that writes ``answer`` piece by piece (``gap_s`` apart), then closes."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        for piece in answer:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(gap_s)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


async def test_a_line_past_the_cap_ends_the_answer_with_little_held() -> None:
    pieces = [SSE_HEAD + b"transfer-encoding: chunked\r\n\r\n", _chunk(HELLO), _chunk(b'data: {"id":"')]
    pieces += [_chunk(b"A" * 65536)] * 40  # 2.5 MiB, never a newline
    server, port = await _one_answer(pieces)
    client = PodClient(1.0, 30.0)
    resp = await client.request("127.0.0.1", port, "/", [], b"")
    resp.max_line = 256 * 1024
    got = bytearray()
    resp.splice(got.extend)
    with pytest.raises(PodLineTooLong):
        await asyncio.wait_for(resp.done, 10)
    # the line's bytes up to the cap passed; the read that crossed it did not, nor anything after
    assert 128 * 1024 < len(got) - len(HELLO) <= 256 * 1024 + len(b'data: {"id":"')
    await client.close()
    server.close()


@pytest.mark.parametrize(
    ("reads", "progress"),
    [
        ([b": keep-alive\n\n"] * 3, False),  # comments only: the stall watch sees silence
        ([b": keep-alive\n\n" + HELLO] * 3, True),  # a comment and a token in one read is progress
        ([HELLO] * 3, True),
    ],
)
async def test_only_reads_with_data_count_as_progress_for_the_stall_watch(
    reads: list[bytes], progress: bool
) -> None:
    pieces = [SSE_HEAD + b"transfer-encoding: chunked\r\n\r\n", _chunk(ROLE), *map(_chunk, reads)]
    server, port = await _one_answer(pieces, gap_s=0.05)
    client = PodClient(1.0, 30.0)
    resp = await client.request("127.0.0.1", port, "/", [], b"")
    assert await resp.read() == ROLE  # the role chunk is data: progress
    since = resp.last_at
    for _ in reads:
        await resp.read()
    assert (resp.last_at > since + 0.09) == progress  # three reads 50 ms apart moved it, or not at all
    await client.close()
    server.close()


@pytest.mark.parametrize("framing", ["until_close", "chunked_then_fin"])
async def test_the_close_ends_a_body_only_when_it_has_no_length(framing: str) -> None:
    if framing == "until_close":  # no content-length, not chunked: the close is the end (RFC 9112 6.3)
        pieces = [SSE_HEAD + b"\r\n", ROLE, HELLO]
    else:  # chunked: a close before the last chunk cuts the body
        pieces = [SSE_HEAD + b"transfer-encoding: chunked\r\n\r\n", _chunk(ROLE), _chunk(HELLO)]
    server, port = await _one_answer(pieces)
    client = PodClient(1.0, 30.0)
    resp = await client.request("127.0.0.1", port, "/", [], b"")
    if framing == "until_close":
        assert await resp.read_all() == ROLE + HELLO and resp.complete
        assert resp.previous + resp.last == ROLE + HELLO  # what the relay's verdict reads (not whole)
    else:
        with pytest.raises(PodBrokenError):
            await resp.read_all()
    await client.close()
    server.close()


@pytest.mark.parametrize(
    "ending",
    [
        [b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DO', b"NE]\n", b"\n"],
        [b"data: [DONE]\r", b"\n", b"\r\n"],  # CRLF lines, the blank line split across reads
        [b"data: [DONE]\n", b"\r\n"],  # a legal mix of line endings
    ],
)
async def test_a_last_event_split_over_several_reads_is_still_whole(ending: list[bytes]) -> None:
    pieces = [SSE_HEAD + b"transfer-encoding: chunked\r\n\r\n", _chunk(ROLE), _chunk(HELLO)]
    pieces += [_chunk(piece) for piece in ending] + [b"0\r\n\r\n"]
    server, port = await _one_answer(pieces, gap_s=0.05)  # apart, so each piece is a read of its own
    client = PodClient(1.0, 30.0)
    resp = await client.request("127.0.0.1", port, "/", [], b"")
    resp.max_line = 1024 * 1024  # an SSE stream, as the relay sets it
    got = bytearray()
    resp.splice(got.extend)
    await asyncio.wait_for(resp.done, 10)
    assert resp.chunks >= 2 + len(ending)
    assert stream_incomplete(resp.previous + resp.last) is None, resp.previous + resp.last
    await client.close()
    server.close()
