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
