"""The gRPC-Web adapter (gateway/grpc_web.py) without sockets: a scripted relay in place of the real one.

The system tests (tests/test_grpc_web.py) run the same paths through a real gateway and pods; these
pin the translation details: request → OpenAI JSON, relay messages → frames and trailers.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from gateway.config import Config
from gateway.errors import GatewayError, model_not_found, overloaded
from gateway.grpc_web import ChunkEncoder, GrpcWebEndpoint, chunk_message, openai_body, parse_json
from loadtest.podsim.wire import StreamFormat, chat_response
from transports import grpc_web as codec
from transports.client_socket import client_socket
from transports.grpc_web import Status
from transports.proto.sluicegate.v1 import inference_pb2 as pb

Message = dict[str, Any]
STREAM = "/sluicegate.v1.Inference/StreamChatCompletion"
UNARY = "/sluicegate.v1.Inference/ChatCompletion"
REQUEST = pb.ChatCompletionRequest(
    model="llama-8b", messages=[pb.ChatMessage(role="user", content="hi")], max_tokens=3, seed=7
)
FMT = StreamFormat(chat=True, request_id="chatcmpl-1", created=1795430774, model="llama-8b")
SSE = (
    FMT.first + FMT.token(b" one") + FMT.token(b" two") + FMT.final(b" three", "length") + b"data: [DONE]\n\n"
)


class ScriptedRelay:
    """Stands in for ``Relay.__call__``: reads the body like admission does, then plays ``script``."""

    def __init__(
        self, script: list[Message] | Callable[[], list[Message]], error: GatewayError | None = None
    ):
        self.config = Config()
        self.script = script
        self.error = error
        self.body: bytes | None = None
        self.scope: dict[str, Any] = {}
        self.receive: Any = None
        self.send: Any = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any, route: str) -> None:
        assert route == "chat"
        self.scope, self.receive, self.send = scope, receive, send
        try:
            message = await receive()
        except GatewayError as err:  # as the relay's admission raises it
            await _send_error(send, err)
            return
        assert message["type"] == "http.request" and not message["more_body"]
        self.body = message["body"]
        if self.error is not None:
            await _send_error(send, self.error)
            return
        for m in self.script() if callable(self.script) else self.script:
            await send(m)


async def _send_error(send: Any, err: GatewayError) -> None:
    headers = [(b"content-type", b"application/json"), *((k.encode(), v.encode()) for k, v in err.headers)]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": err.body(), "more_body": False})


def sse_script(*bodies: bytes) -> list[Message]:
    start = {
        "type": "http.response.start",
        "status": 200,
        "headers": [
            (b"content-type", b"text/event-stream"),
            (b"x-request-id", b"rid-1"),
            (b"x-sluicegate-pod", b"a"),
        ],
    }
    return [start, *({"type": "http.response.body", "body": b, "more_body": True} for b in bodies),
            {"type": "http.response.body", "body": b"", "more_body": False}]  # fmt: skip


class Client:
    """What the client's connection receives."""

    def __init__(self) -> None:
        self.sent: list[Message] = []

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int:
        return self.sent[0]["status"]

    @property
    def headers(self) -> dict[bytes, bytes]:
        return dict(self.sent[0]["headers"])

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent[1:])


def body_receive(*chunks: bytes) -> Callable[[], Awaitable[Message]]:
    messages = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)
    ]

    async def receive() -> Message:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    return receive


async def call(
    relay: ScriptedRelay,
    path: str = STREAM,
    body: bytes | None = None,
    content_type: bytes = b"application/grpc-web+proto",
    headers: list[tuple[bytes, bytes]] | None = None,
    method: str = "POST",
    receive: Callable[[], Awaitable[Message]] | None = None,
) -> Client:
    if body is None:
        body = codec.encode_message(REQUEST.SerializeToString())
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "headers": [(b"content-type", content_type), *(headers or [])],
    }
    client = Client()
    await GrpcWebEndpoint(relay)(scope, receive or body_receive(body), client.send)  # type: ignore[arg-type]
    return client


def messages_and_trailers(body: bytes) -> tuple[list[pb.ChatCompletionChunk], dict[str, str]]:
    frames = codec.decode_frames(body)
    assert frames[-1].is_trailers and not any(f.is_trailers for f in frames[:-1])
    return [pb.ChatCompletionChunk.FromString(f.payload) for f in frames[:-1]], codec.parse_trailers(
        frames[-1].payload
    )


# -- requests --------------------------------------------------------------------------------------


def test_a_request_becomes_the_openai_body_with_only_the_fields_that_were_set() -> None:
    req = pb.ChatCompletionRequest(
        model="m",
        messages=[
            pb.ChatMessage(role="system", content="be brief"),
            pb.ChatMessage(role="user", content="hé", name="u"),
        ],
        temperature=0.0,
        stop=["\n", "END"],
        stream_options=pb.StreamOptions(include_usage=True),
        ignore_eos=False,
    )
    assert json.loads(openai_body(req, stream=True)) == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hé", "name": "u"},
        ],
        "temperature": 0.0,  # set, even to its default: the pod's own default must not apply
        "ignore_eos": False,
        "stop": ["\n", "END"],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert json.loads(openai_body(REQUEST, stream=False)) == {
        "model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "seed": 7,
    }  # fmt: skip


async def test_the_relay_gets_json_and_the_grpc_timeout_as_its_own_deadline_header() -> None:
    relay = ScriptedRelay(sse_script(SSE))
    await call(
        relay,
        headers=[
            (b"grpc-timeout", b"1500m"),
            (b"x-request-timeout-ms", b"2000"),
            (b"x-grpc-web", b"1"),
            (b"authorization", b"Bearer sk-1"),
            (b"x-podsim-fault", b"drop_after=3"),
        ],
    )
    assert relay.body is not None and json.loads(relay.body)["stream"] is True
    assert relay.scope["headers"] == [
        (b"authorization", b"Bearer sk-1"),
        (b"x-podsim-fault", b"drop_after=3"),
        (b"content-type", b"application/json"),
        (b"x-request-timeout-ms", b"1500"),  # the shorter of the two
    ]


async def test_a_malformed_grpc_timeout_is_invalid_argument() -> None:
    relay = ScriptedRelay([])
    client = await call(relay, headers=[(b"grpc-timeout", b"soon")])
    assert client.status == 200 and client.headers[b"grpc-status"] == b"3"
    assert relay.body is None


@pytest.mark.parametrize(
    ("body", "code", "message"),
    [
        (b"\x00\x00\x00\x00\x05abc", Status.INVALID_ARGUMENT, b"Malformed gRPC-Web request body"),
        (codec.encode_message(b"\xff\xff"), Status.INVALID_ARGUMENT, b"not a valid ChatCompletionRequest"),
        (codec.encode_message(b"") * 2, Status.INVALID_ARGUMENT, b"exactly one message frame"),
        (codec.encode_frame(b"x", codec.FLAG_COMPRESSED), Status.UNIMPLEMENTED, b"Compressed"),
        (codec.encode_message(b"m" * (4 * 1024 * 1024 + 1)), Status.RESOURCE_EXHAUSTED, b"larger than"),
        (
            codec.encode_message(b"m" * (4 * 1024 * 1024 + 1))[:4096],
            Status.RESOURCE_EXHAUSTED,
            b"larger than",
        ),
    ],
)
async def test_bad_request_bodies_are_answered_through_the_relays_error_path(
    body: bytes, code: Status, message: bytes
) -> None:
    client = await call(ScriptedRelay([]), body=body)
    assert client.status == 200 and client.body == b""
    assert client.headers[b"grpc-status"] == b"%d" % code
    assert message in client.headers[b"grpc-message"]


async def test_a_client_that_leaves_while_sending_its_request_is_reported_to_the_relay() -> None:
    seen = []

    async def gone() -> Message:
        return {"type": "http.disconnect"}

    class Relay(ScriptedRelay):
        async def __call__(self, scope: Any, receive: Any, send: Any, route: str) -> None:
            seen.append(await receive())  # admission raises ClientGone on this

    client = await call(Relay([]), receive=gone)
    assert seen == [{"type": "http.disconnect"}] and client.sent == []


async def test_after_the_body_receive_passes_the_connection_through_bound_to_the_servers_cycle() -> None:
    class Cycle:
        """What the relay's disconnect watch looks for behind uvicorn's ``receive``."""

        def __init__(self) -> None:
            self.messages = [
                {
                    "type": "http.request",
                    "body": codec.encode_message(REQUEST.SerializeToString()),
                    "more_body": False,
                },
                {"type": "http.disconnect"},
            ]

        async def receive(self) -> Message:
            return self.messages.pop(0)

    cycle = Cycle()
    relay = ScriptedRelay(sse_script(SSE))
    await call(relay, receive=cycle.receive)
    assert relay.receive.__self__ is cycle  # the relay's tripwire and hang-up pairing find the connection
    assert await relay.receive() == {"type": "http.disconnect"}
    # and the send it got is not one the splice can write around: no socket behind it
    assert client_socket(relay.send) is None


# -- responses -----------------------------------------------------------------------------------


async def test_an_sse_stream_becomes_chunk_frames_and_ok_trailers_whatever_the_read_boundaries() -> None:
    for size in (1, 7, 64, len(SSE)):
        pieces = [SSE[i : i + size] for i in range(0, len(SSE), size)]
        client = await call(ScriptedRelay(sse_script(*pieces)), headers=[(b"origin", b"https://app.example")])
        assert client.status == 200
        assert client.headers[b"content-type"] == b"application/grpc-web+proto"
        assert client.headers[b"x-request-id"] == b"rid-1" and client.headers[b"x-sluicegate-pod"] == b"a"
        assert client.headers[b"access-control-allow-origin"] == b"https://app.example"
        assert b"grpc-status" in client.headers[b"access-control-expose-headers"]
        chunks, trailers = messages_and_trailers(client.body)
        assert trailers == {"grpc-status": "0"}
        assert "".join(c.choices[0].delta.content for c in chunks) == " one two three"
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.HasField(
            "content"
        )
        assert chunks[-1].choices[0].finish_reason == "length" and not chunks[1].choices[0].HasField(
            "finish_reason"
        )
        assert {c.id for c in chunks} == {"chatcmpl-1"} and chunks[0].created == 1795430774


async def test_one_client_write_per_relay_write_and_none_for_a_partial_event() -> None:
    half = len(FMT.first) // 2
    client = await call(ScriptedRelay(sse_script(FMT.first[:half], FMT.first[half:] + FMT.token(b" x"))))
    bodies = [m for m in client.sent[1:]]
    assert len(bodies) == 2  # the partial event produced nothing; the rest one write; then trailers
    assert len(codec.decode_frames(bodies[0]["body"])) == 2 and bodies[0]["more_body"] is True
    assert codec.decode_frames(bodies[1]["body"])[0].is_trailers and bodies[1]["more_body"] is False


async def test_text_mode_answers_in_base64_and_reads_base64() -> None:
    body = codec.encode_text(codec.encode_message(REQUEST.SerializeToString()))
    relay = ScriptedRelay(sse_script(SSE[:100], SSE[100:]))
    client = await call(
        relay, body=body[:10] + b"\r\n" + body[10:], content_type=b"application/grpc-web-text"
    )
    assert json.loads(relay.body or b"")["model"] == "llama-8b"
    assert client.headers[b"content-type"] == b"application/grpc-web-text+proto"
    chunks, trailers = messages_and_trailers(codec.decode_text(client.body))
    assert (
        "".join(c.choices[0].delta.content for c in chunks) == " one two three"
        and trailers["grpc-status"] == "0"
    )


async def test_an_error_event_mid_stream_ends_it_with_that_status_in_the_trailers() -> None:
    timeout = GatewayError(504, "Timed out waiting for the next token after 0.4 s.", "timeout", "stall")
    client = await call(ScriptedRelay(sse_script(FMT.first + FMT.token(b" one"), timeout.sse_event())))
    chunks, trailers = messages_and_trailers(client.body)
    assert len(chunks) == 2
    assert trailers == {
        "grpc-status": "4",
        "grpc-message": "Timed out waiting for the next token after 0.4 s.",
    }


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (model_not_found("nope"), Status.NOT_FOUND),
        (overloaded("llama-8b", "pressure", 2), Status.RESOURCE_EXHAUSTED),
        (GatewayError(504, "Timed out connecting.", "timeout", "connect"), Status.DEADLINE_EXCEEDED),
        (GatewayError(503, "No pod.", "service_unavailable", "no_healthy_upstream"), Status.UNAVAILABLE),
        (GatewayError(502, "Pod failed.", "upstream_error", "bad_gateway"), Status.UNAVAILABLE),
        (GatewayError(400, "'messages' is required.", code="missing_messages"), Status.INVALID_ARGUMENT),
        (GatewayError(405, "Use POST.", code="method_not_allowed"), Status.UNIMPLEMENTED),
    ],
)
async def test_errors_before_the_first_token_are_trailers_only(error: GatewayError, code: Status) -> None:
    client = await call(ScriptedRelay([], error=error), headers=[(b"origin", b"https://app.example")])
    assert client.status == 200 and client.body == b"" and client.headers[b"content-length"] == b"0"
    assert client.headers[b"grpc-status"] == b"%d" % code
    assert codec.percent_decode(client.headers[b"grpc-message"]) == error.message
    assert client.headers[b"access-control-allow-origin"] == b"https://app.example"
    if error.status == 429:
        assert client.headers[b"retry-after"] == b"2"


async def test_the_unary_call_answers_one_chat_completion_and_ok_trailers() -> None:
    answer = chat_response("chatcmpl-9", 1795430774, "llama-8b", " one two", "stop", 7, 2)
    script = [
        {"type": "http.response.start", "status": 200,
         "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(answer))]},
        {"type": "http.response.body", "body": answer, "more_body": False},
    ]  # fmt: skip
    relay = ScriptedRelay(script)
    client = await call(relay, path=UNARY)
    assert "stream" not in json.loads(relay.body or b"")
    frames = codec.decode_frames(client.body)
    assert int(client.headers[b"content-length"]) == len(client.body)
    done = pb.ChatCompletion.FromString(frames[0].payload)
    assert done.choices[0].message.content == " one two" and done.choices[0].message.role == "assistant"
    assert done.choices[0].finish_reason == "stop" and done.usage.completion_tokens == 2
    assert codec.parse_trailers(frames[1].payload) == {"grpc-status": "0"}


async def test_wrong_content_type_method_and_path() -> None:
    client = await call(ScriptedRelay([]), content_type=b"application/grpc-web+json")
    assert client.status == 415 and client.headers[b"grpc-status"] == b"3"
    client = await call(ScriptedRelay([]), path="/sluicegate.v1.Inference/Embed")
    assert client.status == 200 and client.headers[b"grpc-status"] == b"12"
    client = await call(ScriptedRelay([]), method="GET")
    assert client.status == 405 and client.headers[b"grpc-status"] == b"12"


async def test_cors_preflight_echoes_the_origin_and_allows_the_grpc_web_headers() -> None:
    client = await call(
        ScriptedRelay([]),
        method="OPTIONS",
        headers=[
            (b"origin", b"https://app.example"),
            (b"access-control-request-method", b"POST"),
            (b"access-control-request-headers", b"content-type,x-grpc-web,x-custom-meta"),
        ],
    )
    h = client.headers
    assert client.status == 204
    assert h[b"access-control-allow-origin"] == b"https://app.example"
    assert h[b"access-control-allow-methods"] == b"POST, OPTIONS"
    allowed = h[b"access-control-allow-headers"].split(b",")
    for name in (
        b"content-type",
        b"x-grpc-web",
        b"x-user-agent",
        b"grpc-timeout",
        b"authorization",
        b"x-custom-meta",
    ):
        assert name in allowed
    assert int(h[b"access-control-max-age"]) > 0 and b"access-control-allow-credentials" not in h


async def test_an_origin_outside_the_allowed_list_gets_no_cors_headers() -> None:
    relay = ScriptedRelay(sse_script(SSE))
    endpoint = GrpcWebEndpoint(relay, allowed_origins=["https://app.example"])  # type: ignore[arg-type]
    client = Client()
    scope = {
        "type": "http",
        "method": "OPTIONS",
        "path": STREAM,
        "headers": [(b"origin", b"https://evil.example")],
    }
    await endpoint(scope, body_receive(b""), client.send)
    assert client.status == 403 and not any(k.startswith(b"access-control") for k in client.headers)


# -- the hot path's encoder ----------------------------------------------------------------------

EVENTS = [
    json.loads(e.removeprefix(b"data: "))
    for e in (
        FMT.first + FMT.token(' \\"é😀\\n'.encode()) + FMT.final(b"", "stop") + FMT.usage(12, 300)
    ).split(b"\n\n")
    if e
] + [
    {
        "id": "c",
        "created": 5,
        "model": "m",
        "choices": [{"index": 3, "delta": {"reasoning_content": "think"}}],
    },
    {"id": "c", "created": 5, "model": "m", "choices": [{"index": 0, "delta": {"reasoning": "vllm-0.11"}}]},
    {"id": "c", "created": 5, "model": "m", "choices": [{"index": 0, "delta": {}, "finish_reason": ""}]},
    {"id": "c" * 200, "created": 2**31, "model": "m", "choices": [], "system_fingerprint": "fp"},
    {"id": "c", "created": 2**40, "model": "m", "choices": [{"index": 1, "delta": {"content": "x" * 300}}]},
    {"id": "c", "created": -1, "model": "m", "choices": []},  # unusual: left to the generated code
    {"choices": [{"delta": {"content": "x"}}], "usage": None},
]


@pytest.mark.parametrize("event", EVENTS)
def test_the_fast_chunk_encoder_writes_what_the_generated_code_writes(event: dict[str, Any]) -> None:
    encoder = ChunkEncoder()
    expected = chunk_message(event).SerializeToString()
    assert encoder.encode(event) == expected
    assert encoder.encode(event) == expected  # the cached head too


def test_parse_json_is_json_loads() -> None:
    for data in (b'{"a":1}', b'{"a": [1, "\\u00e9"]} ', b' {"a":1}', b"[DONE]x", b"{"):
        try:
            expected = json.loads(data)
        except ValueError:
            with pytest.raises(ValueError):
                parse_json(data)
            continue
        assert parse_json(data) == expected


def _raw(event: bytes) -> bytes:
    return event.removeprefix(b"data: ").removesuffix(b"\n\n")


TOKENS = [
    " plain",
    "",
    " é",
    " 😀",
    ' say \\"hi\\"',
    " back\\\\slash",
    " new\\nline",
    " tab\\t",
    "x" * 300,
    " end",
]


def test_the_token_shortcut_writes_what_the_parse_writes_and_skips_the_parse_for_plain_tokens() -> None:
    encoder = ChunkEncoder()
    events = [
        FMT.first,
        *(FMT.token(t.encode()) for t in TOKENS),
        FMT.final(b" last", "stop"),
        FMT.usage(3, 12),
    ]
    other = StreamFormat(chat=True, request_id="chatcmpl-2", created=1795430775, model="llama-8b")
    events += [other.token(b" new"), other.token(b" stream")]  # a new id: the old template must not apply
    shortcut = []
    for event in map(_raw, events):
        expected = chunk_message(json.loads(event)).SerializeToString()
        payload = encoder.token(event)
        shortcut.append(payload is not None)
        if payload is None:
            payload = encoder.encode(json.loads(event), event)
        assert payload == expected, event
    # parsed: the role chunk, the first token (learned), escapes, the final and usage chunks, the
    # first token of the new stream; everything else took the shortcut
    assert shortcut == [False, False, True, True, True, False, False, False, False, True, True, False, False,
                        False, True]  # fmt: skip


@pytest.mark.parametrize(
    "event",
    [
        # duplicate keys: the last "choices" wins, so the gap is not where the content lands
        b'{"id":"c","choices":[{"index":0,"delta":{"content":"a"}}],"choices":[{"index":0,"delta":{"content":"a"}}]}',
        # the content is not the delta's
        b'{"id":"c","x":{"content":"a"},"choices":[{"index":0,"delta":{"content":"a"}}]}',
        # more than the content in the delta
        b'{"id":"c","choices":[{"index":0,"delta":{"content":"a","role":"assistant"}}]}',
    ],
)
def test_no_template_is_learned_from_an_event_whose_gap_is_not_the_content(event: bytes) -> None:
    encoder = ChunkEncoder()
    encoder.encode(json.loads(event), event)
    later = event.replace(b'"a"', b'"zz"', 1)
    assert encoder.token(later) is None


def test_a_whole_token_read_becomes_its_frame_as_the_parse_would_make_it() -> None:
    """``token_frame``: one read holding exactly one token event → the finished message frame,
    byte for byte what the parse path makes (contents of every length class: the lengths in the
    frame are cached by content length, and 128 bytes need a second varint byte)."""
    encoder = ChunkEncoder()
    events = [FMT.first, *(FMT.token(t.encode()) for t in [*TOKENS, "y" * 127, "z" * 128, "w" * 127])]
    other = StreamFormat(chat=True, request_id="chatcmpl-2", created=1795430775, model="llama-8b")
    events += [other.token(b" new"), other.token(b" stream")]  # a new id: the old template must not apply
    framed = []
    for read in events:
        data = _raw(read)
        expected = codec.encode_message(chunk_message(json.loads(data)).SerializeToString())
        frame = encoder.token_frame(read)
        framed.append(frame is not None)
        assert encoder.data_frame(data) == frame  # one event's data in a read of several: the same
        if frame is None:
            frame = codec.encode_message(encoder.token(data) or encoder.encode(json.loads(data), data))
        assert frame == expected, read
        assert encoder.token_frame(read[:-1]) is None and encoder.token_frame(b":\n\n" + read) is None
        assert encoder.token_frame(read + read) is None  # two events in one read: not one frame
    # framed: every plain token after the first of its stream (escapes are parsed)
    assert framed == [False, False, True, True, True, False, False, False, False,
                      True, True, True, True, True, False, True]  # fmt: skip


def test_no_whole_event_template_from_a_multi_line_event() -> None:
    """An event whose JSON spans ``data:`` lines is learned for ``token`` but not as one read."""
    event = b'{"id":"c","choices":[{"index":0,\n"delta":{"content":"a"}}]}'
    encoder = ChunkEncoder()
    encoder.encode(json.loads(event), event)
    assert encoder.token(event.replace(b'"a"', b'"b"')) is not None
    assert encoder.token_frame(b"data: " + event.replace(b'"a"', b'"b"') + b"\n\n") is None


class _Transport:
    """The client's transport as the splice sees it: what is written to it."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return self.closing


class _Flow:
    write_paused = False


class _Cycle:
    """uvicorn's HTTP/1.1 request cycle, as far as ``client_socket`` looks: a chunked response's
    transport and flow control, and its ``send``."""

    def __init__(self) -> None:
        self.transport = _Transport()
        self.flow = _Flow()
        self.chunked_encoding: bool | None = None
        self.sent: list[Message] = []

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.chunked_encoding = True
        self.sent.append(message)


class _Pod:
    def __init__(self) -> None:
        self.closed = False

    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...

    def close(self) -> None:
        self.closed = True


def _chunked(data: bytes) -> bytes:
    """The payloads of an HTTP/1.1 chunked body's chunks, joined."""
    out, pos = b"", 0
    while pos < len(data):
        end = data.index(b"\r\n", pos)
        size = int(data[pos:end], 16)
        assert size > 0  # a zero-size chunk would end the body
        out += data[end + 2 : end + 2 + size]
        pos = end + 2 + size + 2
    return out


@pytest.mark.parametrize("text", [False, True])
async def test_the_relays_splice_writes_the_same_frames_to_the_client_socket(text: bool) -> None:
    """Under uvicorn's HTTP/1.1 the relay splices a gRPC-Web stream too: ``client_socket(send)``
    gives the call's target, whose sink translates each pod read and writes the frames to the
    client's socket (nothing for a read without a whole event); the answer ends through ``send``."""
    cycle = _Cycle()
    content_type = b"application/grpc-web-text" if text else b"application/grpc-web+proto"
    body = codec.encode_message(REQUEST.SerializeToString())
    e = [event + b"\n\n" for event in SSE.split(b"\n\n") if event]
    pieces = [e[0][:7], e[0][7:], e[1], e[2], e[3][:1], e[3][1:] + e[4]]  # (whole token events: e[1], e[2])
    pod = _Pod()
    sink: Any = None

    async def relay(scope: dict[str, Any], receive: Any, send: Any, route: str) -> None:
        await receive()
        assert client_socket(send) is None  # nothing started yet: nothing to splice to
        for message in sse_script()[:1]:
            await send(message)
        socket = client_socket(send)
        assert socket is not None
        nonlocal sink
        sink = socket.writer(pod)
        for piece in pieces:
            sink(piece)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    relay.config = Config()  # type: ignore[attr-defined]
    scope = {"type": "http", "method": "POST", "path": STREAM, "headers": [(b"content-type", content_type)]}
    receive = body_receive(codec.encode_text(body) if text else body)
    await GrpcWebEndpoint(relay)(scope, receive, cycle.send)  # type: ignore[arg-type]
    assert len(cycle.transport.written) == 4  # the 7 bytes and the 1 byte finished no event
    spliced = b"".join(
        codec.decode_text(w) if text else w for w in map(_chunked, cycle.transport.written)
    )
    end = cycle.sent[-1]["body"]
    chunks, trailers = messages_and_trailers(spliced + (codec.decode_text(end) if text else end))
    assert "".join(c.choices[0].delta.content for c in chunks) == " one two three"
    assert trailers == {"grpc-status": "0"} and not pod.closed
    cycle.transport.closing = True  # the client left: the client socket's sink stops reading the pod
    sink(e[1])
    assert pod.closed and len(cycle.transport.written) == 4


def test_the_app_routes_to_grpc_web_by_the_endpoint_s_own_prefix() -> None:
    """The app routes by the prefix without importing the endpoint, so that it (and protobuf) load
    on the first call."""
    from gateway import app, grpc_web

    assert app.GRPC_WEB_PREFIX == grpc_web.PREFIX
