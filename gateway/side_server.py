"""Serving a small aiohttp app until told to stop: the mig-agent, the pod simulator, the fake DCGM.

Each is its own process that prints one ``NAME listening on URL`` line once bound (launchers wait
for it) and stops cleanly on SIGTERM/SIGINT; tests running one in-process pass their own ``stop``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # aiohttp's server is loaded by the processes that serve one, not by the gateway
    from aiohttp import web


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready socket on ``host:port``; IPv4 first for names such as ``localhost``."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    # "localhost" may resolve to ::1 first; clients usually try 127.0.0.1 first, so prefer IPv4
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def url_of(host: str, port: int, scheme: str = "http") -> str:
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


async def serve_app(
    runner: web.AppRunner,
    host: str,
    port: int,
    *,
    announce: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
    backlog: int = 128,
    ssl_context: ssl.SSLContext | None = None,
) -> None:
    """Serve ``runner``'s app until ``stop`` is set; without ``stop``, until SIGTERM/SIGINT.

    ``announce`` gets the URL once the socket is bound. The runner is cleaned up on the way out.
    """
    from aiohttp import web

    await runner.setup()
    try:
        sock = bind(host, port)
        await web.SockSite(runner, sock, backlog=backlog, ssl_context=ssl_context).start()
        if stop is None:  # the process is ours: stop on SIGTERM/SIGINT
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                    loop.add_signal_handler(signum, stop.set)
        if announce is not None:
            announce(url_of(host, sock.getsockname()[1], "https" if ssl_context else "http"))
        await stop.wait()
    finally:
        await runner.cleanup()
