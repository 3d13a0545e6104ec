"""Alt-Svc (RFC 7838): parse the header and remember each origin's advertised alternatives.

Sans-IO and clock-injectable, so the client's "is there an HTTP/3 alternative for this origin?"
question is answered without sockets and tested without waiting. The client feeds every response's
``Alt-Svc`` values to ``AltSvcCache.update``; a new advertisement replaces the origin's old ones,
``clear`` forgets them, and each entry lives for its ``ma`` seconds (default 24 h).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

DEFAULT_MAX_AGE = 86400.0  # RFC 7838 section 3.1: "ma" defaults to 24 hours
_TCHAR = set("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class AltService:
    """One advertised alternative: ``protocol`` (ALPN id, e.g. ``h3``) at ``host``:``port``.

    ``host`` is empty when the advertisement named only a port (the origin's own host).
    """

    protocol: str
    host: str
    port: int
    max_age: float = DEFAULT_MAX_AGE
    persist: bool = False

    def authority(self, origin_host: str) -> tuple[str, int]:
        """Where to connect for an origin whose host is ``origin_host``."""
        return (self.host or origin_host, self.port)


class Clear:
    """The ``Alt-Svc: clear`` directive: forget every alternative of the origin."""

    def __repr__(self) -> str:
        return "CLEAR"


CLEAR = Clear()


class _Scanner:
    """A cursor over one header value, for the few token kinds the grammar uses."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def skip_ws(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in " \t":
            self.pos += 1

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def token(self) -> str:
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] in _TCHAR:
            self.pos += 1
        return self.text[start : self.pos]

    def quoted(self) -> str | None:
        """A quoted-string's content (backslash escapes undone), or None when unterminated."""
        if self.peek() != '"':
            return None
        self.pos += 1
        out = []
        while self.pos < len(self.text):
            ch = self.text[self.pos]
            self.pos += 1
            if ch == "\\" and self.pos < len(self.text):
                out.append(self.text[self.pos])
                self.pos += 1
            elif ch == '"':
                return "".join(out)
            else:
                out.append(ch)
        return None

    def value(self) -> str | None:
        return self.quoted() if self.peek() == '"' else self.token()

    def skip_to_next_entry(self) -> None:
        """Resynchronise after a malformed entry: skip to the comma that ends it (outside quotes)."""
        while self.pos < len(self.text):
            ch = self.peek()
            if ch == '"':
                if self.quoted() is None:
                    self.pos = len(self.text)
            elif ch == ",":
                return
            else:
                self.pos += 1


def _parse_authority(text: str) -> tuple[str, int] | None:
    """``[host]:port`` with an optional bracketed IPv6 literal; None when malformed."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    if host.startswith("["):
        if not host.endswith("]"):
            return None
        host = host[1:-1]
    elif ":" in host or any(c in host for c in " /[]@"):
        return None
    return host.lower(), int(port)


def _parse_entry(sc: _Scanner) -> AltService | None:
    protocol = sc.token()
    sc.skip_ws()
    if not protocol or sc.peek() != "=":
        return None
    sc.pos += 1
    sc.skip_ws()
    raw = sc.quoted()
    if raw is None:
        return None
    authority = _parse_authority(raw)
    if authority is None:
        return None
    max_age, persist = DEFAULT_MAX_AGE, False
    while True:
        sc.skip_ws()
        if sc.peek() != ";":
            break
        sc.pos += 1
        sc.skip_ws()
        name = sc.token().lower()
        sc.skip_ws()
        if sc.peek() != "=":
            if name:
                continue  # a parameter without a value: ignore it, keep the entry
            return None
        sc.pos += 1
        sc.skip_ws()
        value = sc.value()
        if value is None:
            return None
        if name == "ma" and value.isdigit():
            max_age = float(int(value))
        elif name == "persist":
            persist = value == "1"
    return AltService(unquote(protocol), authority[0], authority[1], max_age, persist)


def parse_alt_svc(value: str) -> list[AltService] | Clear:
    """Parse one ``Alt-Svc`` field value; malformed entries are dropped, the rest kept in order.

    The order is the server's preference order (RFC 7838 section 3).
    """
    if value.strip() == "clear":
        return CLEAR
    sc = _Scanner(value)
    services: list[AltService] = []
    while sc.pos < len(sc.text):
        sc.skip_ws()
        if sc.peek() == ",":
            sc.pos += 1
            continue
        entry = _parse_entry(sc)
        if entry is not None:
            sc.skip_ws()
            if sc.peek() in (",", ""):
                services.append(entry)
                continue
        sc.skip_to_next_entry()
    return services


def parse_alt_svc_fields(values: Iterable[str]) -> list[AltService] | Clear:
    """Several ``Alt-Svc`` header lines of one response, combined; any ``clear`` wins."""
    services: list[AltService] = []
    for value in values:
        parsed = parse_alt_svc(value)
        if isinstance(parsed, Clear):
            return CLEAR
        services.extend(parsed)
    return services


def origin_of(url: str) -> str:
    """The RFC 6454 origin ``scheme://host:port`` of a URL, with the default port made explicit."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    port = parts.port or _DEFAULT_PORTS.get(scheme, 0)
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


@dataclass
class _Entry:
    service: AltService
    expires_at: float


class AltSvcCache:
    """Per-origin alternatives from Alt-Svc, with ``ma`` expiry on an injectable clock.

    Only secure (https) origins are remembered: an h3 alternative must be authenticated for the
    origin, and an advertisement over cleartext could be forged by anyone on the path.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._entries: dict[str, list[_Entry]] = {}

    def update(self, origin: str, values: Iterable[str]) -> None:
        """Apply a response's ``Alt-Svc`` values (nothing happens when there were none)."""
        values = list(values)
        if not values or not origin.startswith("https://"):
            return
        parsed = parse_alt_svc_fields(values)
        if isinstance(parsed, Clear):
            self._entries.pop(origin, None)
            return
        now = self._clock()
        kept = [_Entry(s, now + s.max_age) for s in parsed if s.max_age > 0]
        if kept:
            self._entries[origin] = kept
        elif parsed == []:
            return  # only malformed entries: keep what we had rather than act on noise
        else:
            self._entries.pop(origin, None)  # everything advertised with ma=0

    def clear(self, origin: str) -> None:
        """Forget the origin's alternatives."""
        self._entries.pop(origin, None)

    def services(self, origin: str) -> list[AltService]:
        """The origin's unexpired alternatives, most preferred first."""
        entries = self._entries.get(origin)
        if not entries:
            return []
        now = self._clock()
        live = [e for e in entries if e.expires_at > now]
        if len(live) != len(entries):
            if live:
                self._entries[origin] = live
            else:
                del self._entries[origin]
        return [e.service for e in live]

    def lookup(self, origin: str, protocol: str = "h3") -> AltService | None:
        """The most preferred unexpired alternative speaking ``protocol``, if any."""
        for service in self.services(origin):
            if service.protocol == protocol:
                return service
        return None

    def expires_at(self, origin: str, service: AltService) -> float | None:
        """When ``service`` stops being valid for ``origin`` (clock units), or None if unknown."""
        for entry in self._entries.get(origin, ()):
            if entry.service == service:
                return entry.expires_at
        return None
