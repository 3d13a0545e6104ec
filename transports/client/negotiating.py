"""The negotiating client: which transport carries each request, and what the server's answers teach.

One object holds everything learnt about an origin (Alt-Svc, broken alternatives, QUIC RTTs,
server-directed caps) and the connections themselves (QUIC per origin, an httpx pool per TCP
kind), so that each request starts from what the last ones found out. The transports, the race and
the stream live in their own modules; the policy that ties them together is here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from transports.altsvc import AltSvcCache, origin_of
from transports.broken_alternatives import BrokenAlternatives
from transports.client.downgrade import DOWNGRADE_HEADER, HTTP_1_1_REQUIRED, h2_error_code, parse_downgrade
from transports.client.errors import (
    SluicegateError,
    SluicegateTransportError,
    error_from_body,
    parse_retry_after,
)
from transports.client.exchange import ChatExchange, ChatRequest, ChatTransport
from transports.client.h3 import H3Exchange
from transports.client.race import DEFAULT_RACE_DELAY, MAX_RACE_DELAY, head_start, race_quic_against_tcp
from transports.client.results import ChatResult, Negotiation
from transports.client.stream import ChatStream
from transports.client.tcp import HttpxTransport
from transports.h3_client import (
    H3_NO_ERROR,
    H3_REQUEST_REJECTED,
    H3_VERSION_FALLBACK,
    H3ClientConnection,
    H3ConnectionLost,
    H3StreamReset,
    QuicConnectError,
    Verify,
)

log = logging.getLogger("sluicegate.client")

MAX_TRIES = 4
TRANSPORTS = ("auto", "h3", "h2", "h1", "grpc-web")
_RANK = {"h1": 1, "h2": 2, "h3": 3}
USER_AGENT = "sluicegate-client/0.1"


@dataclass
class _QuicAttempt:
    """One QUIC handshake to an alternative, shared by the requests that race it."""

    key: tuple[str, str, int]
    task: asyncio.Task[H3ClientConnection]
    tcp_won: bool = False
    reported: bool = False


@dataclass
class _LiveQuic:
    """An origin's QUIC connection, with the requests on it; a retired one closes when they end."""

    key: tuple[str, str, int]
    conn: H3ClientConnection
    in_use: int = 0
    retired: bool = False


class SluicegateClient:
    """Async chat-completions client with transport negotiation (see docs/client.md).

    ``transport``: "auto" (negotiate), or "h3" / "h2" / "h1" / "grpc-web" to use only that one
    (no fallback, no downgrade). ``clock`` drives the Alt-Svc and broken-alternative memories
    (inject one to test expiry). ``grpc_web``: True for the built-in gRPC-Web transport, False to
    refuse gRPC-Web even when the server directs it, or a ``ChatTransport`` of your own; it is used
    when ``transport="grpc-web"`` or when the server directs it.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        verify: Verify = True,
        transport: str = "auto",
        headers: dict[str, str] | None = None,
        h2c: bool = False,
        connect_timeout: float = 10.0,
        read_timeout: float | None = 300.0,
        race_delay: float = DEFAULT_RACE_DELAY,
        max_race_delay: float = MAX_RACE_DELAY,
        quic_handshake_timeout: float = 10.0,
        quic_idle_timeout: float = 60.0,
        downgrade_ttl: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
        grpc_web: ChatTransport | bool = True,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, not {transport!r}")
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base_url must be an http(s) URL, not {base_url!r}")
        if transport == "h3" and parts.scheme != "https":
            raise ValueError("HTTP/3 needs an https:// base URL")
        if transport == "grpc-web" and grpc_web is False:
            raise ValueError("transport='grpc-web' with grpc_web=False")
        self.base_url = base_url.rstrip("/")
        self.origin = origin_of(base_url)
        self.transport = transport
        self.verify = verify
        self.h2c = h2c
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.race_delay = race_delay
        self.max_race_delay = max_race_delay
        self.quic_handshake_timeout = quic_handshake_timeout
        self.quic_idle_timeout = quic_idle_timeout
        self.downgrade_ttl = downgrade_ttl
        self.clock = clock
        self.altsvc = AltSvcCache(clock)
        self.broken = BrokenAlternatives(clock)
        self._grpc_option = grpc_web
        self._grpc: ChatTransport | None = grpc_web if isinstance(grpc_web, ChatTransport) else None
        self._headers = [("user-agent", USER_AGENT), *((k.lower(), v) for k, v in (headers or {}).items())]
        if api_key:
            self._headers.append(("authorization", f"Bearer {api_key}"))
        self._caps: dict[str, tuple[str, float]] = {}
        self._srtt: dict[tuple[str, str, int], float] = {}
        self._quic: dict[str, _LiveQuic] = {}
        self._retired: list[_LiveQuic] = []
        self._attempts: dict[tuple[str, str, int], _QuicAttempt] = {}
        self._tcp: dict[str, HttpxTransport] = {}
        self._background: set[asyncio.Task[Any]] = set()

    # public API

    def stream_chat(self, model: str, messages: list[dict[str, Any]], **params: Any) -> ChatStream:
        """A streamed chat completion: ``async for token in client.stream_chat(...)``."""
        return ChatStream(self, self._request(model, messages, params, stream=True))

    async def complete_chat(self, model: str, messages: list[dict[str, Any]], **params: Any) -> ChatResult:
        """A whole chat completion (``stream: false``), negotiated like a stream."""
        request = self._request(model, messages, params, stream=False)
        nego = Negotiation()
        try:
            while True:
                exchange = await self._open(request, nego)
                try:
                    body = await exchange.read()
                except Exception as exc:
                    await exchange.aclose()
                    if await self._recover(exc, request, nego, True):
                        continue
                    wrapped = self._wrap(exc, nego, exchange.transport)
                    if wrapped is exc:
                        raise
                    raise wrapped from exc
                await exchange.aclose()
                break
        finally:
            self._after_exchange(nego)
        if exchange.status >= 300:
            retry_after = parse_retry_after(exchange.header("retry-after"))
            raise error_from_body(exchange.status, body, retry_after, exchange.transport)
        try:
            raw = json.loads(body)
            choice = raw["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            raise SluicegateError(
                "malformed completion body", status=exchange.status, transport=exchange.transport
            ) from None
        message = choice.get("message") or {}
        return ChatResult(
            text=message.get("content") or choice.get("text") or "",
            transport=exchange.transport,
            finish_reason=choice.get("finish_reason"),
            usage=raw.get("usage"),
            raw=raw,
            negotiation=nego,
        )

    def transport_cap(self, origin: str | None = None) -> str:
        """The best transport the server currently allows for ``origin`` (the base origin by default)."""
        return self._cap(origin or self.origin)

    async def wait_background(self) -> None:
        """Wait for QUIC handshakes that lost a race to finish (and mark or confirm h3)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    async def close_connections(self) -> None:
        """Close pooled connections but keep what was learnt (Alt-Svc, broken marks, RTTs, caps).

        For a network change, or to make the next request negotiate from scratch.
        """
        for live in [*self._quic.values(), *self._retired]:
            await live.conn.aclose()
        self._quic.clear()
        self._retired.clear()
        for tcp in list(self._tcp.values()):
            await tcp.aclose()
        self._tcp.clear()
        if self._grpc is not None and not isinstance(self._grpc_option, ChatTransport):
            await self._grpc.aclose()  # the built-in one: made again on demand
            self._grpc = None

    async def aclose(self) -> None:
        """Close every connection and stop background handshakes."""
        for attempt in list(self._attempts.values()):
            attempt.task.cancel()
        await asyncio.gather(*list(self._background), return_exceptions=True)
        await self.close_connections()
        if self._grpc is not None:
            await self._grpc.aclose()

    async def __aenter__(self) -> SluicegateClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # requests

    def _request(
        self, model: str, messages: list[dict[str, Any]], params: dict[str, Any], stream: bool
    ) -> ChatRequest:
        parts = urlsplit(self.base_url)
        prefix = parts.path.rstrip("/")
        path = prefix + ("/chat/completions" if prefix.endswith("/v1") else "/v1/chat/completions")
        payload = {"model": model, "messages": messages, **params, "stream": stream}
        headers = [
            *self._headers,
            ("content-type", "application/json"),
            ("accept", "text/event-stream" if stream else "application/json"),
        ]
        host = (parts.hostname or "").lower()
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return ChatRequest(
            url=f"{parts.scheme}://{parts.netloc}{path}",
            origin=self.origin,
            scheme=parts.scheme,
            host=host,
            port=port,
            authority=parts.netloc,
            path=path,
            headers=headers,
            payload=payload,
            body=json.dumps(payload, separators=(",", ":")).encode(),
            stream=stream,
        )

    def _grpc_web(self) -> ChatTransport:
        if self._grpc is None:
            from transports.client.grpc_web import GrpcWebTransport  # protobuf: loaded on first use

            self._grpc = GrpcWebTransport(self.verify, self.connect_timeout, self.read_timeout)
        return self._grpc

    def _tcp_transport(self, kind: str) -> HttpxTransport:
        tcp = self._tcp.get(kind)
        if tcp is None:
            tcp = self._tcp[kind] = HttpxTransport(kind, self.verify, self.connect_timeout, self.read_timeout)
        return tcp

    async def _open(self, request: ChatRequest, nego: Negotiation) -> ChatExchange:
        """Negotiate and send; retry on server-directed downgrades and early transport failures."""
        loop = asyncio.get_running_loop()
        if not nego.started:
            nego.started = loop.time()
        while True:
            nego.tries += 1
            try:
                exchange = await self._open_once(request, nego)
            except (SluicegateError, asyncio.CancelledError):
                raise
            except Exception as exc:
                if await self._recover(exc, request, nego, False):
                    continue
                self._after_exchange(nego)
                wrapped = self._wrap(exc, nego, nego.current)
                if wrapped is exc:
                    raise
                raise wrapped from exc
            nego.transport = exchange.transport
            nego.headers_after = loop.time() - nego.started
            self._observe(request, exchange, nego)
            if exchange.status >= 300 and self._directed_retry(request, exchange, nego):
                with contextlib.suppress(Exception):
                    await exchange.aclose()
                self._after_exchange(nego)
                continue
            return exchange

    async def _open_once(self, request: ChatRequest, nego: Negotiation) -> ChatExchange:
        mode = self.transport
        if mode == "grpc-web" or (
            mode == "auto" and self._cap(request.origin) == "grpc-web" and self._grpc_option is not False
        ):
            nego.current = "grpc-web"
            return await self._grpc_web().open(request)
        if mode == "h3":
            nego.current = "h3"
            conn = await self._forced_h3(request)
            return await self._h3_open(conn, request, nego)
        if mode in ("h2", "h1"):
            return await self._tcp_open(mode, request, nego)
        cap = self._cap(request.origin)
        if request.scheme == "http":
            return await self._tcp_open("h2" if self.h2c and cap != "h1" else "h1", request, nego)
        if cap == "h3" and not nego.avoid_h3:
            live = self._live_quic(request.origin)
            if live is not None:
                nego.h3_reused = True
                nego.note("h3: reusing the open QUIC connection")
                return await self._h3_open(live, request, nego)
            alt = self.altsvc.lookup(request.origin, "h3")
            if alt is not None:
                host, port = alt.authority(request.host)
                key = (request.origin, host, port)
                if self.broken.is_broken(key):
                    nego.note(f"h3 at {host}:{port} is marked broken: straight to TCP")
                else:
                    winner = await self._race(request, key, nego)
                    if winner is not None:
                        return await self._h3_open(winner, request, nego)
                    return await self._tcp_open("auto", request, nego)
        return await self._tcp_open("h1" if cap == "h1" else "auto", request, nego)

    async def _tcp_open(self, kind: str, request: ChatRequest, nego: Negotiation) -> ChatExchange:
        nego.current = kind
        return await self._tcp_transport(kind).open(request)

    async def _h3_open(
        self, conn: H3ClientConnection, request: ChatRequest, nego: Negotiation
    ) -> ChatExchange:
        nego.current = "h3"
        nego.h3_conn = conn
        live = self._quic.get(request.origin)
        if live is not None and live.conn is conn:
            live.in_use += 1
        response = await conn.request(
            "POST",
            request.authority,
            request.path,
            [(k, v) for k, v in request.headers if k != "host"],
            request.body,
            read_timeout=self.read_timeout,
        )
        return H3Exchange(response, self.read_timeout)

    def _after_exchange(self, nego: Negotiation) -> None:
        """An exchange is over: let a retired QUIC connection close once its last request ends."""
        conn, nego.h3_conn = nego.h3_conn, None
        if conn is None:
            return
        for origin, live in list(self._quic.items()):
            if live.conn is conn:
                live.in_use = max(0, live.in_use - 1)
                if live.retired and live.in_use == 0:
                    del self._quic[origin]
                    self._spawn(conn.aclose())
                return
        for retired in self._retired:
            if retired.conn is conn:
                retired.in_use = max(0, retired.in_use - 1)
                if retired.in_use == 0:
                    self._retired.remove(retired)
                    self._spawn(conn.aclose())
                return

    # QUIC and the race

    def _live_quic(self, origin: str) -> H3ClientConnection | None:
        live = self._quic.get(origin)
        if live is None:
            return None
        if not live.conn.is_usable:
            del self._quic[origin]
            self._spawn(live.conn.aclose())
            return None
        return live.conn

    def _retire_quic(self, origin: str) -> None:
        """No new requests on the origin's QUIC connection; close it when its requests finish."""
        live = self._quic.pop(origin, None)
        if live is None:
            return
        if live.in_use == 0:
            self._spawn(live.conn.aclose())
        else:
            live.retired = True
            self._retired.append(live)

    def _install_quic(self, origin: str, key: tuple[str, str, int], conn: H3ClientConnection) -> None:
        """Make ``conn`` the origin's QUIC connection. One it replaces (a concurrent request's
        handshake finished first) is retired, so it closes when its requests end, not leaked."""
        old = self._quic.get(origin)
        if old is not None and old.conn is not conn:
            self._retire_quic(origin)
        self._quic[origin] = _LiveQuic(key, conn)

    def _race_delay_for(self, key: tuple[str, str, int]) -> float:
        return head_start(self._srtt.get(key), self.race_delay, self.max_race_delay)

    def _quic_attempt(self, request: ChatRequest, key: tuple[str, str, int]) -> _QuicAttempt:
        attempt = self._attempts.get(key)
        if attempt is None or attempt.task.done():
            task = asyncio.ensure_future(self._connect_quic(request, key))
            attempt = self._attempts[key] = _QuicAttempt(key, task)
            self._track(task)
        return attempt

    async def _quic_handshake(self, request: ChatRequest, key: tuple[str, str, int]) -> H3ClientConnection:
        """A QUIC connection to the alternative ``key`` (SNI: the origin's host); its RTT is kept."""
        _, host, port = key
        conn = await H3ClientConnection.connect(
            host,
            port,
            server_name=request.host,
            verify=self.verify,
            handshake_timeout=self.quic_handshake_timeout,
            idle_timeout=self.quic_idle_timeout,
        )
        if conn.smoothed_rtt:
            self._srtt[key] = conn.smoothed_rtt
        return conn

    async def _connect_quic(self, request: ChatRequest, key: tuple[str, str, int]) -> H3ClientConnection:
        try:
            conn = await self._quic_handshake(request, key)
        except QuicConnectError:
            attempt = self._attempts.get(key)
            if attempt is not None and attempt.tcp_won:
                self._mark_h3_broken(attempt)
            raise
        finally:
            attempt = self._attempts.get(key)
            if attempt is not None and attempt.task is asyncio.current_task():
                del self._attempts[key]
        self.broken.confirm(key)
        if self._cap(request.origin) != "h3" or self.altsvc.lookup(request.origin, "h3") is None:
            await conn.aclose()  # told to stop using h3 while the handshake ran
            raise QuicConnectError("h3 no longer allowed for this origin")
        self._install_quic(request.origin, key, conn)
        return conn

    def _mark_h3_broken(self, attempt: _QuicAttempt) -> None:
        if not attempt.reported:
            attempt.reported = True
            self._mark_broken(attempt.key)

    def _mark_broken(self, key: tuple[str, str, int]) -> None:
        delay = self.broken.mark_broken(key)
        log.info("h3 at %s:%d for %s marked broken for %.0f s", key[1], key[2], key[0], delay)

    def _tcp_won(self, attempt: _QuicAttempt) -> None:
        """TCP worked in a race: a QUIC failure, now or later, marks h3 broken (Chromium's rule)."""
        attempt.tcp_won = True
        task = attempt.task
        if task.done() and (task.cancelled() or task.exception() is not None):
            self._mark_h3_broken(attempt)

    async def _race(
        self, request: ChatRequest, key: tuple[str, str, int], nego: Negotiation
    ) -> H3ClientConnection | None:
        """QUIC vs TCP, TCP held back: the QUIC connection if it wins, None when TCP is ready."""
        attempt = self._quic_attempt(request, key)
        return await race_quic_against_tcp(
            attempt.task,
            self._race_delay_for(key),
            lambda: self._tcp_transport("auto"),
            request,
            nego,
            lambda: self._tcp_won(attempt),
        )

    async def _forced_h3(self, request: ChatRequest) -> H3ClientConnection:
        """``transport="h3"``: the open QUIC connection, or a handshake without a race."""
        live = self._live_quic(request.origin)
        if live is not None:
            return live
        alt = self.altsvc.lookup(request.origin, "h3")
        host, port = alt.authority(request.host) if alt else (request.host, request.port)
        key = (request.origin, host, port)
        conn = await self._quic_handshake(request, key)
        self._install_quic(request.origin, key, conn)
        return conn

    # what the server said

    def _cap(self, origin: str) -> str:
        cap = self._caps.get(origin)
        if cap is None:
            return "h3"
        if self.clock() >= cap[1]:
            del self._caps[origin]
            return "h3"
        return cap[0]

    def _set_cap(
        self, origin: str, level: str, ttl: float, why: str, nego: Negotiation | None = None
    ) -> None:
        if level == "h3":
            self._caps.pop(origin, None)
            return
        self._caps[origin] = (level, self.clock() + ttl)
        if level != "grpc-web" and _RANK[level] < 3:
            self._retire_quic(origin)
        if nego is not None:
            nego.note(f"server directed {level} ({why}) for {ttl:.0f} s")
        log.info("%s: at most %s for %.0f s (%s)", origin, level, ttl, why)

    def _observe(self, request: ChatRequest, exchange: ChatExchange, nego: Negotiation) -> None:
        """Take in what a response says about transports: Alt-Svc and the downgrade header."""
        alt_svc = exchange.header_values("alt-svc")
        if alt_svc:
            self.altsvc.update(request.origin, alt_svc)
            if self.altsvc.lookup(request.origin, "h3") is None and request.origin in self._quic:
                nego.note("Alt-Svc no longer offers h3: retiring the QUIC connection")
                self._retire_quic(request.origin)
        directive = exchange.header(DOWNGRADE_HEADER)
        if directive:
            parsed = parse_downgrade(directive)
            if parsed is None:
                log.warning("ignoring malformed %s: %r", DOWNGRADE_HEADER, directive)
            else:
                level, ttl = parsed
                if level == "grpc-web" and self._grpc_option is False:
                    nego.note("server asked for gRPC-Web, which this client has not been given")
                else:
                    self._set_cap(
                        request.origin,
                        level,
                        ttl if ttl is not None else self.downgrade_ttl,
                        DOWNGRADE_HEADER,
                        nego,
                    )

    def _directed_retry(self, request: ChatRequest, exchange: ChatExchange, nego: Negotiation) -> bool:
        """After an error status, was the server telling us to come back another way?"""
        if self.transport != "auto" or nego.tries >= MAX_TRIES:
            return False
        if exchange.status == 421 and exchange.transport == "h3":
            nego.avoid_h3 = True
            nego.note("421 Misdirected Request over h3: retrying over TCP")
            return True
        if exchange.header(DOWNGRADE_HEADER):
            cap = self._cap(request.origin)
            if cap == "grpc-web" and self._grpc_option is not False and exchange.transport != "grpc-web":
                return True
            if cap in _RANK and _RANK[cap] < _RANK.get(exchange.transport, 0):
                nego.note(f"HTTP {exchange.status} with {DOWNGRADE_HEADER}: retrying over {cap}")
                return True
        return False

    async def _recover(
        self, exc: BaseException, request: ChatRequest, nego: Negotiation, after_headers: bool
    ) -> bool:
        """Decide whether a failure (before any token was delivered) is retried another way."""
        if self.transport != "auto" or nego.tries >= MAX_TRIES:
            return False
        if nego.current == "h3":
            conn = nego.h3_conn
            self._after_exchange(nego)
            if isinstance(exc, H3StreamReset):
                if exc.error_code == H3_VERSION_FALLBACK:
                    self._set_cap(request.origin, "h1", self.downgrade_ttl, "H3_VERSION_FALLBACK", nego)
                    return True
                nego.avoid_h3 = True
                kind = (
                    "H3_REQUEST_REJECTED"
                    if exc.error_code == H3_REQUEST_REJECTED
                    else f"0x{exc.error_code:x}"
                )
                nego.note(f"h3 stream reset ({kind}) before any token: retrying over TCP")
                return True
            if isinstance(exc, TimeoutError):
                return False  # the server may be generating: a retry could double the work
            live = self._quic.get(request.origin)
            key = live.key if live is not None else None
            if live is not None and (conn is None or live.conn is conn):
                del self._quic[request.origin]
                self._spawn(live.conn.aclose())
            graceful = isinstance(exc, H3ConnectionLost) and exc.error_code in (0, H3_NO_ERROR)
            if nego.h3_reused and graceful and not after_headers:
                nego.note("the reused QUIC connection had closed: negotiating again")
                nego.h3_reused = False
                return True
            nego.avoid_h3 = True
            if key is not None:
                self._mark_broken(key)
            nego.h3_error = str(exc)
            nego.note(f"h3 failed after the handshake ({exc}): marked broken, retrying over TCP")
            return True
        if nego.current in ("auto", "h2") and h2_error_code(exc) == HTTP_1_1_REQUIRED:
            if request.scheme == "http" and not self.h2c:
                return False
            self._set_cap(request.origin, "h1", self.downgrade_ttl, "HTTP_1_1_REQUIRED", nego)
            return True
        return False

    def _wrap(self, exc: BaseException, nego: Negotiation, transport: str | None) -> BaseException:
        if isinstance(exc, SluicegateError | SluicegateTransportError):
            return exc
        nego.note(f"{transport or '?'} failed: {type(exc).__name__}: {exc}")
        return SluicegateTransportError(
            f"{transport or 'transport'} failed: {type(exc).__name__}: {exc}", nego.attempts
        )

    # tasks

    def _spawn(self, coro: Awaitable[Any]) -> None:
        self._track(asyncio.ensure_future(coro))

    def _track(self, task: asyncio.Future[Any]) -> None:
        self._background.add(task)  # type: ignore[arg-type]
        task.add_done_callback(_forget(self._background))


def _forget(tasks: set[asyncio.Task[Any]]) -> Callable[[asyncio.Future[Any]], None]:
    def done(task: asyncio.Future[Any]) -> None:
        tasks.discard(task)  # type: ignore[arg-type]
        if not task.cancelled():
            task.exception()  # retrieved: a lost race is not an unhandled error

    return done
