"""vLLM's ``--api-key`` for the simulator: the same paths guarded, the same 401, byte for byte.

vLLM (``vllm/entrypoints/openai/server_utils.py``, ``AuthenticationMiddleware``) lets OPTIONS
through (CORS preflights), leaves its public endpoints open (``/health``, ``/ping``, ``/load``,
``/version``, ``/metrics``, the docs) and answers anything under ``/v1`` (and its other API
prefixes) without ``Authorization: <bearer> KEY`` — the scheme in any case, one of the keys after
the first space — with ``401 {"error":"Unauthorized"}`` (a Starlette ``JSONResponse``). Keys are
compared as SHA-256 digests in constant time, every key tried. The simulator's own routes
(``/podsim/*``, ``/admin/faults``) stay open: tests drive them, and vLLM has no such routes.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Awaitable, Callable, Iterable

from aiohttp import web

GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere", "/tokenize", "/detokenize", "/pooling",
                    "/classify", "/score", "/rerank", "/invocations")
UNAUTHORIZED_BODY = b'{"error":"Unauthorized"}'  # Starlette's JSONResponse: compact separators

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]


def api_key_middleware(keys: Iterable[str]) -> Middleware:
    """An aiohttp middleware that refuses guarded paths without one of ``keys`` as vLLM does."""
    digests = [hashlib.sha256(key.encode()).digest() for key in keys]
    if not digests:
        raise ValueError("an API key middleware needs at least one key")

    def verified(value: str | None) -> bool:
        if not value:
            return False
        scheme, _, param = value.partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(param.encode()).digest()
        match = False
        for known in digests:  # all of them, whatever matched: no timing hint of which
            match |= secrets.compare_digest(digest, known)
        return match

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if (
            request.method != "OPTIONS"
            and request.path.startswith(GUARDED_PREFIXES)
            and not verified(request.headers.get("Authorization"))
        ):
            return web.Response(status=401, body=UNAUTHORIZED_BODY, content_type="application/json")
        return await handler(request)

    return middleware
