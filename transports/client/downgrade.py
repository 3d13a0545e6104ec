"""How a server tells the client to use a lesser transport, read off headers and errors.

The negotiation acts on these signals (see SluicegateClient); this module only recognises them:
the gateway's ``x-sluicegate-downgrade`` header, and HTTP/2's ``HTTP_1_1_REQUIRED`` buried in an
httpx error. (HTTP/3's ``H3_VERSION_FALLBACK`` arrives typed, as transports/h3_client.py's
``H3StreamReset``.)
"""

from __future__ import annotations

DOWNGRADE_HEADER = "x-sluicegate-downgrade"
HTTP_1_1_REQUIRED = 0xD  # RFC 9113 section 7


def parse_downgrade(value: str) -> tuple[str, float | None] | None:
    """``x-sluicegate-downgrade: h2 | h1 | h3 | grpc-web [; ma=<seconds>]`` -> (level, ttl or None)."""
    head, *params = [part.strip() for part in value.split(";")]
    level = head.lower()
    if level not in ("h3", "h2", "h1", "grpc-web"):
        return None
    ttl: float | None = None
    for param in params:
        name, _, raw = param.partition("=")
        if name.strip().lower() == "ma" and raw.strip().isdigit():
            ttl = float(raw.strip())
    return level, ttl


def h2_error_code(exc: BaseException) -> int | None:
    """The HTTP/2 error code inside an httpx/httpcore protocol error (RST_STREAM or GOAWAY)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for arg in current.args:
            code = getattr(arg, "error_code", None)
            if code is not None:
                return int(code)
        current = current.__cause__ or current.__context__
    return None
