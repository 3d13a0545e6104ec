"""The gateway's HTTP/1.1 protocol keeps uvicorn's write flow control working with its lighter event.

``PromptH1Protocol`` swaps uvicorn's ``FlowControl`` event for a ``LightEvent`` (no deque held for the
connection's life). The splice waits on ``flow.drain()`` while the client's socket is over its
high-water mark (``transports/client_socket.py``): that wait must end when uvicorn resumes writing,
and when the client is lost.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.config import Config
from uvicorn.server import ServerState

from transports.h1_limits import GuardedH1Protocol
from transports.light_event import LightEvent


class _Transport:
    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 8000) if name in ("peername", "sockname") else default

    def is_closing(self) -> bool:
        return False

    def close(self) -> None: ...


def _protocol() -> GuardedH1Protocol:
    config = Config(app=lambda scope, receive, send: None, http="httptools")
    config.load()
    protocol = GuardedH1Protocol(config=config, server_state=ServerState(), app_state={})
    protocol.connection_made(_Transport())  # type: ignore[arg-type]
    return protocol


async def test_a_paused_write_drains_when_uvicorn_resumes_writing() -> None:
    protocol = _protocol()
    assert isinstance(protocol.flow._is_writable_event, LightEvent)
    await asyncio.wait_for(protocol.flow.drain(), 1)  # writable from the start
    protocol.pause_writing()
    drain = asyncio.ensure_future(protocol.flow.drain())
    await asyncio.sleep(0)
    assert not drain.done() and protocol.flow.write_paused
    protocol.resume_writing()
    await asyncio.wait_for(drain, 1)


async def test_a_paused_write_drains_when_the_client_is_lost() -> None:
    protocol = _protocol()
    protocol.pause_writing()
    drain = asyncio.ensure_future(protocol.flow.drain())
    await asyncio.sleep(0)
    assert not drain.done()
    protocol.connection_lost(None)
    await asyncio.wait_for(drain, 1)
