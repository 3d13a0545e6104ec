"""HTTP/2 and HTTP/3 response headers (``transports.asgi_stream.response_headers``): the one-pass
check of the usual start gives exactly what the per-header check gives, and refuses what it refuses."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from transports.asgi_stream import _checked_headers, response_headers

_NAMES = st.sampled_from([
    b"content-type", b"x-request-id", b"x-ratelimit-remaining-tokens", b"connection", b"transfer-encoding",
    b"X-Request-Id", b"Cache-Control", b"bad name", b"bad:name", b"", b"caf\xc3\xa9", b"x-\x00",
])
_VALUES = st.binary(max_size=12) | st.sampled_from([b"text/event-stream", b" padded\t", b"\t", b" "])


def _outcome(build: Any, message: dict[str, Any]) -> Any:
    try:
        return build(message)
    except RuntimeError as exc:
        return ("refused", str(exc))


@settings(max_examples=400, deadline=None)
@given(headers=st.lists(st.tuples(_NAMES, _VALUES), max_size=8), status=st.sampled_from([200, 404, 503]))
@example(headers=[(b"x-request-id", b"a\r\nset-cookie: x")], status=200)
@example(headers=[(b"X-Request-Id", b"r1")], status=200)
def test_the_one_pass_check_is_the_per_header_check(headers: list[tuple[bytes, bytes]], status: int) -> None:
    message = {"type": "http.response.start", "status": status, "headers": headers}
    assert _outcome(response_headers, message) == _outcome(_checked_headers, message)


def test_a_value_that_would_split_the_block_is_refused() -> None:
    message = {"type": "http.response.start", "status": 200, "headers": [(b"x-request-id", b"a\nb")]}
    with pytest.raises(RuntimeError, match="invalid HTTP response header"):
        response_headers(message)


def test_the_usual_start_comes_out_lower_case_trimmed_and_without_hop_by_hop_fields() -> None:
    message = {"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", b"text/event-stream"), (b"connection", b"keep-alive"), (b"x-pod", b" p1 "),
    ]}
    assert response_headers(message) == [
        (b":status", b"200"), (b"content-type", b"text/event-stream"), (b"x-pod", b"p1"),
    ]
