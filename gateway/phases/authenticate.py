"""Authenticate: who is calling, and may they use this model.

The caller's key (``Authorization: Bearer KEY``, or ``x-api-key`` as some SDKs send it) is looked up
in the key store by its hash, one dict lookup. The key itself goes no further: it is not forwarded to
pods, logged, or used as a metric label; what the rest of the request knows is the key's record (its
id, tier, models and rights). With auth off, the trusted tier header names the tier instead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.config import Config
from gateway.errors import GatewayError
from gateway.request_head import RequestHead

_WWW_AUTHENTICATE = (("www-authenticate", 'Bearer realm="sluicegate"'),)


class KeyLookup(Protocol):
    def lookup(self, key: bytes) -> Any: ...


@dataclass(frozen=True, slots=True)
class Caller:
    """Who made the request: the key's id and record (None with auth off) and the tier it selects."""

    key_id: str | None
    tier: str | None
    record: Any = None  # gateway.auth.keystore.KeyRecord


def unauthenticated(message: str) -> GatewayError:
    """OpenAI's 401: the SDKs raise AuthenticationError on it. The key is never echoed."""
    return GatewayError(401, message, "invalid_request_error", "invalid_api_key", headers=_WWW_AUTHENTICATE)


def forbidden(message: str, code: str) -> GatewayError:
    """403: the key is good, but not for this (the SDKs raise PermissionDeniedError)."""
    return GatewayError(403, message, "invalid_request_error", code)


_MISSING = unauthenticated(
    "No API key was provided. Send it as 'Authorization: Bearer KEY' (or an 'x-api-key' header)."
)
_UNKNOWN = unauthenticated("The API key provided is not valid.")
_EXPIRED = unauthenticated("The API key provided has expired.")


class Authenticate:
    """The authenticate phase; ``store`` is None when auth is off."""

    def __init__(self, config: Config, store: KeyLookup | None) -> None:
        self.store = store
        self._anonymous = {name: Caller(None, name) for name in config.tiers}
        self._nobody = Caller(None, None)

    def caller(self, head: RequestHead) -> Caller:
        """The caller of a request, or a 401."""
        if self.store is None:
            tier = head.tier
            if tier is None:
                return self._nobody
            return self._anonymous.get(tier.decode("latin-1"), self._nobody)
        if not head.api_key:
            raise _MISSING
        record = self.store.lookup(head.api_key)
        if record is None:
            raise _UNKNOWN
        if record.expires is not None and record.expired(time.time()):
            raise _EXPIRED
        return Caller(record.id, record.tier, record)

    @staticmethod
    def authorize(caller: Caller, model: str) -> None:
        """A 403 when the caller's key may not use ``model``."""
        record = caller.record
        if record is not None and not record.allows(model):
            raise forbidden(f"This API key may not use the model '{model}'.", "model_not_allowed")


def has_right(caller: Caller, right: str) -> bool:
    """Whether the caller's key grants ``right`` (``admin``, ``variant_override``); with auth off,
    nobody has rights."""
    return caller.record is not None and caller.record.has_right(right)
