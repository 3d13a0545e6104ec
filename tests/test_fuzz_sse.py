"""Property tests of the SSE helpers that look at a pod's output (transports/sse.py).

A pod is a remote party: whatever it streams, ``scan_first_token`` either answers or raises the
documented ``MalformedEvent``, and answers the same however the bytes were split on the way;
``find_usage`` never raises; ``event_data`` never returns more than it was given."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from gateway.metrics import GatewayMetrics
from tests.exchanges import exchange
from tests.fuzz_strategies import json_values, mutated, nested, peak_bytes, splits, wire_sample
from transports.sse import (
    MalformedEvent,
    event_data,
    find_usage,
    finished_choices,
    scan_first_token,
    stream_incomplete,
)

STREAM = wire_sample(
    "vllm-chat-stream.txt",
    b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
    b'data: {"choices":[{"index":0,"delta":{"content":" Hello"},"finish_reason":null}]}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n'
    b"data: [DONE]\n\n",
)
ERROR_STREAM = wire_sample(
    "vllm-midstream-error.txt",
    b'data: {"error":{"message":"Internal server error","type":"InternalServerError","code":500}}\n\n'
    b"data: [DONE]\n\n",
)

CHOICE_KEYS = st.sampled_from(["delta", "text", "finish_reason", "content", "tool_calls", "index", "role"])


def _event(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


# pods' chunks with every field the scanner reads given arbitrary JSON
odd_chunks = st.one_of(
    st.builds(lambda c: {"choices": c}, json_values(CHOICE_KEYS)),
    st.builds(lambda c: {"choices": [c]}, json_values(CHOICE_KEYS)),
    st.builds(lambda d: {"choices": [{"delta": d}]}, json_values(CHOICE_KEYS)),
    st.builds(lambda e: {"error": e}, json_values()),
    json_values(CHOICE_KEYS),
)
sse_bytes = st.one_of(
    st.binary(max_size=400),
    mutated(STREAM),
    mutated(ERROR_STREAM),
    st.lists(odd_chunks.map(_event), max_size=5).map(b"".join),
    st.lists(st.sampled_from([b"data: ", b"data:", b": ping", b"\n", b"\r\n", b"[DONE]", b"{}", b"event: x"]),
             max_size=30).map(b"".join),
)


def _scan_whole(buf: bytes) -> tuple[bool, int] | type[MalformedEvent]:
    try:
        found, pos = scan_first_token(buf)
    except MalformedEvent:
        return MalformedEvent
    assert 0 <= pos <= len(buf)
    return found, pos


def _scan_split(pieces: list[bytes]) -> tuple[bool, int] | type[MalformedEvent]:
    """As the relay does: append each read and scan on from where the last scan stopped."""
    head, pos = b"", 0
    try:
        for piece in pieces:
            head += piece
            found, pos = scan_first_token(head, pos)
            if found:
                return True, pos
    except MalformedEvent:
        return MalformedEvent
    return False, pos


@given(sse_bytes)
@example(_event({"choices": 5}))  # found by fuzzing: TypeError, 'int' object is not iterable
@example(_event({"choices": True}))
@example(b"data: " + nested(100_000) + b"\n\n")  # found by fuzzing: RecursionError from json.loads
@example(b"data: \xff\xfe\n\n")
@example(b"data: 1" + b"0" * 5000 + b"\n\n")  # past Python's int-digits limit
def test_scan_first_token_answers_or_raises_malformed_event(buf: bytes) -> None:
    _scan_whole(buf)


@given(sse_bytes.flatmap(lambda buf: st.tuples(st.just(buf), splits(buf))))
def test_scan_first_token_gives_the_same_answer_however_the_stream_is_split(
    buf_pieces: tuple[bytes, list[bytes]],
) -> None:
    buf, pieces = buf_pieces
    whole = _scan_whole(buf)
    split = _scan_split(pieces)
    if whole is MalformedEvent or split is MalformedEvent:
        assert whole == split
    elif whole[0]:
        assert split == whole
    else:
        assert split == (False, whole[1])


@given(sse_bytes)
@example(b'data: {"usage": ' + nested(100_000) + b"}\n\n")  # found by fuzzing: RecursionError
@example(b'data: {"usage": 1' + b"0" * 5000 + b"}\n\n")
@example(b'data: ["usage"]\n\n')
def test_find_usage_never_raises(tail: bytes) -> None:
    usage = find_usage(tail)
    assert usage is None or isinstance(usage, dict)


@given(st.binary(max_size=300))
def test_event_data_is_never_longer_than_the_event(event: bytes) -> None:
    data = event_data(event)
    assert data is None or len(data) <= len(event)


@pytest.mark.parametrize("ending", [b"\n\n", b"\r\n\r\n"])
@pytest.mark.timeout(60)
def test_a_flood_of_keepalives_is_scanned_in_one_pass_with_little_memory(ending: bytes) -> None:
    """A pod that sends 128 Ki comments and never a token. Found by fuzzing: with only one kind of
    blank line in the buffer, the search for the other kind rescanned the rest of the buffer for
    every event, a quadratic scan that held the event loop for minutes; now one pass, no copies."""
    buf = b": ping" * 4 + ending
    buf *= 1 << 17
    result, peak = peak_bytes(lambda: scan_first_token(buf))
    assert result == (False, len(buf))
    assert peak < 64 * 1024


def test_scanning_one_huge_event_allocates_about_its_size() -> None:
    data = b'data: {"choices":[{"delta":{"content":"' + b"x" * (4 << 20) + b'"}}]}\n\n'
    result, peak = peak_bytes(lambda: scan_first_token(data))
    assert result == (True, len(data))
    assert peak < 6 * len(data)


# -- end of stream: was the answer whole? ------------------------------------------------------------


@given(sse_bytes)
@example(_event({"choices": 5, "finish_reason": "stop"}))  # found by fuzzing: TypeError from _finished
@example(b"data: " + nested(100_000) + b' "finish_reason"\n\n')  # found by fuzzing: RecursionError
@example(_event({"choices": [{"finish_reason": "stop", "index": True}, {"finish_reason": 0, "index": -3}]}))
def test_finished_choices_is_a_set_of_indices(buf: bytes) -> None:
    done = finished_choices(buf)
    assert all(isinstance(i, int) for i in done)
    assert len(done) <= buf.count(b"finish_reason")


@given(sse_bytes, st.integers(1, 2**40), st.frozensets(st.integers(-2, 2**40), max_size=5))
@example(_event({"choices": 5}), 1, frozenset())  # found by fuzzing: TypeError from _finished
@example(b"data: " + nested(100_000) + b"\n\n", 1, frozenset())  # found by fuzzing: RecursionError
@example(_event({"choices": []}), 10**12, frozenset())  # found by fuzzing: listed every missing choice of n
@example(b"data:\x00\ndata: [DONE]\n\n", 1, frozenset())  # one event whose data is not [DONE]
def test_stream_incomplete_says_why_or_none(tail: bytes, choices: int, finished: frozenset[int]) -> None:
    why = stream_incomplete(tail, choices, finished)
    assert why is None or (isinstance(why, str) and len(why) < 300)
    if tail.endswith(b"\n\ndata: [DONE]\n\n") or tail == b"data: [DONE]\n\n":  # [DONE] as its own event
        assert why is None


@given(sse_bytes.flatmap(lambda buf: st.tuples(st.just(buf), splits(buf, max_parts=1))))
def test_stream_incomplete_ending_on_done_is_whole_whatever_came_before(
    buf_pieces: tuple[bytes, list[bytes]],
) -> None:
    _, (head, *_) = buf_pieces
    assert stream_incomplete(head + b"\n\ndata: [DONE]\n\n") is None


# -- what the relay does with the usage a pod reports ------------------------------------------------

token_counts = st.one_of(
    st.integers(-5, 10**6), st.integers(2**53, 10**400), st.booleans(), st.floats(), st.none(),
    st.text(max_size=3),
)


@given(st.fixed_dictionaries({}, optional={"prompt_tokens": token_counts, "completion_tokens": token_counts}))
@example({"completion_tokens": 10**400})  # found by fuzzing: Counter.inc raised OverflowError at the end of
@example({"prompt_tokens": 2**1024})  # a stream, in the relay's accounting
@example({"prompt_tokens": float("nan"), "completion_tokens": True})
def test_any_reported_usage_is_counted_or_ignored(usage: dict[str, Any]) -> None:
    metrics = GatewayMetrics(CollectorRegistry())
    tail = b'data: {"choices":[],"usage":' + json.dumps(usage).encode() + b"}\n\ndata: [DONE]\n\n"
    found = find_usage(tail)
    assert json.dumps(found) == json.dumps(usage)  # (NaN != NaN)
    exchange(model_label="m").count_tokens(metrics, found)
    for kind in ("prompt", "completion"):
        value = usage.get(f"{kind}_tokens")
        counted = metrics.registry.get_sample_value("sluicegate_tokens_total", {"model": "m", "kind": kind})
        if type(value) is int and 0 < value < 2**53:
            assert counted == value
        else:
            assert not counted
