"""The client's sans-IO parts: Alt-Svc parsing and cache, broken-alternative backoff, SSE decoding,
the downgrade header and OpenAI error bodies. No sockets; clocks are injected."""

from __future__ import annotations

import pytest

from transports.altsvc import CLEAR, AltService, AltSvcCache, origin_of, parse_alt_svc, parse_alt_svc_fields
from transports.broken_alternatives import BrokenAlternatives
from transports.client import (
    SSEDecoder,
    SSEvent,
    error_from_body,
    parse_downgrade,
    parse_retry_after,
)

ORIGIN = "https://gw.example:443"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --- Alt-Svc parsing ----------------------------------------------------------------------------


def test_parses_the_usual_forms() -> None:
    assert parse_alt_svc('h3=":443"; ma=86400') == [AltService("h3", "", 443, 86400.0)]
    assert parse_alt_svc('h3=":8443"') == [AltService("h3", "", 8443, 86400.0)]  # ma defaults to 24 h
    assert parse_alt_svc('h3="alt.example:443"; ma=60; persist=1') == [
        AltService("h3", "alt.example", 443, 60.0, persist=True)
    ]


def test_multiple_entries_keep_the_servers_order() -> None:
    parsed = parse_alt_svc('h3=":443"; ma=3600, h3-29=":443"; ma=3600, h2="other.example:8443"')
    assert [(s.protocol, s.host, s.port) for s in parsed] == [
        ("h3", "", 443),
        ("h3-29", "", 443),
        ("h2", "other.example", 8443),
    ]


def test_quoted_authorities_ipv6_and_percent_encoded_protocols() -> None:
    assert parse_alt_svc('h3="[2001:db8::1]:443"') == [AltService("h3", "2001:db8::1", 443)]
    assert parse_alt_svc('http%2F1.1=":80"')[0].protocol == "http/1.1"
    # a comma or a semicolon inside quotes does not split anything
    assert parse_alt_svc('h3=":443"; x="a,b;c", h3=":444"')[1].port == 444
    assert parse_alt_svc('h3=":443" ; ma = 10')[0].max_age == 10.0


def test_clear_and_combined_fields() -> None:
    assert parse_alt_svc("clear") is CLEAR
    assert parse_alt_svc(" clear ") is CLEAR
    assert parse_alt_svc_fields(['h3=":443"', "clear"]) is CLEAR
    assert len(parse_alt_svc_fields(['h3=":443"', 'h3=":444"'])) == 2


@pytest.mark.parametrize(
    "value",
    [
        'h3=":99999"',  # port out of range
        "h3=:443",  # authority not quoted
        'h3="host"',  # no port
        'h3=":443',  # unterminated quote
        '=":443"',  # no protocol
        'h3="[::1:443"',  # unbracketed end
    ],
)
def test_malformed_entries_are_dropped(value: str) -> None:
    assert parse_alt_svc(value) == []


def test_a_malformed_entry_does_not_spoil_its_neighbours() -> None:
    parsed = parse_alt_svc('h3=:1, h3=":443"; ma=5, junk junk, h2=":8443"')
    assert [(s.protocol, s.port) for s in parsed] == [("h3", 443), ("h2", 8443)]
    assert parse_alt_svc('h3=":443"; ma=soon')[0].max_age == 86400.0  # a bad ma is ignored


def test_origin_of() -> None:
    assert origin_of("https://GW.example/v1") == "https://gw.example:443"
    assert origin_of("http://gw.example:8080/") == "http://gw.example:8080"
    assert origin_of("https://[::1]:8443") == "https://[::1]:8443"


# --- the cache ----------------------------------------------------------------------------------


def test_cache_keeps_an_advertisement_for_its_max_age() -> None:
    clock = Clock()
    cache = AltSvcCache(clock)
    cache.update(ORIGIN, ['h3=":8443"; ma=60'])
    service = cache.lookup(ORIGIN, "h3")
    assert service is not None and service.authority("gw.example") == ("gw.example", 8443)
    assert cache.expires_at(ORIGIN, service) == 160.0
    clock.now += 59
    assert cache.lookup(ORIGIN) is not None
    clock.now += 1
    assert cache.lookup(ORIGIN) is None and cache.services(ORIGIN) == []


def test_a_new_advertisement_replaces_the_old_and_clear_forgets() -> None:
    cache = AltSvcCache(Clock())
    cache.update(ORIGIN, ['h3=":8443"'])
    cache.update(ORIGIN, ['h2=":9443"'])
    assert cache.lookup(ORIGIN, "h3") is None and cache.lookup(ORIGIN, "h2") is not None
    cache.update(ORIGIN, ['h3=":8443"'])
    cache.update(ORIGIN, ["clear"])
    assert cache.services(ORIGIN) == []
    cache.update(ORIGIN, [])  # a response without Alt-Svc changes nothing
    cache.update(ORIGIN, ['h3=":8443"'])
    cache.update(ORIGIN, [])
    assert cache.lookup(ORIGIN) is not None
    cache.update(ORIGIN, ['h3=":8443"; ma=0'])  # ma=0: gone at once
    assert cache.lookup(ORIGIN) is None


def test_cache_ignores_cleartext_origins_and_noise() -> None:
    cache = AltSvcCache(Clock())
    cache.update("http://gw.example:80", ['h3=":443"'])
    assert cache.services("http://gw.example:80") == []
    cache.update(ORIGIN, ['h3=":8443"'])
    cache.update(ORIGIN, ["garbage"])  # only malformed entries: keep what we knew
    assert cache.lookup(ORIGIN) is not None


def test_lookup_prefers_the_first_matching_entry() -> None:
    cache = AltSvcCache(Clock())
    cache.update(ORIGIN, ['h3="a.example:1", h3="b.example:2"'])
    assert cache.lookup(ORIGIN).host == "a.example"  # type: ignore[union-attr]


# --- broken alternatives ------------------------------------------------------------------------


def test_broken_mark_backs_off_exponentially_and_success_clears() -> None:
    clock = Clock()
    broken = BrokenAlternatives(clock)
    key = (ORIGIN, "gw.example", 443)
    assert not broken.is_broken(key)
    assert broken.mark_broken(key) == 300
    assert broken.is_broken(key) and broken.broken_until(key) == 400.0
    clock.now += 300
    assert not broken.is_broken(key) and broken.is_recently_broken(key)  # expired, not forgotten
    assert broken.mark_broken(key) == 600
    clock.now += 600
    assert broken.mark_broken(key) == 1200 and broken.failures(key) == 3
    broken.confirm(key)
    assert not broken.is_recently_broken(key) and broken.mark_broken(key) == 300


def test_broken_mark_is_capped_at_two_days() -> None:
    broken = BrokenAlternatives(Clock())
    delays = [broken.mark_broken("k") for _ in range(40)]
    assert delays[:3] == [300, 600, 1200] and max(delays) == 2 * 24 * 3600 and delays[-1] == 2 * 24 * 3600


def test_marks_are_per_key() -> None:
    broken = BrokenAlternatives(Clock())
    broken.mark_broken("a")
    assert broken.is_broken("a") and not broken.is_broken("b")


# --- SSE ----------------------------------------------------------------------------------------


def test_sse_events_split_anywhere_are_reassembled() -> None:
    stream = b'data: {"a":1}\n\n: keep-alive\n\nevent: error\ndata: line1\ndata: line2\n\ndata: [DONE]\n\n'
    for cut in range(len(stream) + 1):
        decoder = SSEDecoder()
        events = decoder.feed(stream[:cut]) + decoder.feed(stream[cut:])
        assert events == [
            SSEvent("message", '{"a":1}'),
            SSEvent("error", "line1\nline2"),
            SSEvent("message", "[DONE]"),
        ], cut


def test_sse_line_endings_and_field_forms() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data:x\r\n\r\ndata: y\r\rdata") == [
        SSEvent("message", "x"),
        SSEvent("message", "y"),
    ]
    assert decoder.feed(b": z\n\n") == [SSEvent("message", "z")]  # the field was "data" all along
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\r") == []  # a CR that may be half a CRLF waits
    assert decoder.feed(b"\n\n") == [SSEvent("message", "a")]
    assert SSEDecoder().feed(b"id: 1\nretry: 5\n\n") == []  # no data: nothing dispatched


# --- downgrade header, Retry-After, error bodies ------------------------------------------------


def test_parse_downgrade() -> None:
    assert parse_downgrade("h1") == ("h1", None)
    assert parse_downgrade("H2; ma=600") == ("h2", 600.0)
    assert parse_downgrade("grpc-web") == ("grpc-web", None)
    assert parse_downgrade("h3") == ("h3", None)
    assert parse_downgrade("h0") is None and parse_downgrade("") is None


def test_parse_retry_after() -> None:
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # a past date: now


def test_error_bodies_become_typed_errors() -> None:
    body = b'{"error": {"message": "no pod", "type": "service_unavailable", "code": "x", "param": null}}'
    err = error_from_body(503, body, 2.0, "h2")
    assert (err.status, err.type, err.code, err.message, err.retry_after) == (
        503,
        "service_unavailable",
        "x",
        "no pod",
        2.0,
    )
    plain = error_from_body(502, b"Bad Gateway", None, "h1")
    assert (plain.status, plain.message, plain.type) == (502, "Bad Gateway", None)
    assert "HTTP 502" in str(plain)
