"""The hot path: relay one inference request to a pod and its answer back to the client.

A raw ASGI handler, not a Starlette endpoint: at 100 concurrent streams every per-chunk layer of
Python (response wrappers, middleware send-wrappers, queues) costs a measurable share of a core.
Once the first token is out, the pod's bytes are spliced to the client's socket from the pod
connection's parser callback (see ``transports/pod_client.py``), untouched.

``Relay.__call__`` reads as the list of phases, each in its own module under ``gateway/phases/``
with its failure answer beside it (Pingora's ``ProxyHttp`` is the model):

1. read the head (``gateway/request_head.py``): the headers the gateway acts on, in one pass;
2. authenticate (``phases/authenticate.py``): the caller's key → its id, tier, models (401, 403);
3. admit (here and ``gateway/admit.py``): the JSON body within its size and deadline (400, 408,
   413, 415);
4. route (``phases/route.py``): a canary route's variant for the public model (sticky cohorts);
5. limit (``phases/limit.py``): the request's size against its tier, the caller's quota (400, 429);
6. pick (``phases/pick.py``): a routable pod of that variant, or shed (404, 429, 503);
7. attempt (``phases/attempt.py``): connect and await the first token, retrying elsewhere while
   nothing was sent (502, 504); then relay (``gateway/stream_relay.py``, ``gateway/whole_answer.py``);
8. finish (``phases/finish.py``): quota settled, metrics, access log.

Response status and headers are held until the pod's first token has arrived, so any failure before
that is still answered with a proper status code.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any

from gateway.admit import ClientGone, InferenceRequest, parse_request, read_body, request_id
from gateway.canary.rollback import move_streams
from gateway.canary.rollouts import Rollouts
from gateway.config import Config
from gateway.cors import CorsPolicy
from gateway.disconnect_watch import DisconnectWatch
from gateway.errors import GatewayError
from gateway.exchange import Exchange, Receive, Scope, Send, transport_of
from gateway.metrics import GatewayMetrics
from gateway.phases.attempt import upstream_headers
from gateway.phases.authenticate import KeyLookup
from gateway.phases.finish import finish
from gateway.phases.path import RequestPath
from gateway.pods.registry import PodRegistry
from gateway.quota import Quotas
from gateway.request_head import RequestHead
from transports.deadline import Deadline
from transports.hangups import HangupWatcher
from transports.pod_client import PodClient

# Re-exported: the app and the gRPC-Web endpoint import the ASGI types from here.
__all__ = [
    "DisconnectWatch", "Exchange", "Receive", "Relay", "Scope", "Send", "transport_of", "upstream_headers",
]

log = logging.getLogger("sluicegate.relay")

_JSON = b"application/json"
_UNSUPPORTED_TYPE = GatewayError(
    415,
    "The request body must be JSON, sent with 'Content-Type: application/json'.",
    "invalid_request_error",
    "unsupported_media_type",
)


class Relay:
    """Serves the OpenAI inference routes (``gateway.admit.ROUTES``) against the pod registry."""

    def __init__(
        self,
        config: Config,
        registry: PodRegistry,
        metrics: GatewayMetrics,
        client: Callable[[], PodClient],
        keys: KeyLookup | None = None,
        quotas: Quotas | None = None,
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        self.keys = keys
        self.quotas = quotas
        self._client = client
        # Set by the server when it listens for HTTP/3: answers over TCP advertise it (RFC 7838),
        # e.g. b'h3=":8443"; ma=86400'; b"clear" tells clients to forget an earlier advertisement.
        self.alt_svc: bytes | None = None
        self.draining = False
        self._active: dict[Exchange, asyncio.Task[Any]] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self.path = RequestPath.build(config, registry, metrics, client, keys, quotas)
        self.rollouts = Rollouts(config, self.path.route)
        self.rollouts.on_rollback = functools.partial(move_streams, self)
        self._watch_keys: asyncio.Task[None] | None = None
        self.tracer: Any = None  # gateway.tracing.Tracing; imported only when on (restart-only setting)
        if config.tracing.enabled:
            from gateway.tracing import start_tracing

            self.tracer = start_tracing(config.tracing)

    @property
    def config(self) -> Config:
        return self.path.config

    @property
    def hangups(self) -> HangupWatcher | None:
        return self.path.attempt.hangups

    @hangups.setter
    def hangups(self, watcher: HangupWatcher | None) -> None:
        self.path.attempt.hangups = watcher

    async def start(self) -> None:
        """Background work of the request path while the app runs: key store reloads, quota leases."""
        watch = getattr(self.keys, "watch", None)
        if watch is not None:
            self._watch_keys = asyncio.create_task(watch(), name="key-store")
        if self.quotas is not None:
            await self.quotas.start()

    async def close(self) -> None:
        if self._watch_keys is not None:
            self._watch_keys.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_keys
            self._watch_keys = None
        if self.quotas is not None:
            await self.quotas.close()
        if self.tracer is not None:
            await self.tracer.close()  # flushes the spans still queued, within a bound
        self.path.shadow.close()

    def reconfigure(self, config: Config, quotas: Quotas | None = None) -> None:
        """Take on a reloaded ``config`` (``gateway.reload``): its request path is built beside the
        running one and swapped in by one assignment, so each request runs on one config from start
        to end and those in flight finish on the old one. The rollouts keep the state of every route
        whose plan is unchanged. ``quotas``: the counters when the reload is the first to set a quota."""
        self.quotas = quotas if quotas is not None else self.quotas
        path = RequestPath.build(
            config, self.registry, self.metrics, self._client, self.keys, self.quotas, previous=self.path
        )
        self.rollouts.reconfigure(config, path.route)  # the new routers get each rollout's weights
        self.path = path

    @property
    def in_flight(self) -> int:
        return len(self._active)

    def exchanges(self) -> list[Exchange]:
        """The requests in flight now (a copy: they may end while the caller looks at them)."""
        return list(self._active)

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests; wait for those in flight, and end the rest at the deadline."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            cut = GatewayError(
                503,
                "The gateway is shutting down; retry the request.",
                "service_unavailable",
                "shutting_down",
                headers=(("retry-after", "1"),),
            )
            for ex, task in list(self._active.items()):
                ex.cut = cut
                task.cancel()
            await self._idle.wait()

    async def __call__(self, scope: Scope, receive: Receive, send: Send, route: str) -> None:
        path = self.path  # one config's phases for the whole request, whatever a reload swaps in
        head = path.heads.read(scope["headers"])
        task = asyncio.current_task()
        assert task is not None
        ex = Exchange(route, request_id(head.request_id), send, transport_of(scope), task)
        if self.tracer is not None:
            ex.span = self.tracer.start(ex, head, scope)
        if ex.transport != "h3":
            ex.alt_svc = self.alt_svc
        direct = "sluicegate.transport" not in scope  # gRPC-Web answers for its own envelope and CORS
        if direct and head.origin is not None:
            ex.answer_headers.extend(path.cors.response_headers(head.origin))
        if path.log_access:
            peer = scope.get("client")
            ex.client = path.clients.of(peer[0] if peer else None, head.forwarded_for)
        self._active[ex] = task
        self._idle.clear()
        try:
            if self.draining:
                raise GatewayError(
                    503,
                    "The gateway is shutting down; retry the request.",
                    "service_unavailable",
                    "draining",
                    headers=(("retry-after", "1"), ("connection", "close")),
                )
            if scope["method"] != "POST":
                if scope["method"] == "OPTIONS" and direct:
                    await self._preflight(ex, head, path.cors)
                    return
                raise GatewayError(
                    405,
                    f"Method {scope['method']} is not allowed here; use POST.",
                    "invalid_request_error",
                    "method_not_allowed",
                    headers=(("allow", "POST, OPTIONS"),),
                )
            ex.caller = caller = path.authenticate.caller(head)
            ex.tier = caller.tier
            req = await self._admit(ex, receive, head, route, direct, path.max_body)
            path.authenticate.authorize(caller, req.model)
            ex.req = req = path.route.choose(ex, req, head)
            ex.criticality = path.pick.criticality(ex.tier, head)
            ex.set_budget(path.timeouts.budget(req.model, ex.tier, head.timeout_ms))
            ex.req = req = await path.limit.admit(ex, req)
            path.pick.affinity(ex, req, head)
            pod = path.pick.pod(ex, req)
            if path.shadow.active:  # a canary route with shadow traffic: maybe a copy, on its own task
                path.shadow.maybe_mirror(ex, req, head.headers)
            req = path.pick.maybe_degrade(ex, req, pod)
            ex.headers = head.headers
            await path.attempt.serve(ex, req, pod, receive)
        except GatewayError as err:
            ex.status = err.status
            ex.detail = str(err.code or err.type)
            if err.type == "timeout":
                self.metrics.timeouts.labels(str(err.code)).inc()
            await _send_error(send, err, ex)
        except ClientGone:
            ex.status = 499
            ex.detail = "client_gone"
        except Exception:
            # A bug, not a pod or client problem: log it, and still answer in the OpenAI shape.
            log.exception("unexpected error relaying request %s", ex.rid)
            ex.detail = "internal_error"
            if ex.status == 0:
                ex.status = 500
                await _send_error(send, GatewayError(500, "Internal gateway error.", "server_error"), ex)
        finally:
            if ex.shadow is not None:
                path.shadow.ended(ex)  # a client that left takes its shadow copy with it
            del self._active[ex]
            if not self._active:
                self._idle.set()
            finish(ex, self.metrics, path.log_access, path.log_json, self.rollouts)

    async def _admit(
        self, ex: Exchange, receive: Receive, head: RequestHead, route: str, direct: bool, max_body: int
    ) -> InferenceRequest:
        """The request's JSON body, whole, within the size limit and the body deadline."""
        if direct and not _is_json(head.content_type):
            # A browser sends text/plain or a form cross-origin without asking first (a CORS
            # "simple" request): only a JSON body proves the caller passed the preflight.
            raise _UNSUPPORTED_TYPE
        # The whole body within the body deadline, whatever the transport. Every HTTP/1.1 listener's
        # protocol (``GuardedH1Protocol``) enforces it, and an idle one, itself from the head's end:
        # a second timer here would be made and cancelled for every request. This one bounds an
        # HTTP/2 or HTTP/3 body that trickles (and gRPC-Web's, which names its own transport).
        seconds = self.config.server.limits.body_timeout_s
        try:
            if ex.transport == "h1":
                body = await read_body(receive, head.content_length, max_body)
            else:
                with Deadline(ex.task, ex.t0 + seconds):
                    body = await read_body(receive, head.content_length, max_body)
        except TimeoutError:
            raise GatewayError(
                408, f"The request body did not arrive within {seconds:g} s.",
                "invalid_request_error", "request_timeout",
            ) from None
        ex.req = req = parse_request(route, body)
        return req

    async def _preflight(self, ex: Exchange, head: RequestHead, cors: CorsPolicy) -> None:
        """A browser asks whether its page may call this route: the CORS policy answers, no pod."""
        method = requested = None
        for name, value in head.headers:
            if name == b"access-control-request-method":
                method = value
            elif name == b"access-control-request-headers":
                requested = value
        status, headers = cors.preflight(head.origin, method, requested)
        ex.status = status
        ex.detail = "preflight"
        headers = [*headers, (b"content-length", b"0"), (b"x-request-id", ex.rid.encode())]
        await ex.send({"type": "http.response.start", "status": status, "headers": headers})
        await ex.send({"type": "http.response.body", "body": b"", "more_body": False})


def _is_json(content_type: bytes | None) -> bool:
    """``application/json``, with or without parameters (``; charset=utf-8``)."""
    if content_type is None:
        return False
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == _JSON


async def _send_error(send: Send, err: GatewayError, ex: Exchange) -> None:
    body = err.body()
    headers = [
        (b"content-type", _JSON),
        (b"content-length", str(len(body)).encode()),
        (b"x-request-id", ex.rid.encode()),
    ]
    if ex.alt_svc is not None:
        headers.append((b"alt-svc", ex.alt_svc))
    headers.extend(ex.answer_headers)
    headers.extend((k.encode(), v.encode()) for k, v in err.headers)
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
