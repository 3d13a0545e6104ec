"""The request headers the gateway acts on, read in one pass.

Before this, five modules (request id, tier, criticality, timeout, affinity) each scanned the whole
header list; now the relay reads it once into a ``RequestHead`` and every phase takes what it needs
from there. Which names matter is decided once per process (``HeadReader``), partly by config (the
tier, criticality and affinity header names).
"""

from __future__ import annotations

from gateway.config import Config

Headers = list[tuple[bytes, bytes]]

_FIELDS = (
    "api_key",
    "content_length",
    "content_type",
    "criticality",
    "forwarded_for",
    "origin",
    "request_id",
    "tier",
    "timeout_ms",
    "affinity",
    "traceparent",
    "tracestate",
)


class RequestHead:
    """One request's headers of interest (raw bytes; None when absent) and the whole list."""

    __slots__ = ("headers", *_FIELDS)

    def __init__(self, headers: Headers) -> None:
        self.headers = headers
        self.api_key: bytes | None = None  # Authorization: Bearer KEY, else x-api-key
        self.content_length: bytes | None = None
        self.content_type: bytes | None = None
        self.criticality: bytes | None = None
        self.forwarded_for: bytes | None = None  # every X-Forwarded-For line, comma-joined
        self.origin: bytes | None = None
        self.request_id: bytes | None = None
        self.tier: bytes | None = None
        self.timeout_ms: bytes | None = None
        self.affinity: bytes | None = None  # the affinity header's value (affinity key header:NAME)
        self.traceparent: bytes | None = None  # W3C trace context: read only with tracing on
        self.tracestate: bytes | None = None


class HeadReader:
    """Reads ``RequestHead``s: one dict lookup per header line, whatever the number of fields."""

    def __init__(self, config: Config) -> None:
        names = {
            b"x-api-key": "api_key",
            b"content-length": "content_length",
            b"content-type": "content_type",
            config.shedding.criticality_header.encode(): "criticality",
            b"x-forwarded-for": "forwarded_for",
            b"origin": "origin",
            b"x-request-id": "request_id",
            config.tier_header.encode(): "tier",
            b"x-request-timeout-ms": "timeout_ms",
        }
        affinity = config.affinity
        if affinity is not None and affinity.key.startswith("header:"):
            names[affinity.key.removeprefix("header:").encode()] = "affinity"
        if config.tracing.enabled:  # off, a caller's traceparent goes on to the pod untouched
            names[b"traceparent"] = "traceparent"
            names[b"tracestate"] = "tracestate"
        self._names = names

    def read(self, headers: Headers) -> RequestHead:
        head = RequestHead(headers)
        names = self._names
        for name, value in headers:
            if name == b"authorization":
                if value[:7].lower() == b"bearer ":
                    head.api_key = value[7:].strip()
                continue
            field = names.get(name)
            if field is None:
                continue
            if field == "api_key":
                if head.api_key is None:  # Authorization wins when both are sent
                    head.api_key = value.strip()
            elif field == "forwarded_for":
                previous = head.forwarded_for
                head.forwarded_for = value if previous is None else previous + b"," + value
            elif getattr(head, field) is None:  # the first of a repeated header counts
                setattr(head, field, value)
        return head
