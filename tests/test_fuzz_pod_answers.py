"""Property tests of what the gateway reads out of a pod's answers besides the first-token scan: its
error bodies (gateway/pod_errors.py), a whole answer turned into SSE for a degraded stream
(gateway/degrade.py), and the relayed stream read back and spliced for a mid-stream resume
(gateway/resume.py). A pod is a remote party: each returns its documented result (or ValueError where
documented), never another exception in the middle of a client's request."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from gateway.config import PodConfig
from gateway.degrade import as_sse
from gateway.disconnect_watch import DisconnectWatch
from gateway.errors import GatewayError
from gateway.exchange import Exchange
from gateway.metrics import GatewayMetrics
from gateway.pod_errors import pod_error
from gateway.pods.registry import Pod
from gateway.resume import Splicer, Transcript
from gateway.whole_answer import relay_whole
from tests.fuzz_strategies import json_values, mutated, nested, run_sync, splits, wire_sample

KEYS = st.sampled_from([
    "error", "message", "object", "type", "code", "param", "choices", "index", "delta", "content", "text",
    "finish_reason", "usage", "prompt_tokens", "completion_tokens", "created", "id", "role", "tool_calls",
])  # fmt: skip
objects = json_values(KEYS).filter(lambda v: isinstance(v, dict))
STREAM = wire_sample(
    "vllm-chat-stream.txt",
    b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
    b'"delta":{"content":" Hello"},"finish_reason":null}]}\n\n'
    b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[],'
    b'"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}\n\ndata: [DONE]\n\n',
)
streams = st.one_of(
    st.binary(max_size=300),
    mutated(STREAM),
    st.lists(objects.map(lambda o: b"data: " + json.dumps(o).encode() + b"\n\n"), max_size=4).map(b"".join),
)


class _PodAnswer:
    """What pod_error reads of a PodResponse."""

    def __init__(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.status, self.headers, self._body = status, headers, body

    async def read_all(self, limit: int | None = None) -> bytes:
        return self._body[:limit]


@given(
    st.integers(400, 599),
    st.one_of(st.binary(max_size=200), objects.map(lambda o: json.dumps(o).encode())),
    st.dictionaries(st.sampled_from(["retry-after", "x"]), st.text(max_size=5), max_size=2),
)
@example(500, b'{"error": ' + nested(100_000) + b"}", {})  # found by fuzzing: RecursionError escaped
@example(400, b'{"object": "error", "message": "m", "code": [1], "param": {"a": 1}}', {})
def test_any_pod_error_body_becomes_a_gateway_error(
    status: int, body: bytes, headers: dict[str, str]
) -> None:
    error = run_sync(pod_error("p", _PodAnswer(status, body, headers), 1 << 16))  # type: ignore[arg-type]
    assert isinstance(error, GatewayError) and 400 <= error.status <= 599
    assert isinstance(error.body(), bytes) and error.sse_event().endswith(b"data: [DONE]\n\n")


@given(st.one_of(st.binary(max_size=200), objects.map(lambda o: json.dumps(o).encode()),
                 st.builds(lambda c: json.dumps({"object": "chat.completion", "choices": c}).encode(),
                           st.lists(json_values(KEYS), max_size=3))),
       st.booleans())  # fmt: skip
@example(b'{"object": "chat.completion", "choices": [{"message": 5}]}', False)  # found by fuzzing:
@example(b'{"object": "chat.completion", "choices": [{"message": [1]}]}', False)  # AttributeError
@example(nested(100_000), False)  # found by fuzzing: RecursionError, where ValueError is documented
def test_a_whole_answer_becomes_an_sse_stream_or_value_error(answer: bytes, include_usage: bool) -> None:
    try:
        out = as_sse(answer, include_usage)
    except ValueError:
        return
    assert out.endswith(b"data: [DONE]\n\n")
    for event in out.split(b"\n\n")[:-2]:
        assert isinstance(json.loads(event.removeprefix(b"data: ")), dict)


@given(streams)
@example(b'data: {"choices": 5}\n\n')  # found by fuzzing: TypeError
@example(b'data: {"choices": [1]}\n\n')  # found by fuzzing: AttributeError
@example(b'data: {"choices": [{"delta": {"content": [1]}}]}\n\n')  # found by fuzzing: TypeError on +=
@example(b'data: {"choices": [{"text": 7}]}\n\n')
@example(b"data: " + nested(100_000) + b"\n\n")  # found by fuzzing: RecursionError
def test_the_relayed_stream_reads_back_as_a_transcript(relayed: bytes) -> None:
    done = Transcript.read(relayed)
    assert isinstance(done.text, str) and len(done.text) <= len(relayed)
    assert 0 <= done.tokens <= relayed.count(b"\n\n")


@given(streams.flatmap(lambda s: st.tuples(st.just(s), splits(s, max_parts=3))),
       st.none() | st.integers(0, 2**40), st.integers(0, 10**6))  # fmt: skip
@example((b'data: {"created": "x"}\n\n', [b'data: {"created": "x"}\n\n']), 5, 0)  # found by fuzzing:
@example((b'data: {"created": 1.5}\n\n', [b'data: {"created": 1.5}\n\n']), 5, 0)  # %d of a str/float
@example((b"", [b"data: " + nested(100_000) + b"\n\n"]), 5, 0)  # found by fuzzing: RecursionError
@example((b"", [b'data: {"usage": ' + nested(100_000) + b"}\n\n"]), 5, 3)
def test_a_continuation_is_spliced_without_raising(
    stream_pieces: tuple[bytes, list[bytes]], created: int | None, tokens_before: int
) -> None:
    _, pieces = stream_pieces
    splicer = Splicer(created=created, tokens_before=tokens_before)
    out = [splicer.head(pieces[0])] + [splicer.chunk(piece) for piece in pieces[1:]]
    assert all(isinstance(part, bytes) for part in out)


def _usage_after_splice(usage: Any, tokens_before: int) -> Any:
    splicer = Splicer(created=None, tokens_before=tokens_before)
    out = splicer.chunk(b'data: {"choices":[],"usage":' + json.dumps(usage).encode() + b"}\n\n")
    return json.loads(out.split(b"\n\n")[0].removeprefix(b"data: "))["usage"]


@given(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6))
def test_spliced_usage_moves_the_resumed_tokens_from_prompt_to_completion(
    prompt: int, completion: int, before: int
) -> None:
    sent = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    usage = _usage_after_splice(sent, before)
    assert usage["completion_tokens"] == completion + before
    assert usage["prompt_tokens"] == max(0, prompt - before)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def _exchange(degraded: bool | None, sent: list[dict[str, Any]]) -> Exchange:
    """A real Exchange as relay_whole finds it: a pod picked, the client watched, nothing sent yet."""

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:  # a client that stays: its watch waits
        await asyncio.get_running_loop().create_future()
        raise AssertionError("unreachable")

    ex = Exchange("chat", "rid", send)
    ex.deadline = asyncio.get_running_loop().time() + 60
    ex.degraded, ex.model_label = degraded, "m"
    ex.pod = Pod(PodConfig(name="p", url="http://127.0.0.1:1"))
    task = asyncio.current_task()
    assert task is not None
    ex.watch = DisconnectWatch(receive, None, task)
    return ex


@given(
    st.one_of(
        st.binary(max_size=200),
        objects.map(lambda o: json.dumps(o).encode()),
        st.builds(lambda c: json.dumps({"object": "chat.completion", "choices": c}).encode(),
                  st.lists(json_values(KEYS), max_size=3)),
    ),
    st.none() | st.booleans(),
)  # fmt: skip
@example(nested(100_000), None)  # found by fuzzing: RecursionError escaped relay_whole
@example(b'{"choices": [], "usage": {"completion_tokens": ' + b"9" * 400 + b"}}", None)
def test_a_whole_answer_is_sent_as_is_or_refused_with_a_gateway_error(
    body: bytes, degraded: bool | None
) -> None:
    sent_messages: list[dict[str, Any]] = []

    async def relay() -> None:
        ex = _exchange(degraded, sent_messages)
        metrics = GatewayMetrics(CollectorRegistry())
        answer = _PodAnswer(200, body, {})
        await relay_whole(ex, ex.pod, answer, b"application/json", metrics)  # type: ignore[arg-type]

    try:
        asyncio.run(relay())
    except GatewayError as exc:
        assert exc.status in (502, 503)
        return
    start, sent = sent_messages
    assert start["status"] == 200
    if degraded is None:
        assert sent["body"] == body and isinstance(json.loads(body), dict)
    else:
        assert sent["body"].endswith(b"data: [DONE]\n\n")
