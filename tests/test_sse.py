"""The SSE inspection helpers, on the real wire samples in ../shared/wire."""

from pathlib import Path

import pytest

from transports import sse

WIRE = Path(__file__).resolve().parents[2] / "shared" / "wire"
CHAT = (WIRE / "vllm-chat-stream.txt").read_bytes() if WIRE.exists() else None
MIDSTREAM_ERROR = (WIRE / "vllm-midstream-error.txt").read_bytes() if WIRE.exists() else None

ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":" Hi"},"finish_reason":null}]}\n\n'


@pytest.mark.skipif(CHAT is None, reason="shared wire samples not present")
def test_vllm_role_chunk_is_not_a_token_but_the_next_chunk_is() -> None:
    first_event_end = CHAT.index(b"\n\n") + 2
    assert sse.scan_first_token(CHAT[:first_event_end]) == (False, first_event_end)
    found, at = sse.scan_first_token(CHAT)
    assert found
    assert CHAT[first_event_end:at].count(b'" Hello"') == 1


def test_scan_resumes_where_it_stopped_across_split_reads() -> None:
    stream = ROLE + TOKEN
    split = len(ROLE) + 10  # the token event arrives in two reads
    found, pos = sse.scan_first_token(stream[:split])
    assert (found, pos) == (False, len(ROLE))
    assert sse.scan_first_token(stream, pos) == (True, len(stream))


@pytest.mark.parametrize(
    "event",
    [
        b"data: [DONE]\n\n",
        b'data: {"error":{"message":"boom","type":"InternalServerError","param":null,"code":500}}\n\n',
        b'data: {"choices":[{"index":0,"text":" once","finish_reason":null}]}\n\n',
        b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n',
        b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0}]}}]}\n\n',
        b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\r\n\r\n',
    ],
)
def test_events_a_client_would_see_end_the_wait(event: bytes) -> None:
    assert sse.scan_first_token(ROLE + event) == (True, len(ROLE) + len(event))


def test_keepalive_comments_and_role_deltas_do_not_end_the_wait() -> None:
    stream = b": keep-alive\n\n" + ROLE + b": ping\n\n"
    assert sse.scan_first_token(stream) == (False, len(stream))


def test_malformed_payload_is_reported() -> None:
    with pytest.raises(sse.MalformedEvent):
        sse.scan_first_token(ROLE + b'data: {"id":\n\n')
    with pytest.raises(sse.MalformedEvent):
        sse.scan_first_token(b"data: [1, 2]\n\n")


@pytest.mark.skipif(CHAT is None, reason="shared wire samples not present")
def test_usage_is_found_in_the_stream_tail() -> None:
    tail = CHAT[-300:]
    assert sse.find_usage(tail) == {"prompt_tokens": 21, "total_tokens": 23, "completion_tokens": 2}
    assert sse.find_usage(TOKEN + b"data: [DONE]\n\n") is None


@pytest.mark.skipif(MIDSTREAM_ERROR is None, reason="shared wire samples not present")
def test_error_event_framing_matches_vllm() -> None:
    payload = (
        b'{"error":{"message":"Internal server error","type":"InternalServerError","param":null,"code":500}}'
    )
    assert MIDSTREAM_ERROR.endswith(sse.error_event(payload))


# -- end of stream: whole or cut short ----------------------------------------------------------------

FINAL = b'data: {"choices":[{"index":0,"delta":{"content":"."},"finish_reason":"stop"}]}\n\n'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}\n\n'


def _choice_event(index: int, finish: str | None) -> bytes:
    reason = "null" if finish is None else f'"{finish}"'
    return b'data: {"choices":[{"index":%d,"delta":{"content":"x"},"finish_reason":%b}]}\n\n' % (
        index,
        reason.encode(),
    )


@pytest.mark.skipif(CHAT is None, reason="shared wire samples not present")
@pytest.mark.parametrize("size", [14, 40, 300, None])
def test_a_whole_vllm_stream_is_complete_from_any_tail(size: int | None) -> None:
    tail = CHAT if size is None else CHAT[-size:]
    assert sse.stream_incomplete(tail) is None


@pytest.mark.skipif(CHAT is None, reason="shared wire samples not present")
def test_a_vllm_stream_cut_anywhere_before_its_end_is_incomplete() -> None:
    ends = [i for i in range(1, len(CHAT)) if CHAT[:i].endswith(b"\n\n")]
    last_finish = CHAT.index(b'"finish_reason":"stop"')
    for cut in range(1, len(CHAT) - 1):
        tail = CHAT[:cut][-500:]  # the last two reads: at least the last two events
        verdict = sse.stream_incomplete(tail)
        if cut in ends and cut > last_finish:
            assert verdict is None, cut  # finish_reason seen, only the usage/[DONE] missing: whole
        else:
            assert verdict is not None, cut


@pytest.mark.parametrize(
    ("tail", "why"),
    [
        (ROLE + TOKEN + TOKEN, "finish_reason"),
        (TOKEN + b"<html>502 Bad Gateway</html>\n\n", "not a chunk"),
        (TOKEN + b"garbage without a newline", "inside an event"),
        (TOKEN + b'data: {"content":"\xff\xfe"}\n\n', "not a chunk"),
        (TOKEN + b'data: {"error":{"message":"boom"}}\n\n', "not a chunk"),
        (TOKEN + b"data: [DONE]", "inside an event"),
        (b"", "no bytes"),
    ],
)
def test_streams_cut_short_say_why(tail: bytes, why: str) -> None:
    verdict = sse.stream_incomplete(tail)
    assert verdict is not None and why in verdict


@pytest.mark.parametrize(
    "tail",
    [
        TOKEN + b"data: [DONE]\n\n",
        TOKEN + b"data:[DONE]\r\n\r\n",
        TOKEN + FINAL,
        TOKEN + FINAL + USAGE,
        TOKEN + FINAL + b": keep-alive\n\n",
        b'data: {"choices":[{"index":0,"text":" end","finish_reason": "length"}]}\n\n',
    ],
)
def test_streams_that_end_whole(tail: bytes) -> None:
    assert sse.stream_incomplete(tail) is None


def test_every_choice_must_finish_when_n_is_more_than_one() -> None:
    tail = _choice_event(0, "stop") + _choice_event(1, None)
    verdict = sse.stream_incomplete(tail, choices=2)
    assert verdict is not None and "choice(s) 1" in verdict
    assert sse.stream_incomplete(tail + _choice_event(1, "length"), choices=2) is None
    # choice 1 finished long before the tail: known from what went by
    assert sse.stream_incomplete(_choice_event(0, "stop"), choices=2, finished={1}) is None
    assert sse.stream_incomplete(tail + b"data: [DONE]\n\n", choices=2) is None


def test_finished_choices_skips_partial_and_malformed_events() -> None:
    partial = _choice_event(2, "stop")[10:]
    body = partial + _choice_event(1, "length") + b"data: {bad\n\n" + _choice_event(0, None)
    assert sse.finished_choices(body) == {1}
    assert sse.ends_event(TOKEN) and sse.ends_event(b"x\r\n\r\n") and not sse.ends_event(TOKEN[:-1])
