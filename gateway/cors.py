"""CORS for the OpenAI endpoints: which web pages may call them, and what those pages may read.

The policy comes from ``server.cors``. Every header list is built once, here, so a request costs a
dict lookup on its ``Origin`` (and nothing when it has none: most callers are not browsers).
Credentials (cookies) are never allowed: a page can only send what it holds itself, such as an API
key in ``Authorization``, so ``*`` is a safe answer when any origin is allowed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from gateway.config import CorsConfig

Headers = tuple[tuple[bytes, bytes], ...]

METHODS = b"GET, POST, OPTIONS"  # GET: /v1/models with an Authorization header is preflighted too
ALLOW_HEADERS = ("authorization", "content-type", "x-api-key", "x-request-id", "x-request-timeout-ms")
EXPOSE_HEADERS = (
    "x-request-id",
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
    "retry-after",
    "x-sluicegate-pod",
    "x-sluicegate-variant",
    "x-sluicegate-degraded",
)
_TOKEN = re.compile(rb"^[!#$%&'*+.^_`|~0-9a-z-]+$")  # an HTTP field name (lowercased)

ACAO = b"access-control-allow-origin"
VARY = b"vary"
_NONE: Headers = ()


def _origin(text: str) -> bytes:
    """An origin as browsers serialise it: lower case, no trailing slash."""
    return text.rstrip("/").lower().encode("ascii")


class CorsPolicy:
    """Answers preflights (``preflight``) and labels actual responses (``response_headers``).

    ``extra_headers``: request headers a page may send beyond the standard ones (the config's tier
    and criticality headers)."""

    def __init__(self, cors: CorsConfig, extra_headers: Iterable[str] = ()) -> None:
        self.any_origin = "*" in cors.allow_origins
        self.origins = frozenset(_origin(o) for o in cors.allow_origins if o != "*")
        allowed = list(dict.fromkeys([*ALLOW_HEADERS, *(h.lower() for h in extra_headers)]))
        self._allow_headers = frozenset(name.encode() for name in allowed)
        self._allow_list = ", ".join(allowed).encode()
        expose = (b"access-control-expose-headers", ", ".join(EXPOSE_HEADERS).encode())
        common = [
            (b"access-control-allow-methods", METHODS),
            (b"access-control-allow-headers", self._allow_list),
            (b"access-control-max-age", str(cors.max_age_s).encode()),
        ]
        if self.any_origin:
            self._response: dict[bytes, Headers] = {}
            self._any: Headers = ((ACAO, b"*"), expose, (b"timing-allow-origin", b"*"))
            self._preflight: dict[bytes, list[tuple[bytes, bytes]]] = {b"*": [(ACAO, b"*"), *common]}
        else:
            self._any = _NONE
            self._response = {
                o: ((ACAO, o), (VARY, b"Origin"), expose, (b"timing-allow-origin", o)) for o in self.origins
            }
            self._preflight = {o: [(ACAO, o), (VARY, b"Origin"), *common] for o in self.origins}
        # An allow-list answers differently per origin: caches must key on it even when refusing.
        self._vary_only: Headers = ((VARY, b"Origin"),) if self.origins and not self.any_origin else _NONE
        self._refused = [*self._vary_only]

    def response_headers(self, origin: bytes | None) -> Headers:
        """The CORS headers of an actual response to a request with this ``Origin`` (shared and
        immutable: extend a list with them, never change them)."""
        if origin is None:
            return _NONE
        if self._any:
            return self._any
        return self._response.get(origin, self._vary_only)

    def allows(self, origin: bytes) -> bool:
        return self.any_origin or origin in self.origins

    def preflight(
        self, origin: bytes | None, method: bytes | None, req_headers: bytes | None
    ) -> tuple[int, list[tuple[bytes, bytes]]]:
        """Status and headers for an ``OPTIONS`` request, answered without a pod: 204 with the
        policy for an allowed origin, 403 without any CORS header for another (the browser then
        refuses the page's call), and a plain 204 for an OPTIONS that is not a preflight.

        ``method`` (Access-Control-Request-Method) is not checked: the allowed methods are
        announced and the browser enforces them. Request headers the page asks for beyond the
        standard ones are granted too (the OpenAI JS SDK sends its ``x-stainless-*``): with no
        credentials allowed, a header is nothing a page could not send to its own server."""
        allow = [(b"allow", METHODS)]
        if origin is None:
            return 204, allow
        headers = self._preflight.get(b"*" if self.any_origin else origin)
        if headers is None:
            return 403, [*allow, *self._refused]
        extra = self._extra_headers(req_headers)
        if not extra:
            return 204, [*allow, *headers]
        out = [*allow, *(h for h in headers if h[0] != b"access-control-allow-headers")]
        out.append((b"access-control-allow-headers", b", ".join([self._allow_list, *extra])))
        out.append((VARY, b"Access-Control-Request-Headers"))
        return 204, out

    def _extra_headers(self, req_headers: bytes | None) -> list[bytes]:
        """The well-formed header names asked for that are not allowed already."""
        if not req_headers:
            return []
        extra: list[bytes] = []
        for raw in req_headers.split(b","):
            name = raw.strip().lower()
            if name and name not in self._allow_headers and _TOKEN.match(name) and name not in extra:
                extra.append(name)
        return extra
