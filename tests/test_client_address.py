"""The client's address: ``X-Forwarded-For`` is believed only as far as trusted proxies vouch for it,
so a client cannot name itself someone else."""

from __future__ import annotations

import pytest

from gateway.client_address import UNKNOWN, ClientAddress, parse_address

PROXIES = ClientAddress(["10.0.0.0/8", "192.168.1.7", "fd00::/8"])


def test_without_trusted_proxies_the_peer_is_the_client() -> None:
    direct = ClientAddress([])
    assert direct.of("203.0.113.9", b"1.2.3.4") == "203.0.113.9"
    assert direct.of("10.0.0.1", b"1.2.3.4, 10.0.0.2") == "10.0.0.1"
    assert direct.of(None, b"1.2.3.4") == UNKNOWN


@pytest.mark.parametrize(
    ("peer", "forwarded", "client"),
    [
        # one proxy in front
        ("10.1.2.3", b"203.0.113.9", "203.0.113.9"),
        # two proxies of ours: walk past both
        ("10.1.2.3", b"203.0.113.9, 192.168.1.7", "203.0.113.9"),
        ("10.1.2.3", b"203.0.113.9,10.9.9.9", "203.0.113.9"),
        # several headers, joined by the caller
        ("10.1.2.3", b"203.0.113.9, 10.2.2.2,10.3.3.3", "203.0.113.9"),
        # IPv6 and IPv4-mapped addresses
        ("fd00::1", b"2001:db8::7", "2001:db8::7"),
        ("::ffff:10.1.2.3", b"203.0.113.9", "203.0.113.9"),
        ("10.1.2.3", b"::ffff:203.0.113.9", "203.0.113.9"),
        # ports, as some load balancers add them
        ("10.1.2.3", b"203.0.113.9:51234", "203.0.113.9"),
        ("10.1.2.3", b"[2001:db8::7]:443", "2001:db8::7"),
        # only trusted hops all the way: the leftmost is as far as we can see
        ("10.1.2.3", b"10.4.4.4, 10.5.5.5", "10.4.4.4"),
        # no header from a trusted proxy: the proxy itself
        ("10.1.2.3", None, "10.1.2.3"),
        ("10.1.2.3", b"", "10.1.2.3"),
    ],
)
def test_trusted_proxies_are_walked_past(peer: str, forwarded: bytes | None, client: str) -> None:
    assert PROXIES.of(peer, forwarded) == client


@pytest.mark.parametrize(
    ("peer", "forwarded", "client"),
    [
        # a client that is not a proxy names someone else: ignored
        ("203.0.113.9", b"1.2.3.4", "203.0.113.9"),
        ("203.0.113.9", b"10.0.0.1", "203.0.113.9"),  # not even "I am your proxy"
        # a client behind our proxy prepends a forged hop: our proxy appended the real one
        ("10.1.2.3", b"1.2.3.4, 203.0.113.9", "203.0.113.9"),
        # ... or forges a trusted-looking hop before its own: the walk stops at its real address
        ("10.1.2.3", b"10.6.6.6, 203.0.113.9", "203.0.113.9"),
        # ... or a trusted-looking hop and then garbage: the walk stops before believing more
        ("10.1.2.3", b"1.2.3.4, 10.7.7.7, not-an-ip", "10.1.2.3"),
        ("10.1.2.3", b"1.2.3.4, garbage, 10.7.7.7", "10.7.7.7"),
        ("10.1.2.3", b"1.2.3.4,,10.7.7.7", "10.7.7.7"),
        ("10.1.2.3", b"unknown", "10.1.2.3"),  # RFC 7239 obfuscation
        ("10.1.2.3", b"evil.example.com", "10.1.2.3"),
        ("10.1.2.3", b"[2001:db8::7", "10.1.2.3"),
        ("10.1.2.3", b"1.2.3.4\xff", "10.1.2.3"),
        ("10.1.2.3", b"10.0.0.0/8", "10.1.2.3"),
    ],
)
def test_forwarded_addresses_cannot_be_spoofed(peer: str, forwarded: bytes, client: str) -> None:
    assert PROXIES.of(peer, forwarded) == client


def test_a_peer_that_is_not_an_address_is_not_trusted() -> None:
    assert PROXIES.of("unix-socket", b"1.2.3.4") == "unix-socket"
    assert PROXIES.of(None, b"1.2.3.4") == UNKNOWN


def test_addresses_are_parsed_in_the_forms_proxies_write_them() -> None:
    assert str(parse_address(" 10.0.0.1 ")) == "10.0.0.1"
    assert str(parse_address("[fd00::1]:80")) == "fd00::1"
    assert str(parse_address("::ffff:1.2.3.4")) == "1.2.3.4"
    assert parse_address("1.2.3.4:80:90") is None and parse_address("") is None
    assert parse_address("_hidden") is None
