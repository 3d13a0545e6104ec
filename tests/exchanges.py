"""A real ``Exchange`` for unit tests that run outside any request.

The request path is compiled (setup.py): its calls check that an exchange is an ``Exchange``, so a
stand-in object no longer passes. This one is made on a loop of its own, its task already done."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.exchange import Exchange


async def _no_send(message: dict[str, Any]) -> None:
    raise AssertionError(f"nothing is sent through this exchange: {message}")


def exchange(route: str = "chat", **attributes: Any) -> Exchange:
    """An ``Exchange`` for ``route`` with ``attributes`` set (``usage_injected``, ``admission``, ...)."""

    async def make() -> Exchange:
        return Exchange(route, "test", _no_send)

    ex = asyncio.run(make())
    for name, value in attributes.items():
        setattr(ex, name, value)
    return ex
