"""The real ``redis-server`` launcher (``loadtest.redis_server``) for tests: without the binary a
test that needs it is skipped, with the reason, instead of failing."""

from __future__ import annotations

import pytest

from loadtest.redis_server import MISSING, READY, redis_server_binary
from loadtest.redis_server import RedisServer as _RedisServer

__all__ = ["READY", "RedisServer", "needs_redis_server", "redis_server_binary"]


def needs_redis_server() -> pytest.MarkDecorator:
    """Skip marker for tests that need the binary (``make test`` installs it from Debian as root)."""
    return pytest.mark.skipif(redis_server_binary() is None, reason=MISSING)


class RedisServer(_RedisServer):
    """``loadtest.redis_server.RedisServer`` that skips the test when redis-server is missing."""

    def __init__(self, port: int | None = None, start_timeout_s: float = 10.0) -> None:
        if redis_server_binary() is None:
            pytest.skip(MISSING)
        super().__init__(port, start_timeout_s)
