"""Admission: read and validate a client's request before any pod is involved.

The body is parsed once, only to learn what routing needs (model, stream); the original bytes are
what goes to the pod, so nothing the client sent is re-encoded or lost.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from gateway.errors import GatewayError, bad_request

Receive = Callable[[], Awaitable[dict[str, Any]]]

ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
# Each route's path on the pod.
ROUTE_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass(slots=True)
class InferenceRequest:
    route: str
    model: str
    stream: bool
    body: bytes
    payload: dict[str, Any]


_ID_PREFIX = os.urandom(8).hex()  # unique per gateway process; a counter makes each id unique in it
_ID_COUNTER = itertools.count(1)


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


def request_id(headers: list[tuple[bytes, bytes]]) -> str:
    """The client's ``X-Request-ID`` when it is sane, else a fresh one."""
    for name, value in headers:
        if name == b"x-request-id":
            if 0 < len(value) <= 128 and value.isascii() and value.decode().isprintable():
                return value.decode()
            break
    return f"{_ID_PREFIX}{next(_ID_COUNTER):016x}"


async def read_body(receive: Receive, headers: list[tuple[bytes, bytes]], limit: int) -> bytes:
    """The whole request body, refusing early (413) once it is known to exceed ``limit``."""
    for name, value in headers:
        if name == b"content-length":
            try:
                declared = int(value)
            except ValueError:
                raise bad_request("Content-Length is not a number.") from None
            if declared > limit:
                raise _too_large(limit)
            break
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _too_large(limit: int) -> GatewayError:
    return GatewayError(
        413, f"Request body is larger than the gateway's limit of {limit} bytes.",
        "invalid_request_error", "request_too_large",
    )


def encode_body(payload: dict[str, Any]) -> bytes:
    """A request body the gateway rewrote (a cap filled in, a continuation, streaming turned off):
    compact JSON, ASCII-escaped, so a lone surrogate a client sent (valid JSON) cannot fail to encode."""
    return json.dumps(payload, separators=(",", ":")).encode()


def parse_request(route: str, body: bytes) -> InferenceRequest:
    """Validate an OpenAI chat or completions request body enough to route it."""
    if not body:
        raise bad_request("Request body is empty; expected a JSON object.")
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"Request body is not valid JSON: {exc}.", code="invalid_json") from None
    except RecursionError:  # Python's decoder gives up past ~1000 levels; a client chose that depth
        raise bad_request("Request body is JSON nested too deeply.", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise bad_request("Request body must be a JSON object.", code="invalid_json")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a non-empty string.", "model", "missing_model")
    if route == "chat":
        messages = payload.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request(
                "'messages' is required and must be a non-empty array.", "messages", "missing_messages"
            )
    elif payload.get("prompt") is None:
        raise bad_request("'prompt' is required.", "prompt", "missing_prompt")
    stream = payload.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be true or false.", "stream", "invalid_type")
    return InferenceRequest(route, model, stream, body, payload)
