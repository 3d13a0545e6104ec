"""The client's exceptions, and how an error answer becomes one.

Every transport (SSE over h1/h2/h3, gRPC-Web) reports a server's error the same way, as
``SluicegateError`` built from the OpenAI error body and ``Retry-After``; ``SluicegateTransportError``
is the other kind of failure: nothing could carry the request.
"""

from __future__ import annotations

import email.utils
import json
import time
from collections.abc import Sequence
from typing import Any


class SluicegateError(Exception):
    """An error answer (OpenAI error form) from the gateway or a pod: HTTP status or in-stream.

    ``status`` is the HTTP status (for an in-stream error, the error's numeric ``code`` if it has
    one); ``retry_after`` is in seconds when the server sent ``Retry-After``.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        type: str | None = None,
        code: str | int | None = None,
        param: str | None = None,
        retry_after: float | None = None,
        transport: str | None = None,
        in_stream: bool = False,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.code = code
        self.param = param
        self.retry_after = retry_after
        self.transport = transport
        self.in_stream = in_stream

    def __str__(self) -> str:
        where = "in stream" if self.in_stream else f"HTTP {self.status}"
        return f"{where} [{self.type or '?'}/{self.code or '?'}] {self.message}"


class SluicegateTransportError(ConnectionError):
    """No transport could carry the request; ``attempts`` says what was tried and how it failed."""

    def __init__(self, message: str, attempts: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.attempts = list(attempts)


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` value (delta-seconds or an HTTP date); None if absent/bad."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def error_from_payload(
    payload: Any, *, status: int | None, retry_after: float | None, transport: str | None, in_stream: bool
) -> SluicegateError:
    """A typed error from an OpenAI error object ``{"error": {...}}`` (or anything less tidy)."""
    err = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(err, dict):
        code = err.get("code")
        if in_stream and status is None and isinstance(code, int):
            status = code
        return SluicegateError(
            str(err.get("message") or "error"),
            status=status,
            type=err.get("type"),
            code=code,
            param=err.get("param"),
            retry_after=retry_after,
            transport=transport,
            in_stream=in_stream,
        )
    message = err if isinstance(err, str) else json.dumps(payload)[:500] if payload is not None else "error"
    return SluicegateError(
        message, status=status, retry_after=retry_after, transport=transport, in_stream=in_stream
    )


def error_from_body(
    status: int, body: bytes, retry_after: float | None, transport: str | None
) -> SluicegateError:
    """The typed error for a non-2xx answer, whether or not its body is OpenAI JSON."""
    try:
        payload = json.loads(body)
    except ValueError:
        text = body.decode("utf-8", "replace").strip()[:500] or f"HTTP {status}"
        return SluicegateError(text, status=status, retry_after=retry_after, transport=transport)
    return error_from_payload(
        payload, status=status, retry_after=retry_after, transport=transport, in_stream=False
    )
