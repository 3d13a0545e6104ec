"""Who the client is, when proxies stand in between: ``X-Forwarded-For`` believed only from the
proxies the operator trusts (``server.trusted_proxies``).

Anyone can send ``X-Forwarded-For: 1.2.3.4``; only a hop the operator runs appends honestly. So the
list is read from the right (the hop nearest the gateway) and each entry is believed only while
the hop that added it is trusted: the first untrusted address is the client. Without trusted
proxies the header is ignored and the TCP peer is the client.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection
from functools import lru_cache

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
UNKNOWN = "unknown"  # no peer address at all (a Unix socket)


def parse_address(text: str) -> Address | None:
    """An address from an ``X-Forwarded-For`` entry or a peer, or None when it is not one: bare
    (``10.0.0.1``, ``2001:db8::1``), with a port (``10.0.0.1:5678``, ``[2001:db8::1]:5678``), IPv4
    mapped into IPv6 taken as IPv4. Names and ``unknown`` (RFC 7239 obfuscation) are not addresses."""
    text = text.strip()
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            return None
        text = text[1:end]
    elif text.count(":") == 1:  # IPv4 with a port; IPv6 has two colons at least
        text = text.split(":", 1)[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


class ClientAddress:
    """The client's address for logs and limits, from the peer and ``X-Forwarded-For``."""

    def __init__(self, trusted_proxies: Collection[str]) -> None:
        self.networks = tuple(ipaddress.ip_network(n, strict=False) for n in trusted_proxies)
        # A gateway sees the same few proxies over and over: remember which peers are trusted.
        self._trusted_text = lru_cache(maxsize=4096)(self._trusted_peer)

    def trusted(self, address: Address) -> bool:
        return any(address in network for network in self.networks)

    def _trusted_peer(self, peer: str) -> Address | None:
        address = parse_address(peer)
        return address if address is not None and self.trusted(address) else None

    def of(self, peer: str | None, forwarded_for: bytes | None) -> str:
        """The client's address: ``peer`` (the TCP peer's host), unless it is a trusted proxy that
        passed ``X-Forwarded-For`` (every such header's values joined with ``,``, in order).

        Walking right to left: each trusted hop vouches for the entry to its left; the first
        untrusted entry is the client; an entry that is not an address ends the walk at the last
        trusted hop (what it reported cannot be used); a list of trusted hops only gives its
        leftmost."""
        if peer is None:
            return UNKNOWN
        if not self.networks or not forwarded_for or self._trusted_text(peer) is None:
            return peer
        client = peer
        for entry in reversed(forwarded_for.decode("latin-1").split(",")):
            address = parse_address(entry)
            if address is None:
                return client
            client = str(address)
            if not self.trusted(address):
                return client
        return client
