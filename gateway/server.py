"""Run the gateway: uvicorn's server (uvloop + httptools for HTTP/1.1, the cheapest path measured
here) with the gateway's own HTTP/2 and HTTP/3 listeners beside it.

Listeners, all on one event loop, serving the one ``Gateway`` app (one lifespan):

- ``server.port`` (TCP, cleartext): HTTP/1.1, and HTTP/2 with prior knowledge (h2c) unless
  ``server.h2c`` is off; the first bytes decide (``transports.h2_dispatch.CleartextDispatch``).
- ``server.tls.port`` (TCP, TLS): HTTP/2 or HTTP/1.1 by ALPN (``transports.h2_dispatch.TlsDispatch``).
- ``server.tls.h3_port`` (UDP, QUIC): HTTP/3 (``transports.h3_server``), unless ``server.tls.h3`` is
  off; by default the same port number as the TLS listener.
- ``admin.port`` (TCP, cleartext HTTP/1.1 on ``admin.host``, loopback by default): the admin plane
  (``/admin/*``, ``/metrics``; ``gateway.admin``), a separate app that no public listener serves.

Every connection, whatever its protocol, joins uvicorn's ``server_state``: the SIGTERM drain and
uvicorn's shutdown (``connection.shutdown()`` on each, then wait for them) cover all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import ssl
import sys
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.config import STARTUP_FAILURE
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.access_log import ACCESS, LogTime
from gateway.admin import KeyLookup
from gateway.app import Gateway
from gateway.config import AdminConfig, Config, ConfigError
from gateway.reload import ConfigSource
from gateway.rlimits import raise_open_file_limit
from gateway.workers import READY_LINE
from transports.h1_limits import GuardedH1Protocol, H1Limits
from transports.h2_dispatch import CleartextDispatch, TlsDispatch
from transports.h2_guard import H2Limits
from transports.h2_server import H2Settings
from transports.same_delay_timers import SameDelayTimers
from transports.tls import TlsFilesError, server_context

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _Formatter(logging.Formatter):
    """The standard formatter with the time's text from ``LogTime`` (its seconds made once a second)."""

    def __init__(self, fmt: str) -> None:
        super().__init__(fmt)
        self._time = LogTime()

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        return self._time(record.created)


def configure_logging(level: str = "info", process: str | None = None) -> None:
    """Log lines on stderr; ``process`` (a worker's name) tags each line of a worker of many.

    The format names no source line, thread or process, so ``logging`` is told not to look them
    up for each record (its documented optimisations): with the access log on, finding the caller
    by walking the stack was the costliest part of a request's line."""
    fmt = LOG_FORMAT if process is None else LOG_FORMAT.replace("%(name)s", f"{process} %(name)s")
    logging._srcfile = None  # the logging HOWTO's "Optimization" switch
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler = logging.StreamHandler()
    handler.setFormatter(_Formatter(fmt))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    ACCESS.configure(fmt)


@dataclass
class ExtraListeners:
    """The listeners beside uvicorn's cleartext port (built before anything starts)."""

    tls: ssl.SSLContext | None = None
    tls_port: int = 8443
    quic: Any = None  # an aioquic QuicConfiguration when HTTP/3 is on
    h3_port: int | None = None  # None: the TLS listener's port number
    h2: H2Settings = field(default_factory=H2Settings)
    h1: H1Limits = field(default_factory=H1Limits)
    h3_limits: Any = None  # transports.h3_guard.H3Limits; None: its defaults
    h3_stall_s: float | None = 30.0  # an HTTP/3 response with no room to send this long: reset
    alt_svc_port: int | None = None  # the HTTP/3 port as clients see it; None: the bound one
    alt_svc_max_age_s: int = 86400
    admin: AdminConfig | None = None  # None: no admin listener
    # A worker of ``serve --workers N``: every public listener shares its port with the other
    # workers' (SO_REUSEPORT, the kernel spreads connections), and the admin app listens on a
    # private Unix socket (the supervisor's admin listener scrapes and forwards to it).
    reuse_port: bool = False
    admin_uds: str | None = None


class Server(uvicorn.Server):
    """uvicorn's server plus readiness as an event and a graceful drain on SIGTERM/SIGINT.

    uvicorn on its own stops listening at the first signal (new clients are refused, not told to
    retry) and re-raises the signal after shutdown (exit status -15, not 0). Here the first signal
    starts the gateway's drain with the listener still open (``/readyz`` 503, new requests 503 with
    Retry-After, streams in flight run on until the drain deadline); then uvicorn shuts down as
    usual and the process exits 0. A second signal exits at once.
    """

    def __init__(self, config: uvicorn.Config, extra: ExtraListeners | None = None) -> None:
        self._exit_now: asyncio.Event | None = None  # main_loop's wake-up (set with should_exit)
        self._loop: asyncio.AbstractEventLoop | None = None
        super().__init__(config)
        self.listening = asyncio.Event()
        self.extra = extra or ExtraListeners()
        self.urls: list[str] = []  # what each listener was announced as, cleartext first
        self.admin_url: str | None = None  # the admin listener's, once it listens
        self.h3: Any = None  # the HTTP/3 listener while it runs
        self._draining = False

    @property
    def should_exit(self) -> bool:
        return self._should_exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        """uvicorn's flag, which also wakes ``main_loop`` (it may be set from a signal handler)."""
        self._should_exit = value
        if value and self._exit_now is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._exit_now.set)

    async def main_loop(self) -> None:
        """uvicorn's housekeeping loop, woken once a second instead of ten times.

        uvicorn ticks every 100 ms to notice ``should_exit`` and refreshes the Date header every
        tenth tick; here the tick is the Date refresh, and ``should_exit`` wakes the loop itself.
        Nine fewer wake-ups a second: ~1 of the idle gateway's CPU-ms per second on this machine.
        """
        self._exit_now = asyncio.Event()
        ticks = 0
        while not await self.on_tick(ticks):  # a multiple of 10: on_tick refreshes the Date header
            ticks = (ticks + 10) % 864000
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._exit_now.wait()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        app = self.config.app
        if self._draining or self._loop is None or not isinstance(app, Gateway):
            if self.should_exit:
                self.force_exit = True
            self.should_exit = True
            return
        self._draining = True
        self._loop.call_soon_threadsafe(self._start_drain, app)

    def _start_drain(self, app: Gateway) -> None:
        async def drain_then_exit() -> None:
            await app.drain()
            self.should_exit = True

        self._drain_task = asyncio.ensure_future(drain_then_exit())

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self.urls = [f"http://{_netloc(host, port)}"]
            try:
                await self._start_extra()
                await self._start_admin()
            except OSError as exc:  # as uvicorn does when its own port is taken: exit 3
                print(f"sluicegate: cannot listen: {exc}", file=sys.stderr, flush=True)
                for server in self.servers:
                    server.close()
                if self.h3 is not None:
                    self.h3.close()
                await self.lifespan.shutdown()
                sys.exit(STARTUP_FAILURE)
            # Machine-readable lines on stdout, once every listener is up; launchers wait for the
            # first (cleartext) one instead of polling.
            print(f"sluicegate listening on {self.urls[0]}", flush=True)
            for url in self.urls[1:]:
                kind = "h3 " if url.startswith("udp:") else ""
                print(f"sluicegate {kind}listening on {url}", flush=True)
            if self.admin_url is not None:
                print(f"sluicegate admin listening on {self.admin_url}", flush=True)
            if self.extra.reuse_port:  # a worker: its supervisor waits for this line
                print(READY_LINE, flush=True)
            self.listening.set()

    async def _start_extra(self) -> None:
        """The TLS (h1/h2) and QUIC (h3) listeners, sharing uvicorn's state and the app."""
        extra = self.extra
        if extra.tls is None:
            return
        config = self.config
        loop = asyncio.get_running_loop()
        state = self.lifespan.state

        def tls_protocol() -> TlsDispatch:
            return TlsDispatch(config, self.server_state, state, loop, extra.h2, extra.h1)

        server = await loop.create_server(
            tls_protocol, host=config.host, port=extra.tls_port, ssl=extra.tls, backlog=config.backlog,
            reuse_port=extra.reuse_port or None,
        )
        self.servers.append(server)
        host, tls_port = server.sockets[0].getsockname()[:2]
        self.urls.append(f"https://{_netloc(host, tls_port)}")
        if extra.quic is not None:
            from transports import h3_guard
            from transports.h3_server import H3Listener

            h3_guard.REUSE_PORT = extra.reuse_port

            self.h3 = H3Listener(
                config.loaded_app, extra.quic, self.server_state, state, config.root_path,
                limits=extra.h3_limits, stall_s=extra.h3_stall_s,
            )
            h3_host, h3_port = await self.h3.start(
                config.host, extra.h3_port if extra.h3_port is not None else tls_port
            )
            self.urls.append(f"udp://{_netloc(h3_host, h3_port)}")
        relay = getattr(config.app, "relay", None)
        if relay is not None:
            relay.alt_svc = alt_svc(extra, h3_port if self.h3 is not None else None)

    async def _start_admin(self) -> None:
        """The admin plane's listener: uvicorn's HTTP/1.1 protocol on a socket of its own, in this
        process and loop, serving ``Gateway.admin`` (which needs no lifespan: the public app's runs
        the gateway). Its connections join ``server_state``, so the shutdown covers them too."""
        admin, app = self.extra.admin, getattr(self.config.app, "admin", None)
        if admin is None or app is None:
            return
        config = self.config
        admin_config = uvicorn.Config(
            app, host=admin.host, port=admin.port, http="httptools", lifespan="off",
            access_log=False, log_config=None, log_level=config.log_level, proxy_headers=False,
            server_header=False, timeout_keep_alive=config.timeout_keep_alive, ws="none",
        )
        admin_config.load()
        loop = asyncio.get_running_loop()
        state = self.lifespan.state

        def admin_protocol() -> HttpToolsProtocol:
            return HttpToolsProtocol(admin_config, self.server_state, state, loop)

        if self.extra.admin_uds is not None:
            server = await loop.create_unix_server(admin_protocol, path=self.extra.admin_uds)
            self.servers.append(server)
            self.admin_url = f"unix:{self.extra.admin_uds}"
            return
        try:
            server = await loop.create_server(admin_protocol, host=admin.host, port=admin.port)
        except OSError as exc:
            raise OSError(exc.errno, f"admin listener (admin.port): {exc.strerror or exc}") from exc
        self.servers.append(server)
        host, port = server.sockets[0].getsockname()[:2]
        self.admin_url = f"http://{_netloc(host, port)}"

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.h3 is not None:
            self.h3.stop_accepting()
        try:
            await super().shutdown(sockets)
        finally:
            if self.h3 is not None:
                self.h3.close()
                self.h3 = None


def alt_svc(extra: ExtraListeners, h3_port: int | None) -> bytes:
    """What answers over TCP say of HTTP/3 (RFC 7838): where it is and for how long; or, with HTTP/3
    off, ``clear``, so that clients which cached an earlier advertisement stop trying it."""
    if h3_port is None:
        return b"clear"
    port = extra.alt_svc_port or h3_port
    return b'h3=":%d"; ma=%d' % (port, extra.alt_svc_max_age_s)


def _netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def extra_listeners(config: Config) -> ExtraListeners:
    """The TLS and QUIC listeners ``config`` asks for, their certificate loaded (``ConfigError``
    naming the file when it cannot be)."""
    lim = config.server.limits
    h1 = H1Limits(
        head_timeout_s=lim.head_timeout_s, body_idle_timeout_s=lim.body_idle_timeout_s,
        body_timeout_s=lim.body_timeout_s, max_request_line_bytes=lim.max_request_line_bytes,
        max_headers=lim.max_headers, max_header_bytes=lim.max_header_bytes,
    )
    h2 = H2Settings(
        max_concurrent_streams=config.server.max_concurrent_streams,
        max_header_list_size=lim.max_header_bytes,
        limits=H2Limits(
            head_timeout_s=lim.head_timeout_s, max_headers=lim.max_headers,
            premature_reset_s=lim.h2_premature_reset_s, max_premature_resets=lim.h2_max_premature_resets,
            control_frames_per_s=lim.h2_control_frames_per_s, control_frame_burst=lim.h2_control_frame_burst,
            max_outbound_control_frames=lim.h2_max_outbound_control_frames,
            max_empty_frames=lim.h2_max_empty_frames, send_stall_s=lim.h2_send_stall_s,
            max_window_updates_per_data_frame=lim.h2_max_window_updates_per_data_frame,
        ),
    )
    admin = config.admin if config.admin.enabled else None
    tls = config.server.tls
    if tls is None:
        return ExtraListeners(h2=h2, h1=h1, admin=admin)
    try:
        context = server_context(tls.cert, tls.key)
        quic = h3_limits = None
        if tls.h3:
            from transports.h3_guard import H3Limits
            from transports.h3_server import quic_configuration

            h3l = config.server.h3_limits
            quic = quic_configuration(tls.cert, tls.key, idle_timeout_s=h3l.idle_timeout_s)
            h3_limits = H3Limits(
                max_connections=h3l.max_connections, max_concurrent_streams=h3l.max_concurrent_streams,
                handshake_timeout_s=h3l.handshake_timeout_s, retry=h3l.retry,
                retry_above_handshakes=h3l.retry_above_handshakes,
                max_crypto_buffer_bytes=h3l.max_crypto_buffer_bytes,
                drain_body_bytes=h3l.drain_body_bytes, drain_body_s=h3l.drain_body_s,
            )
    except TlsFilesError as exc:
        raise ConfigError(f"server.tls: {exc}") from None
    except (ValueError, TypeError, OSError) as exc:  # aioquic's own loading of the PEM files
        raise ConfigError(f"server.tls: cannot load {tls.cert!r} / {tls.key!r} for HTTP/3: {exc}") from None
    return ExtraListeners(
        tls=context, tls_port=tls.port, quic=quic, h3_port=tls.h3_port, h2=h2, h1=h1,
        h3_limits=h3_limits, h3_stall_s=config.server.h3_limits.send_stall_s,
        alt_svc_port=tls.alt_svc_port, alt_svc_max_age_s=tls.alt_svc_max_age_s, admin=admin,
    )


def build_server(
    config: Config,
    log_level: str = "info",
    lookup: KeyLookup | None = None,
    source: ConfigSource | None = None,
    worker: Any = None,
) -> Server:
    """The server for ``config``; uvicorn's own access log is off (the gateway writes its own).
    ``lookup`` finds API keys' records for the admin plane (``KeyStore.lookup``; see ``Gateway``);
    ``source``, where ``config`` came from, for reloads (``gateway.reload``); ``worker``, a
    ``gateway.workers.worker.WorkerLink`` when this process is one of ``serve --workers N``.

    Raises ``ConfigError`` when the TLS certificate or key cannot be used."""
    extra = extra_listeners(config)
    if worker is not None:
        extra.reuse_port = True
        extra.admin_uds = worker.spec.admin_path if extra.admin is not None else None
    app = Gateway(config, lookup, source, worker=worker)
    http: Any = functools.partial(GuardedH1Protocol, limits=extra.h1)
    if config.server.h2c:
        http = functools.partial(
            CleartextDispatch, h2_settings=extra.h2, h1_limits=extra.h1,
            first_bytes=SameDelayTimers(extra.h1.head_timeout_s),
        )
    uv_config = uvicorn.Config(
        app,
        host=config.server.host,
        port=config.server.port,
        loop="uvloop",
        http=http,
        lifespan="on",
        access_log=False,
        log_config=None,
        log_level=log_level,
        timeout_keep_alive=config.server.limits.keep_alive_timeout_s,
        backlog=4096,
        server_header=False,
        timeout_graceful_shutdown=5,
        proxy_headers=False,  # the client address is ClientAddress's, from server.trusted_proxies only
        ws="none",  # no WebSocket routes: uvicorn would load the websockets library for nothing
    )
    return Server(uv_config, extra)


def serve(config: Config, log_level: str = "info", source: ConfigSource | None = None) -> None:
    _build_or_exit(config, log_level, source, None).run()


def _build_or_exit(config: Config, log_level: str, source: ConfigSource | None, worker: Any) -> Server:
    """``build_server`` after raising the open-file limit; a ``ConfigError`` exits 2 on one line."""
    raise_open_file_limit()
    try:
        return build_server(config, log_level, source=source, worker=worker)
    except ConfigError as exc:
        print(f"sluicegate: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def serve_worker(config: Config, log_level: str, source: ConfigSource | None, worker: Any) -> None:
    """One worker of ``serve --workers N``: as ``serve``, its cleartext listener bound here with
    ``SO_REUSEPORT`` beside the other workers' (uvicorn binds none of its own)."""
    server = _build_or_exit(config, log_level, source, worker)
    try:
        sockets = reuse_port_sockets(config.server.host, config.server.port)
    except OSError as exc:
        print(f"sluicegate: cannot listen: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(STARTUP_FAILURE) from None
    server.run(sockets=sockets)


def reuse_port_sockets(host: str, port: int) -> list[socket.socket]:
    """TCP sockets bound to every address of ``host`` on ``port`` with ``SO_REUSEPORT`` (not yet
    listening): each worker binds its own, and the kernel spreads new connections across them."""
    sockets: list[socket.socket] = []
    seen: set[tuple[int, Any]] = set()
    for family, kind, proto, _, address in socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    ):
        if (family, address) in seen:
            continue
        seen.add((family, address))
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
        except OSError:
            sock.close()
            for bound in sockets:
                bound.close()
            raise
        sockets.append(sock)
    return sockets
