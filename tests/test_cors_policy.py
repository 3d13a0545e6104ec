"""The OpenAI endpoints' CORS policy: preflights for allowed origins only, what a page may send and
read, and nothing at all for requests that are not from a browser."""

from __future__ import annotations

import pytest

from gateway.config import CorsConfig
from gateway.cors import EXPOSE_HEADERS, CorsPolicy

APP = b"https://app.example.com"
EXTRA = ("x-sluicegate-tier", "x-sluicegate-criticality")


def _policy(*origins: str, max_age_s: int = 600) -> CorsPolicy:
    return CorsPolicy(CorsConfig(allow_origins=origins, max_age_s=max_age_s), EXTRA)


def _values(headers: list[tuple[bytes, bytes]] | tuple[tuple[bytes, bytes], ...], name: bytes) -> list[bytes]:
    return [value for key, value in headers if key == name]


def _one(headers: list[tuple[bytes, bytes]] | tuple[tuple[bytes, bytes], ...], name: bytes) -> bytes:
    values = _values(headers, name)
    assert len(values) == 1, (name, headers)
    return values[0]


def test_a_preflight_from_an_allowed_origin_gets_the_policy() -> None:
    policy = _policy("https://app.example.com", "http://localhost:3000", max_age_s=120)
    status, headers = policy.preflight(APP, b"POST", b"authorization,content-type")
    assert status == 204
    assert _one(headers, b"access-control-allow-origin") == APP
    assert _one(headers, b"vary") == b"Origin"
    assert _one(headers, b"access-control-allow-methods") == b"GET, POST, OPTIONS"
    allowed = _one(headers, b"access-control-allow-headers").split(b", ")
    for name in (b"authorization", b"content-type", b"x-api-key", b"x-request-id", b"x-request-timeout-ms",
                 b"x-sluicegate-tier", b"x-sluicegate-criticality"):
        assert name in allowed
    assert _one(headers, b"access-control-max-age") == b"120"
    assert not _values(headers, b"access-control-allow-credentials")  # never: keys, not cookies
    status, headers = policy.preflight(b"http://localhost:3000", b"POST", None)
    assert status == 204 and _one(headers, b"access-control-allow-origin") == b"http://localhost:3000"


@pytest.mark.parametrize(
    "origin",
    [
        b"https://evil.example.com",
        b"https://app.example.com.evil.com",  # a suffix or prefix is not the origin
        b"http://app.example.com",  # another scheme is another origin
        b"https://app.example.com:8443",  # so is another port
        b"null",  # sandboxed iframes, file:// pages
    ],
)
def test_a_preflight_from_another_origin_is_refused_without_cors_headers(origin: bytes) -> None:
    status, headers = _policy("https://app.example.com").preflight(origin, b"POST", b"authorization")
    assert status == 403
    assert not any(name.startswith(b"access-control-") for name, _ in headers)
    assert _one(headers, b"vary") == b"Origin"


def test_no_origins_configured_refuses_every_preflight() -> None:
    policy = _policy()
    status, headers = policy.preflight(APP, b"POST", None)
    assert status == 403 and not any(name.startswith(b"access-control-") for name, _ in headers)
    assert policy.response_headers(APP) == ()


def test_any_origin_answers_with_a_star() -> None:
    policy = _policy("*")
    for origin in (APP, b"https://other.test", b"null"):
        status, headers = policy.preflight(origin, b"POST", b"authorization")
        assert status == 204 and _one(headers, b"access-control-allow-origin") == b"*"
        assert not _values(headers, b"vary")  # the same answer for every origin
        response = policy.response_headers(origin)
        assert _one(response, b"access-control-allow-origin") == b"*"
        assert _one(response, b"timing-allow-origin") == b"*"


def test_an_options_request_that_is_not_a_preflight_gets_a_plain_answer() -> None:
    status, headers = _policy("*").preflight(None, None, None)
    assert status == 204 and headers == [(b"allow", b"GET, POST, OPTIONS")]


def test_headers_a_page_asks_for_beyond_the_standard_ones_are_granted() -> None:
    """The OpenAI JS SDK sends x-stainless-* headers: a preflight refusing them breaks it."""
    policy = _policy("https://app.example.com")
    asked = b"Authorization, X-Stainless-Lang,x-stainless-os , content-type,,bad header,x-stainless-lang"
    status, headers = policy.preflight(APP, b"POST", asked)
    assert status == 204
    allowed = _one(headers, b"access-control-allow-headers").split(b", ")
    assert allowed.count(b"authorization") == 1 and allowed.count(b"x-stainless-lang") == 1
    assert b"x-stainless-os" in allowed and b"bad header" not in allowed
    assert _values(headers, b"vary") == [b"Origin", b"Access-Control-Request-Headers"]
    # the precomputed answer is not changed by one that asked for more
    _, plain = policy.preflight(APP, b"POST", b"authorization")
    assert b"x-stainless-os" not in _one(plain, b"access-control-allow-headers")


def test_responses_let_an_allowed_page_read_the_rate_limit_headers() -> None:
    policy = _policy("https://app.example.com")
    headers = policy.response_headers(APP)
    assert _one(headers, b"access-control-allow-origin") == APP
    assert _one(headers, b"vary") == b"Origin"
    assert _one(headers, b"timing-allow-origin") == APP
    exposed = _one(headers, b"access-control-expose-headers").split(b", ")
    openai = [f"x-ratelimit-{what}-{unit}".encode() for what in ("limit", "remaining", "reset")
              for unit in ("requests", "tokens")]
    for name in (b"x-request-id", b"retry-after", b"x-sluicegate-pod", *openai):
        assert name in exposed
    assert len(EXPOSE_HEADERS) == len(set(EXPOSE_HEADERS))
    # another origin: nothing a browser would let the page read, but caches still key on Origin
    assert policy.response_headers(b"https://evil.example.com") == ((b"vary", b"Origin"),)


def test_requests_without_an_origin_cost_nothing() -> None:
    policy = _policy("https://app.example.com")
    assert policy.response_headers(None) == ()
    # the hot path hands out the same precomputed tuples, never a new list per request
    assert policy.response_headers(APP) is policy.response_headers(APP)
    assert isinstance(policy.response_headers(APP), tuple)
    assert policy.response_headers(None) is policy.response_headers(None)


def test_configured_origins_match_as_browsers_send_them() -> None:
    policy = _policy("https://App.Example.com")  # as typed by an operator
    assert policy.allows(APP) and not policy.allows(b"https://App.Example.com")
    assert policy.preflight(APP, b"POST", None)[0] == 204
