"""The listeners' dispatch: which protocol a new connection speaks, HTTP/2 or HTTP/1.1.

Each listener starts as uvicorn would (one protocol object per accepted connection, built from
uvicorn's ``config``, ``server_state`` and ``app_state``) and then hands the transport to the
protocol the connection speaks:

- cleartext port: ``CleartextDispatch`` reads the first bytes. The HTTP/2 connection preface
  (``PRI * HTTP/2.0``, "prior knowledge" h2c) → ``H2Protocol``; anything else → uvicorn's HTTP/1.1
  protocol (``GuardedH1Protocol``), fed the bytes already read. Only the first read pays for this.
- TLS port: ``TlsDispatch`` looks at the ALPN the handshake chose: ``h2`` → ``H2Protocol``, else
  HTTP/1.1.
"""

from __future__ import annotations

import asyncio
from typing import Any

from transports.h1_limits import GuardedH1Protocol, H1Limits
from transports.h2_server import PREFACE, H2Protocol, H2Settings
from transports.same_delay_timers import SameDelayTimers


class _Dispatch(asyncio.Protocol):
    """A connection whose protocol is not known yet: made with uvicorn's protocol arguments, so it can
    build either HTTP/2's protocol or uvicorn's HTTP/1.1 one once it knows."""

    def __init__(
        self,
        config: Any,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        h2_settings: H2Settings | None = None,
        h1_limits: H1Limits | None = None,
    ) -> None:
        self.config = config
        self.server_state = server_state
        self.app_state = app_state
        self.loop = _loop
        self.h2_settings = h2_settings
        self.h1_limits = h1_limits or H1Limits()

    def protocol_for(self, h2: bool) -> asyncio.Protocol:
        if h2:
            return H2Protocol(self.config, self.server_state, self.app_state, self.loop, self.h2_settings)
        return GuardedH1Protocol(
            config=self.config,
            server_state=self.server_state,
            app_state=self.app_state,
            _loop=self.loop,
            limits=self.h1_limits,
        )


class CleartextDispatch(_Dispatch):
    """The cleartext port: HTTP/2 with prior knowledge (h2c) or HTTP/1.1, by the first bytes.

    A connection that sends nothing is closed at the request head timeout; HTTP/1.1 counts its own
    head timeout from the connection's start, not from the handover. ``first_bytes``: those
    timeouts (of the head timeout's delay), one set shared by all the listener's connections: one
    loop timer for all, not one set and cancelled a connection."""

    def __init__(self, *args: Any, first_bytes: SameDelayTimers, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.transport: asyncio.Transport | None = None
        self._head = b""
        self._started = 0.0
        self._first_bytes = first_bytes

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport
        self.server_state.connections.add(self)
        loop = self.loop = self.loop or asyncio.get_event_loop()
        self._started = loop.time()
        self._first_bytes.set(loop, self, transport.close)

    def data_received(self, data: bytes) -> None:
        head = self._head + data if self._head else data
        if len(head) < len(PREFACE) and PREFACE.startswith(head):
            self._head = head  # could still be the preface: wait for the rest
            return
        self._head = b""
        self._cancel_timer()
        protocol = self.protocol_for(head.startswith(PREFACE))
        if isinstance(protocol, GuardedH1Protocol):
            protocol.head_started = self._started
        hand_over(self, protocol, head)

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        self.server_state.connections.discard(self)

    def _cancel_timer(self) -> None:
        self._first_bytes.cancel(self)

    def shutdown(self) -> None:
        if self.transport is not None:
            self.transport.close()


class TlsDispatch(_Dispatch):
    """The TLS port: ALPN ``h2`` → HTTP/2, anything else (or none) → HTTP/1.1.

    asyncio calls ``connection_made`` once the handshake is done, when the ALPN choice is known;
    the protocol that speaks it takes over right there."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        ssl_object = transport.get_extra_info("ssl_object")
        alpn = ssl_object.selected_alpn_protocol() if ssl_object is not None else None
        protocol = self.protocol_for(alpn == "h2")
        transport.set_protocol(protocol)
        protocol.connection_made(transport)

    def data_received(self, data: bytes) -> None:  # pragma: no cover - replaced before any data
        raise RuntimeError("TlsDispatch received data after handing the connection over")

    def connection_lost(self, exc: Exception | None) -> None:
        pass


def hand_over(dispatch: CleartextDispatch, protocol: asyncio.Protocol, head: bytes) -> None:
    """Make ``protocol`` the transport's protocol and feed it the bytes read so far."""
    transport = dispatch.transport
    assert transport is not None
    dispatch.server_state.connections.discard(dispatch)
    transport.set_protocol(protocol)
    protocol.connection_made(transport)
    if head and not transport.is_closing():
        protocol.data_received(head)
