"""Errors in the OpenAI wire form, so every client SDK can parse what the gateway says.

``{"error": {"message", "type", "param", "code"}}`` with the HTTP status that matches; the same
object wrapped as an SSE ``data:`` event once a stream has begun.
"""

from __future__ import annotations

import functools
import json

from transports.sse import error_event


class GatewayError(Exception):
    """An error the client should see, with its HTTP status and OpenAI ``type``/``code``.

    ``raw_body`` carries a pod's own OpenAI-format error body, forwarded byte for byte.
    """

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | int | None = None,
        param: str | None = None,
        headers: tuple[tuple[str, str], ...] = (),
        raw_body: bytes | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.headers = headers
        self.raw_body = raw_body

    def body(self) -> bytes:
        if self.raw_body is not None:
            return self.raw_body
        return error_body(self.message, self.type, self.code, self.param)

    def sse_event(self) -> bytes:
        """The same error as an SSE event followed by the stream's end, as vLLM does."""
        return error_event(self.body())


def error_body(message: str, type_: str, code: str | int | None = None, param: str | None = None) -> bytes:
    payload = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return json.dumps(payload, separators=(",", ":")).encode()


def bad_request(message: str, param: str | None = None, code: str = "invalid_request") -> GatewayError:
    return GatewayError(400, message, "invalid_request_error", code, param)


def model_not_found(model: str) -> GatewayError:
    return GatewayError(
        404,
        f"The model '{model}' does not exist or is not served by any pod behind this gateway.",
        "invalid_request_error",
        "model_not_found",
        "model",
    )


def no_capacity(model: str, retry_after_s: int = 1) -> GatewayError:
    return GatewayError(
        503,
        f"No pod serving '{model}' is reachable right now; retry shortly.",
        "service_unavailable",
        "no_healthy_upstream",
        headers=(("retry-after", str(retry_after_s)),),
    )


def overloaded(model: str, reason: str, retry_after_s: int) -> GatewayError:
    """Every pod of the model is saturated (or ejected): come back later, do not queue here.

    The body is rendered once per (model, reason, wait): under overload this is the answer the
    gateway gives most often, and it should cost as little as possible.
    """
    message, body = _overloaded_text(model, reason, retry_after_s)
    return GatewayError(
        429, message, "rate_limit_exceeded", reason,
        headers=(("retry-after", str(retry_after_s)),), raw_body=body,
    )


@functools.lru_cache(maxsize=1024)
def _overloaded_text(model: str, reason: str, retry_after_s: int) -> tuple[str, bytes]:
    message = f"Every pod serving '{model}' is at capacity right now; retry after {retry_after_s} s."
    return message, error_body(message, "rate_limit_exceeded", reason)


def upstream_failed(pod: str, detail: str, status: int = 502) -> GatewayError:
    return GatewayError(status, f"Upstream pod '{pod}' failed: {detail}", "upstream_error", "bad_gateway")


def upstream_truncated(pod: str, detail: str) -> GatewayError:
    """A pod's answer that ended without being whole (no ``[DONE]``, a choice left unfinished,
    garbage, or an event past the size cap): never passed on as a clean end."""
    return GatewayError(502, f"Upstream pod '{pod}' failed: {detail}", "upstream_error", "upstream_truncated")
