"""Property tests of the gRPC-Web adapter's translation between OpenAI JSON and protobuf
(gateway/grpc_web_call.py, grpc_web_chunks.py, grpc_web_messages.py), the part a pod and a client feed.

A pod's chunk goes through ``parse_json`` and the hand-written ``ChunkEncoder`` (or its template fast
path, ``token``); whatever the pod sent, the bytes must be exactly what the generated code writes, or the
failure one of the exceptions the adapter catches (it then skips the event or answers INTERNAL). A
client's ChatCompletionRequest, whatever its fields, becomes a JSON body."""

from __future__ import annotations

import contextlib
import json
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from gateway.grpc_web_call import Call
from gateway.grpc_web_chunks import ChunkEncoder, parse_json
from gateway.grpc_web_messages import as_chunk, chunk_message, completion_message, openai_body
from tests.fuzz_strategies import json_values, mutated, nested, run_sync, splits, wire_sample
from transports import grpc_web as codec
from transports.grpc_web import Status
from transports.proto.sluicegate.v1 import inference_pb2 as pb

CAUGHT = (ValueError, TypeError, AttributeError, KeyError)  # what Call._frames and _send_whole catch
KEYS = st.sampled_from([
    "id", "created", "model", "choices", "index", "delta", "role", "content", "reasoning_content",
    "reasoning", "finish_reason", "usage", "prompt_tokens", "completion_tokens", "total_tokens",
    "system_fingerprint", "message", "name",
])  # fmt: skip
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from([0, 1, 2**32 - 1, 2**32, -1]),
    st.floats(), st.text(max_size=10),
)  # fmt: skip


def _values(depth: int) -> st.SearchStrategy[Any]:
    return scalars if depth == 0 else st.one_of(scalars, json_values(KEYS), _objects(depth - 1))


def _objects(depth: int) -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(KEYS, _values(depth), max_size=5)


# chunks shaped like vLLM's, with any field of any type
events = st.fixed_dictionaries(
    {},
    optional={
        "id": _values(0), "created": _values(0), "model": _values(0), "system_fingerprint": _values(0),
        "usage": _values(1),
        "choices": st.lists(
            st.fixed_dictionaries(
                {}, optional={"index": _values(0), "delta": _values(1), "finish_reason": _values(0)}
            ),
            max_size=3,
        ) | _values(0),
    },
)  # fmt: skip


def _reference(event: dict[str, Any]) -> bytes | type[Exception]:
    try:
        return chunk_message(event).SerializeToString()
    except CAUGHT:
        return Exception


@given(events)
@example({"choices": [{"index": 2**32, "delta": {"content": "x"}}]})
@example({"created": -1, "choices": [{"delta": {"content": "\ud800"}}]})
@example({"usage": {"prompt_tokens": 2**64}})
@example({"choices": [{"delta": {"tool_calls": [{"id": "t"}]}}]})  # found by fuzzing: written as an empty
@example({"choices": [{"delta": {"role": None}}]})  # delta, which the generated code leaves out
def test_chunk_encoder_writes_what_the_generated_code_writes(event: dict[str, Any]) -> None:
    expected = _reference(event)
    try:
        got: bytes | type[Exception] = ChunkEncoder().encode(event, json.dumps(event).encode())
    except CAUGHT:
        got = Exception
    assert got == expected


@given(st.text(max_size=20), st.text(max_size=300), st.booleans())
@example("Hello", '", "role": "x', False)
@example("Hello", "\u2028", True)
@example("Hello", "x" * 200, False)  # a two-byte length varint in the frame
def test_a_learned_token_template_serializes_exactly_what_a_parse_would(
    first: str, second: str, ascii_only: bool
) -> None:
    """Learn from one vLLM token event, then feed another whose content is arbitrary text."""
    encoder = ChunkEncoder()

    def event(content: str) -> tuple[dict[str, Any], bytes]:
        value = {"id": "c1", "created": 7, "model": "m",
                 "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]}  # fmt: skip
        return value, json.dumps(value, separators=(",", ":"), ensure_ascii=ascii_only).encode()

    encoder.encode(*event(first))
    _, data = event(second)
    fast = encoder.token(data)
    expected = chunk_message(parse_json(data)).SerializeToString()
    assert fast is None or fast == expected
    for _ in range(2):  # the whole read as one frame; the second time from the cached frame head
        frame = encoder.token_frame(b"data: " + data + b"\n\n")
        assert frame is None or frame == codec.encode_message(expected)
        frame = encoder.data_frame(data)
        assert frame is None or frame == codec.encode_message(expected)


@given(st.binary(max_size=200))
@example(b"\xff")
@example(b" {}")
@example(nested(100_000))  # found by fuzzing: RecursionError, which the adapter's handlers let through
@example(b" " + nested(100_000))  # the same through json.loads (leading whitespace)
def test_parse_json_raises_only_value_error(data: bytes) -> None:
    with contextlib.suppress(ValueError):
        parse_json(data)


@given(_objects(2))
@example({"choices": [{"message": {"content": "x", "name": 5}}]})
def test_a_whole_answer_translates_or_fails_with_a_caught_error(answer: dict[str, Any]) -> None:
    for translate in (lambda a: chunk_message(as_chunk(a)), completion_message):
        with contextlib.suppress(*CAUGHT):
            translate(answer).SerializeToString()


@given(st.binary(max_size=200), st.booleans())
def test_any_request_message_becomes_a_json_body(raw: bytes, stream: bool) -> None:
    try:
        request = pb.ChatCompletionRequest.FromString(raw)
    except Exception:  # protobuf's DecodeError, which the adapter answers with INVALID_ARGUMENT
        return
    body = json.loads(openai_body(request, stream))
    assert isinstance(body, dict) and isinstance(body["messages"], list)


# -- a pod's whole response, through the adapter ---------------------------------------------------

POD_STREAM = wire_sample(
    "vllm-chat-stream.txt",
    b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
    b'"delta":{"content":" Hello"},"finish_reason":null}]}\n\n'
    b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
    b'"delta":{"content":"."},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n',
)
pod_bodies = st.one_of(
    st.binary(max_size=200),
    mutated(POD_STREAM),
    st.lists(events.map(lambda e: b"data: " + json.dumps(e).encode() + b"\n\n"), max_size=4).map(b"".join),
    st.builds(lambda e: json.dumps({"error": e}).encode(), json_values()),
    _objects(2).map(lambda o: json.dumps(o).encode()),
)


@given(
    st.sampled_from([200, 200, 400, 404, 429, 500, 502, 503]),
    st.sampled_from([b"text/event-stream", b"application/json"]),
    st.booleans(),
    st.booleans(),
    pod_bodies.flatmap(lambda body: st.tuples(st.just(body), splits(body))),
)
@example(200, b"text/event-stream", True, False, (b"", [b'data: {"error": {"message": "\\ud800"}}\n\n']))
@example(500, b"application/json", False, False, (b"", [b'{"error": ' + nested(5000) + b"}"]))  # found by
@example(200, b"application/json", True, False, (b"", [nested(5000)]))  # fuzzing: RecursionError escaped
@example(200, b"text/event-stream", False, False, (b"", [b"data: " + nested(5000) + b"\n\n"]))
def test_any_pod_response_becomes_a_well_formed_grpc_web_answer(
    status: int, content_type: bytes, stream: bool, text: bool, body_pieces: tuple[bytes, list[bytes]]
) -> None:
    _, pieces = body_pieces
    sent: list[dict[str, Any]] = []

    async def client_send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def client_receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    call = Call(stream, text, [], client_receive, client_send, 1 << 20)
    call._mode = "read"  # the relay has read the request (the request side is fuzzed elsewhere)
    run_sync(call.send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", content_type)]}))  # fmt: skip
    for i, piece in enumerate(pieces):
        run_sync(call.send({"type": "http.response.body", "body": piece, "more_body": i < len(pieces) - 1}))

    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert len(starts) == 1 and starts[0]["status"] == 200
    headers = dict(starts[0]["headers"])
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert sent[-1]["type"] == "http.response.body" and not sent[-1].get("more_body", False)
    if b"grpc-status" in headers:  # Trailers-Only
        assert body == b"" and int(headers[b"grpc-status"]) in set(Status)
        return
    frames = codec.decode_frames(codec.decode_text(body) if text else body)
    assert frames and frames[-1].is_trailers and not any(f.is_trailers for f in frames[:-1])
    trailers = codec.parse_trailers(frames[-1].payload)
    assert int(trailers["grpc-status"]) in set(Status)
