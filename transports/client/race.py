"""The connection race, as Chromium runs it: QUIC first, TCP after a head start, first handshake wins.

Only connections race, never requests: the chat request is sent once, on the winner, so a race
never doubles a generation on the GPUs. Which alternative to race, and what a lost race means
for it (marked broken), is the client's business (SluicegateClient); this is the race itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from transports.client.errors import SluicegateTransportError
from transports.client.exchange import ChatRequest
from transports.client.results import Negotiation
from transports.client.tcp import HttpxTransport
from transports.h3_client import H3ClientConnection

DEFAULT_RACE_DELAY = 0.3  # TCP's head start for QUIC when no RTT to the origin is known
MAX_RACE_DELAY = 3.0


def head_start(smoothed_rtt: float | None, no_rtt: float, most: float) -> float:
    """TCP's delay: ``min(1.5 x smoothed QUIC RTT, most)``, or ``no_rtt`` before any RTT is known."""
    if smoothed_rtt is None:
        return no_rtt
    return min(1.5 * smoothed_rtt, most)


async def race_quic_against_tcp(
    quic: asyncio.Task[H3ClientConnection],
    delay: float,
    tcp_transport: Callable[[], HttpxTransport],
    request: ChatRequest,
    nego: Negotiation,
    on_tcp_won: Callable[[], None],
) -> H3ClientConnection | None:
    """QUIC vs TCP, TCP held back ``delay`` s: the QUIC connection if it wins, None when TCP is ready.

    ``quic`` is a handshake already under way (perhaps shared with other requests); a winning TCP
    connection is parked in ``tcp_transport()``'s pool for the request, and ``on_tcp_won`` is
    called while a losing QUIC handshake may still be running.
    """
    loop = asyncio.get_running_loop()
    nego.raced, nego.race_delay = True, delay
    done, _ = await asyncio.wait({quic}, timeout=delay)
    if quic in done and _succeeded(quic):
        nego.note(f"h3: QUIC handshake done within the {delay * 1000:.0f} ms head start")
        return quic.result()
    tcp_pool = tcp_transport()
    tcp = asyncio.ensure_future(tcp_pool.ensure_connection(request.scheme, request.host, request.port))
    nego.tcp_started_after = loop.time() - nego.started
    if quic.done():
        nego.h3_error = _describe(quic)
        nego.note(f"h3 failed before the head start ended ({nego.h3_error}): TCP now")
    tcp_noted = False
    try:
        while True:
            await asyncio.wait([t for t in (quic, tcp) if not t.done()], return_when=asyncio.FIRST_COMPLETED)
            if _succeeded(quic):
                nego.note("h3: QUIC won the race")
                if _succeeded(tcp):
                    await tcp_pool.backend.discard(request.host, request.port)
                tcp.cancel()
                return quic.result()
            if quic.done() and nego.h3_error is None:
                nego.h3_error = _describe(quic)
                nego.note(f"h3 failed: {nego.h3_error}")
            if _succeeded(tcp):
                on_tcp_won()
                nego.note("TCP won the race" + ("" if quic.done() else "; QUIC carries on in the background"))
                return None
            if tcp.done() and quic.done():
                raise SluicegateTransportError(
                    f"neither QUIC ({_describe(quic)}) nor TCP ({_describe(tcp)}) reached {request.origin}",
                    nego.attempts,
                ) from (tcp.exception() if not tcp.cancelled() else None)
            if tcp.done() and not tcp_noted:
                tcp_noted = True
                nego.note(f"TCP failed ({_describe(tcp)}): waiting for QUIC")
    except BaseException:
        tcp.cancel()
        raise


def _succeeded(task: asyncio.Future[Any]) -> bool:
    return task.done() and not task.cancelled() and task.exception() is None


def _describe(task: asyncio.Future[Any]) -> str:
    if task.cancelled():
        return "cancelled"
    exc = task.exception()
    return f"{type(exc).__name__}: {exc}" if exc else "ok"
