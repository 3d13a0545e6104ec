"""Property tests of request admission: whatever a client sends as a body, headers or JSON, the gateway
answers with its own OpenAI-form error (GatewayError 400, or 413 for size), never a 500 from an
exception it did not expect. Sans-IO: the ASGI ``receive`` is a plain async function fed from a list."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from gateway.admit import ClientGone, InferenceRequest, parse_request, read_body, request_id
from gateway.config import Config
from gateway.errors import GatewayError
from gateway.request_head import HeadReader
from tests.fuzz_strategies import json_values, nested, peak_bytes, run_sync, splits

_READER = HeadReader(Config())

ROUTES = st.sampled_from(["chat", "completions"])
FIELDS = st.sampled_from(["model", "messages", "prompt", "stream", "max_tokens", "error", ""])


def _receiver(messages: list[dict[str, Any]]) -> Any:
    feed = iter(messages)

    async def receive() -> dict[str, Any]:
        return next(feed)

    return receive


def _body_messages(pieces: list[bytes]) -> list[dict[str, Any]]:
    return [
        {"type": "http.request", "body": piece, "more_body": i < len(pieces) - 1}
        for i, piece in enumerate(pieces)
    ]


def _declared(content_length: bytes | None) -> int:
    try:
        return int(content_length or b"")
    except ValueError:
        return -1


def _admit(route: str, body: bytes) -> InferenceRequest | GatewayError:
    try:
        return parse_request(route, body)
    except GatewayError as exc:
        return exc


@given(ROUTES, st.binary(max_size=300))
@example("chat", nested(100_000))  # found by fuzzing: json.loads raised RecursionError (a 500)
@example("chat", b'{"model": "m", "messages": ' + nested(5000, b"[{\"a\":", b"}]") + b"}")
@example("completions", b"1" * 5000)  # over Python's int-digits limit: a ValueError, not JSON's own
@example("chat", b"\xef\xbb\xbf{}")  # a UTF-8 BOM
@example("chat", b"\xff\xfe{\x00}\x00")  # UTF-16
def test_any_bytes_are_admitted_or_refused_with_a_400(route: str, body: bytes) -> None:
    outcome = _admit(route, body)
    if isinstance(outcome, GatewayError):
        assert outcome.status == 400
        assert json.loads(outcome.body())["error"]["type"] == "invalid_request_error"
    else:
        assert outcome.body is body and isinstance(outcome.model, str) and outcome.model


@given(ROUTES, json_values(keys=FIELDS | st.text(max_size=8)))
def test_any_json_shape_is_admitted_or_refused_with_a_400(route: str, value: Any) -> None:
    body = json.dumps(value).encode()
    outcome = _admit(route, body)
    if isinstance(outcome, GatewayError):
        assert outcome.status == 400
        return
    # admitted: exactly the shape routing relies on
    assert isinstance(value, dict) and outcome.payload == json.loads(body)
    assert isinstance(outcome.model, str) and outcome.model and isinstance(outcome.stream, bool)
    if route == "chat":
        assert isinstance(value["messages"], list) and value["messages"]
    else:
        assert value["prompt"] is not None


@given(
    ROUTES,
    st.fixed_dictionaries(
        {"model": json_values()},
        optional={"messages": json_values(), "prompt": json_values(), "stream": json_values()},
    ),
)
def test_requests_near_valid_are_sorted_by_their_fields(route: str, payload: dict[str, Any]) -> None:
    outcome = _admit(route, json.dumps(payload).encode())
    required = payload.get("messages") if route == "chat" else payload.get("prompt")
    valid = (
        isinstance(payload["model"], str)
        and payload["model"] != ""
        and (isinstance(required, list) and bool(required) if route == "chat" else required is not None)
        and (payload.get("stream") is None or isinstance(payload.get("stream"), bool))
    )
    assert isinstance(outcome, InferenceRequest) == valid
    if not valid:
        assert isinstance(outcome, GatewayError) and outcome.status == 400


@given(
    st.binary(max_size=600).flatmap(lambda body: st.tuples(st.just(body), splits(body))),
    st.integers(1, 400),
    st.one_of(st.none(), st.binary(max_size=12), st.integers(-5, 10**6).map(lambda n: b"%d" % n)),
    st.booleans(),
)
@example((b"abc", [b"abc"]), 10, b"1_0", False)  # int() takes underscores; still a number
@example((b"abc", [b"abc"]), 10, b"9" * 5000, False)  # past int()'s digit limit
@example((b"abc", [b"abc"]), 10, b"\xff", False)
def test_read_body_returns_the_body_or_refuses_it(
    body_pieces: tuple[bytes, list[bytes]], limit: int, content_length: bytes | None, hang_up: bool
) -> None:
    body, pieces = body_pieces
    messages = _body_messages(pieces)
    if hang_up:
        messages = [*messages[:-1], {"type": "http.disconnect"}]
    try:
        got = run_sync(read_body(_receiver(messages), content_length, limit))
    except GatewayError as exc:
        assert exc.status in (400, 413)
        if exc.status == 413:
            assert len(body) > limit or _declared(content_length) > limit
        return
    except ClientGone:
        assert hang_up
        return
    assert got == body and len(got) <= limit and not hang_up


def test_read_body_memory_stays_near_the_limit_when_a_client_streams_far_past_it() -> None:
    """A client that never stops sending is cut off once it passes the limit, not buffered whole."""
    limit, chunk = 256 * 1024, b"x" * 65536
    sent = 0

    async def receive() -> dict[str, Any]:
        nonlocal sent
        sent += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": sent < 64 * 1024 * 1024}

    result, peak = peak_bytes(lambda: run_sync(read_body(receive, None, limit)))
    assert isinstance(result, GatewayError) and result.status == 413
    assert sent <= limit + len(chunk)
    assert peak < 2 * limit


@given(st.lists(st.tuples(st.sampled_from([b"x-request-id", b"host"]) | st.binary(max_size=10),
                          st.binary(max_size=200) | st.text(max_size=130).map(str.encode)), max_size=4))
@example([(b"x-request-id", b"\xe9t\xe9")])
@example([(b"x-request-id", b"a\x00b")])
def test_request_id_is_always_a_short_printable_string(headers: list[tuple[bytes, bytes]]) -> None:
    rid = request_id(_READER.read(headers).request_id)
    assert isinstance(rid, str) and 0 < len(rid) <= 128 and rid.isprintable() and rid.isascii()
