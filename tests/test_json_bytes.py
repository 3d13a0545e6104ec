"""``transports.json_bytes.loads``: the request path's JSON parse must be ``json.loads`` exactly,
for every input a client or a pod could send, only faster for the usual one."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from transports.json_bytes import loads

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _outcome(parse: Any, data: bytes) -> tuple[str, Any]:
    try:
        return "ok", parse(data)
    except Exception as exc:  # the exception is what is compared
        return type(exc).__name__, str(exc)


@settings(max_examples=300, deadline=None)
@given(
    value=_JSON,
    before=st.sampled_from(["", " ", "\n", "\t\r\n", "\ufeff", "\x0c"]),
    after=st.sampled_from(["", " ", "\n", "\r\n", " x", "}", "\x0b", "\u00a0"]),
    encoding=st.sampled_from(["utf-8", "utf-16", "utf-16-le", "utf-32"]),
)
@example(value={}, before="", after="\x0b", encoding="utf-8")  # space to str.isspace, not to JSON
@example(value=[1], before="", after="\u00a0", encoding="utf-8")
def test_the_same_answer_as_json_loads_for_json_text(
    value: Any, before: str, after: str, encoding: str
) -> None:
    data = (before + json.dumps(value, ensure_ascii=False) + after).encode(encoding, "surrogatepass")
    assert _outcome(loads, data) == _outcome(json.loads, data)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=64))
def test_the_same_answer_or_the_same_error_for_any_bytes(data: bytes) -> None:
    assert _outcome(loads, data) == _outcome(json.loads, data)


def test_a_chunk_and_a_body_parse_as_they_did() -> None:
    chunk = b'{"id":"c1","choices":[{"index":0,"delta":{"content":" hi"},"finish_reason":null}]}'
    assert loads(chunk) == json.loads(chunk)
    assert loads(b'{"model": "m", "stream": true}\n') == {"model": "m", "stream": True}
    assert _outcome(loads, b'{"a": 1} {"b": 2}')[0] == "JSONDecodeError"  # two values: json.loads's error
