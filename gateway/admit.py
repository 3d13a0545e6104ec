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
from transports import json_bytes

Receive = Callable[[], Awaitable[dict[str, Any]]]

# The OpenAI (and vLLM) routes the relay serves: client path -> route name. Every one is routed by
# its body's ``model`` to the pods serving it, under the same keys, quotas, timeouts and metrics.
ROUTES = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/embeddings": "embeddings",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
}
# gRPC-Web's calls: ``sluicegate.v1.Inference``'s methods, translated to the chat route by
# ``gateway/grpc_web.py``, which the app loads on the first of them.
GRPC_WEB_PREFIX = "/sluicegate.v1.Inference/"
# Each route's path on the pod (vLLM serves them under the same paths).
ROUTE_PATHS = {route: path for path, route in ROUTES.items()}
# The routes whose answers may stream (``stream: true``); the others ignore the field, as vLLM does.
STREAMING_ROUTES = frozenset({"chat", "completions", "responses"})
# The routes whose streams are OpenAI chunks (``choices``, ``[DONE]``): resume and degrade speak them.
CHUNK_ROUTES = frozenset({"chat", "completions"})


@dataclass(slots=True)
class InferenceRequest:
    """A request as the pod gets it: ``body`` is what is sent, ``payload`` its parsed form.

    Once a pod has begun to answer, ``body`` is ``SENT``: no later attempt sends it again (a retry
    happens only before the first byte, and a resume builds its own body from ``payload``), and a
    long prompt's bytes need not stay for the whole answer (8 KB a stream with 8 KB prompts)."""

    route: str
    model: str
    stream: bool
    body: bytes
    payload: dict[str, Any]


SENT = b""  # an InferenceRequest's body once a pod is answering it


_ID_PREFIX = os.urandom(8).hex()  # unique per gateway process; a counter makes each id unique in it
_ID_COUNTER = itertools.count(1)


def _new_id_prefix() -> None:
    """A forked process (a worker, ``gateway/workers/template.py``) is a new gateway process: its ids
    must not repeat its parent's or its siblings'."""
    global _ID_PREFIX, _ID_COUNTER
    _ID_PREFIX = os.urandom(8).hex()
    _ID_COUNTER = itertools.count(1)


os.register_at_fork(after_in_child=_new_id_prefix)


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


def request_id(value: bytes | None) -> str:
    """The client's ``X-Request-ID`` (``value``) when it is sane, else a fresh one."""
    if value is not None and 0 < len(value) <= 128 and value.isascii() and value.decode().isprintable():
        return value.decode()
    return f"{_ID_PREFIX}{next(_ID_COUNTER):016x}"


async def read_body(receive: Receive, content_length: bytes | None, limit: int) -> bytes:
    """The whole request body, refusing early (413) once it is known to exceed ``limit``."""
    if content_length is not None:
        try:
            declared = int(content_length)
        except ValueError:
            raise bad_request("Content-Length is not a number.") from None
        if declared > limit:
            raise _too_large(limit)
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
    """Validate a request body enough to route it: a JSON object, ``model``, the route's own input."""
    if not body:
        raise bad_request("Request body is empty; expected a JSON object.")
    try:
        payload = json_bytes.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"Request body is not valid JSON: {exc}.", code="invalid_json") from None
    except RecursionError:  # Python's decoder gives up past ~1000 levels; a client chose that depth
        raise bad_request("Request body is JSON nested too deeply.", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise bad_request("Request body must be a JSON object.", code="invalid_json")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a non-empty string.", "model", "missing_model")
    _CHECKS[route](payload)
    if route not in STREAMING_ROUTES:
        return InferenceRequest(route, model, False, body, payload)
    stream = payload.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be true or false.", "stream", "invalid_type")
    return InferenceRequest(route, model, stream, body, payload)


# -- each route's required input (the pod checks the rest, in its own words) -------------------------


def _check_chat(payload: dict[str, Any]) -> None:
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request(
            "'messages' is required and must be a non-empty array.", "messages", "missing_messages"
        )


def _check_completions(payload: dict[str, Any]) -> None:
    if payload.get("prompt") is None:
        raise bad_request("'prompt' is required.", "prompt", "missing_prompt")


def _check_responses(payload: dict[str, Any]) -> None:
    """``input``: a non-empty string, or a non-empty array of input items (messages, tool outputs)."""
    given = payload.get("input")
    if given is None:
        raise bad_request("'input' is required.", "input", "missing_input")
    if not (isinstance(given, str | list) and given) or (
        isinstance(given, list) and not all(isinstance(item, dict) for item in given)
    ):
        raise bad_request(
            "'input' must be a non-empty string or a non-empty array of input items.",
            "input", "invalid_input",
        )


def _is_tokens(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def _check_embeddings(payload: dict[str, Any]) -> None:
    """``input``: a string, an array of strings, an array of token ids, or an array of those arrays."""
    given = payload.get("input")
    if given is None:
        raise bad_request("'input' is required.", "input", "missing_input")
    ok = (isinstance(given, str) and given != "") or (
        isinstance(given, list)
        and bool(given)
        and (
            all(isinstance(text, str) and text != "" for text in given)
            or _is_tokens(given)
            or all(_is_tokens(tokens) for tokens in given)
        )
    )
    if not ok:
        raise bad_request(
            "'input' must be a non-empty string, array of strings, array of token ids, or array of "
            "token id arrays.",
            "input", "invalid_input",
        )
    encoding = payload.get("encoding_format")
    if encoding is not None and encoding not in ("float", "base64"):
        raise bad_request(
            "'encoding_format' must be 'float' or 'base64'.", "encoding_format", "invalid_value"
        )


def _check_tokenize(payload: dict[str, Any]) -> None:
    """vLLM tokenizes a ``prompt`` (text) or chat ``messages`` (through the chat template)."""
    prompt, messages = payload.get("prompt"), payload.get("messages")
    if prompt is not None and messages is not None:
        raise bad_request("Give either 'prompt' or 'messages', not both.", "prompt", "invalid_input")
    if messages is not None:
        _check_chat(payload)
    elif not isinstance(prompt, str):
        raise bad_request(
            "'prompt' (a string) or 'messages' (an array) is required.", "prompt", "missing_prompt"
        )


def _check_detokenize(payload: dict[str, Any]) -> None:
    tokens = payload.get("tokens")
    if tokens is None:
        raise bad_request("'tokens' is required.", "tokens", "missing_tokens")
    if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
        raise bad_request("'tokens' must be an array of non-negative token ids.", "tokens", "invalid_tokens")


_CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "chat": _check_chat,
    "completions": _check_completions,
    "responses": _check_responses,
    "embeddings": _check_embeddings,
    "tokenize": _check_tokenize,
    "detokenize": _check_detokenize,
}
