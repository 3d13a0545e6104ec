"""Who may call the gateway: API keys from the key store (``keystore``), managed with
``sluicegate keys`` (``keys_cli``)."""

from __future__ import annotations

import logging

from gateway.auth.keystore import (
    RIGHTS,
    KeyRecord,
    KeyStore,
    KeyStoreError,
    hash_key,
    new_key,
)
from gateway.config import Config

__all__ = [
    "RIGHTS",
    "KeyRecord",
    "KeyStore",
    "KeyStoreError",
    "auth_off_warning",
    "hash_key",
    "load_key_store",
    "new_key",
    "warn_if_auth_off",
]

log = logging.getLogger("sluicegate.auth")


def load_key_store(config: Config) -> KeyStore | None:
    """The key store ``config`` names (None when auth is off); ``KeyStoreError``, a ``ConfigError``
    with one readable sentence, when it cannot be used: the gateway must not start without keys."""
    if not config.auth.enabled:
        return None
    return KeyStore.load(config.auth.keys_file, config.tiers, config.auth.reload_interval_s)


def _listeners(config: Config) -> str:
    server = config.server
    host = f"[{server.host}]" if ":" in server.host else server.host
    ports = [server.port] if server.tls is None else [server.port, server.tls.port]
    return " and ".join(f"{host}:{port}" for port in ports)


def auth_off_warning(config: Config) -> str | None:
    """The start-up warning for a gateway without keys, or None when auth is on."""
    if config.auth.enabled:
        return None
    return f"auth is off: anyone who can reach {_listeners(config)} can use the gateway"


def warn_if_auth_off(config: Config) -> None:
    """Log ``auth_off_warning`` at WARNING, once, at start."""
    warning = auth_off_warning(config)
    if warning is not None:
        log.warning(warning)
