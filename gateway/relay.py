"""The hot path: relay one inference request to a pod and its answer back to the client.

A raw ASGI handler, not a Starlette endpoint: at 100 concurrent streams every per-chunk layer of
Python (response wrappers, middleware send-wrappers, queues) costs a measurable share of a core.
Once the first token is out, the pod's bytes are spliced to the client's socket from the pod
connection's parser callback (see ``transports/pod_client.py``), untouched.

Phases, in order, each a small method below: admit → pick → connect → await first token → relay →
finish. One ``Exchange`` object carries what each phase learned. Response status and headers are
held until the pod's first token has arrived, so any failure before that is still answered with a
proper status code.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.admit import ClientGone, InferenceRequest, parse_request, read_body, request_id
from gateway.affinity import affinity_key
from gateway.completeness import FinishWatch, choices_of, incomplete
from gateway.config import Config
from gateway.deadlines import Budget, TimeoutPolicy, timed_out
from gateway.degrade import as_sse, non_streaming_body
from gateway.errors import (
    GatewayError,
    model_not_found,
    no_capacity,
    overloaded,
    upstream_failed,
    upstream_truncated,
)
from gateway.metrics import GatewayMetrics
from gateway.pods.registry import Pod, PodRegistry
from gateway.request_limits import enforce as enforce_limits
from gateway.request_limits import limits_by_tier
from gateway.resume import Recorder, Splicer, Transcript, continuation_body, unsupported_reason
from gateway.retries import Retryable, RetryBudget, backoff_s
from transports import sse
from transports.client_socket import client_socket
from transports.h1_disconnect import client_socket_of, trip_on_disconnect
from transports.hangups import HangupWatcher, Pairing
from transports.pod_client import (
    PodBrokenError,
    PodClient,
    PodConnectError,
    PodConnectTimeout,
    PodLineTooLong,
    PodResponse,
    PodStalledError,
    StallWatch,
)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

access_log = logging.getLogger("sluicegate.access")
log = logging.getLogger("sluicegate.relay")

ROUTE_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
_JSON = b"application/json"
_SSE_HEADERS = ((b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"))

_CRITICALITY_RANK = {"sheddable": 0, "standard": 1, "critical": 2}

# Not forwarded to pods: hop-by-hop headers, ones the upstream client sets itself, and the
# client's credentials for the gateway (pods are reached with the gateway's own identity).
_NOT_FORWARDED = frozenset(
    {
        b"host",
        b"content-length",
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
        b"expect",
        b"proxy-authorization",
        b"proxy-connection",
        b"accept-encoding",
        b"authorization",
        b"x-request-id",
        b"content-type",
    }
)


def upstream_headers(headers: list[tuple[bytes, bytes]], rid: str) -> list[tuple[bytes, bytes]]:
    """The client's end-to-end headers for the pod, plus the request id and identity encoding.

    The body was validated as JSON, so it is labelled as such whatever the client said (curl's
    ``-d`` sends a form content type, which vLLM would refuse).
    """
    out = [(name, value) for name, value in headers if name not in _NOT_FORWARDED]
    out.append((b"content-type", b"application/json"))
    out.append((b"accept-encoding", b"identity"))
    out.append((b"x-request-id", rid.encode()))
    return out


class DisconnectWatch:
    """Closes the pod answer and cancels the request's task the moment the client goes away.

    uvicorn reports a disconnect only through ``receive()``, and a ``send()`` to a closed
    connection silently does nothing; without this watch a stream whose client left would keep
    the pod generating until its natural end. Under uvicorn's HTTP/1.1 a tripwire calls back from
    the protocol's own I/O callback, and the hang-up watcher's thread shuts the pod socket down even
    before that; under any other server a task awaits ``receive()``.
    """

    __slots__ = ("_hangups", "_pairing", "_task", "_tripwire", "_upstream", "_watcher", "finished", "gone")

    def __init__(self, receive: Receive, hangups: HangupWatcher | None) -> None:
        self.gone = False
        self.finished = False
        self._upstream: PodResponse | None = None
        self._task = asyncio.current_task()
        self._watcher: asyncio.Future[None] | None = None
        self._hangups = hangups
        self._pairing: Pairing | None = None
        self._tripwire = trip_on_disconnect(receive, self._client_gone)
        if self._tripwire is None:
            self._watcher = asyncio.ensure_future(self._watch(receive))
        elif hangups is not None and not self.gone:
            client = client_socket_of(receive)
            if client is not None:
                self._pairing = hangups.pair(client)

    @property
    def upstream(self) -> PodResponse | None:
        """The pod answer in progress, closed the moment the client leaves. Set it to None before
        the answer's connection goes back to the pool."""
        return self._upstream

    @upstream.setter
    def upstream(self, resp: PodResponse | None) -> None:
        self._upstream = resp
        if self._pairing is not None:
            assert self._hangups is not None
            self._hangups.set_upstream(self._pairing, resp.socket if resp is not None else None)

    def _client_gone(self) -> None:
        if not self.finished and self._task is not None:
            self.gone = True
            if self._upstream is not None:
                self._upstream.close()
            self._task.cancel()

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self._client_gone()
                return

    def close(self) -> None:
        if self._tripwire is not None:
            self._tripwire.disarm()
        if self._watcher is not None:
            self._watcher.cancel()
        if self._pairing is not None:
            assert self._hangups is not None
            self._hangups.unpair(self._pairing)
            self._pairing = None


class Exchange:
    """One request's context: what it asked, where it went, what happened (for logs and metrics)."""

    __slots__ = (
        "affinity",
        "alt_svc",
        "attempts",
        "budget",
        "chunks",
        "criticality",
        "cut",
        "deadline",
        "degraded",
        "detail",
        "first_token_at",
        "headers",
        "held",
        "model_label",
        "pod",
        "req",
        "resumes",
        "rid",
        "route",
        "send",
        "started",
        "status",
        "t0",
        "tier",
        "transport",
        "tried",
        "ttft",
        "watch",
    )

    def __init__(self, route: str, rid: str, send: Send, transport: str = "h1") -> None:
        self.route = route
        self.transport = transport
        self.alt_svc: bytes | None = None  # the Alt-Svc value to send, over TCP when HTTP/3 is offered
        self.rid = rid
        self.send = send
        self.started = time.perf_counter()
        self.t0 = asyncio.get_running_loop().time()  # deadlines are on the loop's clock
        self.budget: Budget | None = None
        self.tier: str | None = None
        self.criticality = "standard"
        self.affinity: str | None = None  # the request's affinity key, when affinity is configured
        self.degraded: bool | None = None  # served without streaming: whether a usage chunk is wanted
        self.deadline = self.first_token_at = 0.0
        self.req: InferenceRequest | None = None
        self.model_label = "unknown"  # a metric label: only models some pod serves
        self.pod: Pod | None = None
        self.watch: DisconnectWatch | None = None
        self.status = 0  # 0 until the status line has been sent
        self.ttft: float | None = None
        self.chunks = 0
        self.detail = "ok"
        self.cut: GatewayError | None = None  # set when the gateway itself ends the request
        self.attempts: list[str] = []  # one outcome per pod tried
        self.tried: list[Pod] = []
        self.resumes = 0
        self.held: list[tuple[Pod, PodResponse]] = []  # continuation pods and their answers
        self.headers: list[tuple[bytes, bytes]] = []

    def set_budget(self, budget: Budget) -> None:
        self.budget = budget
        self.deadline = self.t0 + budget.total_s
        self.first_token_at = self.t0 + budget.first_token_s

    def response_headers(self, content_type: bytes) -> list[tuple[bytes, bytes]]:
        assert self.pod is not None
        headers = [
            (b"content-type", content_type),
            (b"x-request-id", self.rid.encode()),
            (b"x-sluicegate-pod", self.pod.name.encode()),
        ]
        if self.alt_svc is not None:
            headers.append((b"alt-svc", self.alt_svc))
        return headers


class Relay:
    """Serves ``/v1/chat/completions`` and ``/v1/completions`` against the pod registry."""

    def __init__(
        self,
        config: Config,
        registry: PodRegistry,
        metrics: GatewayMetrics,
        client: Callable[[], PodClient],
    ) -> None:
        self.config = config
        self.registry = registry
        self.metrics = metrics
        self._client = client
        self.hangups: HangupWatcher | None = None  # set by the app while it runs
        # Set by the server when it listens for HTTP/3: answers over TCP advertise it (RFC 7838),
        # e.g. b'h3=":8443"; ma=86400'; b"clear" tells clients to forget an earlier advertisement.
        self.alt_svc: bytes | None = None
        self.timeouts = TimeoutPolicy(config)
        retries = config.retries
        self.retry_budget = RetryBudget(retries.budget_ratio, retries.min_retries_per_s)
        self.draining = False
        self._active: dict[Exchange, asyncio.Task[Any]] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._criticality_header = config.shedding.criticality_header.encode()
        self._limits = limits_by_tier(config)
        self._default_criticality = config.shedding.default_criticality

    def _gauge(self, pod: Pod) -> Any:
        return self.metrics.child(self.metrics.in_flight, pod.name)

    @property
    def in_flight(self) -> int:
        return len(self._active)

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
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        ex = Exchange(route, request_id(headers), send, transport_of(scope))
        if ex.transport != "h3":
            ex.alt_svc = self.alt_svc
        task = asyncio.current_task()
        assert task is not None
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
                raise GatewayError(
                    405,
                    f"Method {scope['method']} is not allowed here; use POST.",
                    "invalid_request_error",
                    "method_not_allowed",
                    headers=(("allow", "POST"),),
                )
            req = await self._admit(ex, receive, headers, route)
            ex.tier = self.timeouts.tier_of(headers)
            ex.req = req = enforce_limits(req, self._limits[ex.tier])
            ex.criticality = self._criticality(ex.tier, headers)
            affinity = self.config.affinity
            if affinity is not None and (not affinity.models or req.model in affinity.models):
                ex.affinity = affinity_key(affinity, req.payload, headers)
            pod = self._pick(ex, req)
            ex.set_budget(self.timeouts.budget(req.model, ex.tier, headers))
            req = self._maybe_degrade(ex, req, pod)
            await self._serve(ex, req, pod, headers, receive)
        except GatewayError as err:
            ex.status = err.status
            ex.detail = str(err.code or err.type)
            if err.type == "timeout":
                self.metrics.timeouts.labels(str(err.code)).inc()
            await _send_error(send, err, ex.rid, ex.alt_svc)
        except ClientGone:
            ex.status = 499
            ex.detail = "client_gone"
        except Exception:
            # A bug, not a pod or client problem: log it, and still answer in the OpenAI shape.
            log.exception("unexpected error relaying request %s", ex.rid)
            ex.detail = "internal_error"
            if ex.status == 0:
                ex.status = 500
                internal = GatewayError(500, "Internal gateway error.", "server_error")
                await _send_error(send, internal, ex.rid, ex.alt_svc)
        finally:
            del self._active[ex]
            if not self._active:
                self._idle.set()
            self._finish(ex)

    # -- admit and pick ------------------------------------------------------------------------

    async def _admit(
        self, ex: Exchange, receive: Receive, headers: list[tuple[bytes, bytes]], route: str
    ) -> InferenceRequest:
        body = await read_body(receive, headers, self.config.server.max_body_bytes)
        ex.req = req = parse_request(route, body)
        return req

    def _criticality(self, tier: str | None, headers: list[tuple[bytes, bytes]]) -> str:
        """The tier's criticality (else the default); a client's header may lower it, never raise it."""
        granted = self.config.tiers[tier].criticality if tier is not None else self._default_criticality
        for name, value in headers:
            if name == self._criticality_header:
                asked = value.decode("latin-1").strip().lower()
                if asked in _CRITICALITY_RANK and _CRITICALITY_RANK[asked] < _CRITICALITY_RANK[granted]:
                    return asked
        return granted

    def _pick(self, ex: Exchange, req: InferenceRequest) -> Pod:
        if not self.registry.knows(req.model):
            raise model_not_found(req.model)
        ex.model_label = req.model
        pod = self.registry.pick(req.model, criticality=ex.criticality, **self._affinity_of(ex))
        if pod is None:
            status, reason, retry_after = self.registry.shed_reason(req.model, ex.criticality)
            retry_after = min(retry_after, self.config.shedding.retry_after_max_s)
            self.metrics.child(self.metrics.shed, req.model, ex.criticality, reason).inc()
            if status == 429:
                raise overloaded(req.model, reason, retry_after)
            raise no_capacity(req.model, retry_after)
        ex.pod = pod
        return pod

    def _affinity_of(self, ex: Exchange) -> dict[str, Any]:
        if ex.affinity is None:
            return {}
        assert self.config.affinity is not None
        return {"affinity": ex.affinity, "max_load_factor": self.config.affinity.max_load_factor}

    def _maybe_degrade(self, ex: Exchange, req: InferenceRequest, pod: Pod) -> InferenceRequest:
        """The request as the pod gets it: without streaming when the tier degrades and the pod is slow."""
        if not req.stream or ex.tier is None:
            return req
        degrade = self.config.tiers[ex.tier].degrade
        p95 = pod.load.itl_p95_s
        if degrade is None or p95 is None or p95 * 1000 <= degrade.inter_token_p95_ms:
            return req
        if not pod.fresh(time.monotonic(), self.config.health.scrape.stale_after_s):
            return req
        body, ex.degraded = non_streaming_body(req.payload)
        self.metrics.child(self.metrics.degraded, req.model, ex.tier).inc()
        ex.req = degraded = InferenceRequest(req.route, req.model, False, body, req.payload)
        return degraded

    # -- connect, then relay -------------------------------------------------------------------

    async def _serve(
        self,
        ex: Exchange,
        req: InferenceRequest,
        pod: Pod,
        headers: list[tuple[bytes, bytes]],
        receive: Receive,
    ) -> None:
        """Attempts on one pod after another while failures are retryable, the client is here."""
        ex.watch = watch = DisconnectWatch(receive, self.hangups)
        loop = asyncio.get_running_loop()
        self.retry_budget.record_request(loop.time())
        tried = ex.tried
        ex.headers = headers
        try:
            while True:
                tried.append(pod)
                ex.pod = pod
                try:
                    await self._attempt(ex, req, pod, headers)
                    ex.attempts.append("ok")
                    self.metrics.child(self.metrics.upstream_attempts, "ok").inc()
                    return
                except GatewayError:
                    ex.attempts.append("failed")
                    self.metrics.upstream_attempts.labels("failed").inc()
                    raise
                except Retryable as failure:
                    ex.attempts.append(failure.outcome)
                    self.metrics.upstream_attempts.labels(failure.outcome).inc()
                    pod = self._retry_pod(ex, req, tried, failure)
                    await asyncio.sleep(
                        min(backoff_s(self.config.retries, len(tried)), max(0.0, ex.deadline - loop.time()))
                    )
        except asyncio.CancelledError:
            if not (watch.gone or ex.cut):
                raise
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            if watch.gone:
                ex.status = 499
                ex.detail = "client_gone"
                self.metrics.client_disconnects.labels(req.model).inc()
            elif ex.cut is not None:
                await self._end_cut(ex)
        finally:
            watch.close()
            for held_pod, held_resp in ex.held:
                held_resp.release()
                held_pod.in_flight -= 1
                self._gauge(held_pod).dec()

    def _retry_pod(self, ex: Exchange, req: InferenceRequest, tried: list[Pod], failure: Retryable) -> Pod:
        """Another pod for a retry, or the failure's own error when a retry is not allowed."""
        loop_time = asyncio.get_running_loop().time()
        if len(tried) >= self.config.retries.max_attempts or loop_time >= ex.deadline:
            raise failure.error
        pod = self.registry.pick(
            req.model, exclude=tuple(tried), criticality=ex.criticality, **self._affinity_of(ex)
        )
        if pod is None:
            status, _, retry_after = self.registry.shed_reason(req.model, ex.criticality)
            if status == 503:  # the last live pod just went (refused): say so as later requests will hear
                raise no_capacity(req.model, min(retry_after, self.config.shedding.retry_after_max_s))
            raise failure.error
        if not self.retry_budget.try_retry(loop_time):
            self.metrics.retries_denied.inc()
            raise failure.error
        return pod

    async def _attempt(
        self, ex: Exchange, req: InferenceRequest, pod: Pod, headers: list[tuple[bytes, bytes]]
    ) -> None:
        """One pod: connect, await the first token, relay. Raises ``Retryable`` before the first byte."""
        pod.in_flight += 1
        gauge = self._gauge(pod)
        gauge.inc()
        resp: PodResponse | None = None
        now = asyncio.get_running_loop().time()
        first_token_at = ex.first_token_at if len(ex.attempts) == 0 else now + ex.budget.first_token_s  # type: ignore[union-attr]
        reported = False  # the outlier breaker hears of every attempt that says something about the pod
        try:
            # connect and await the first token (streaming) or the answer's first byte, in time
            head = b""
            try:
                async with asyncio.timeout_at(min(first_token_at, ex.deadline)):
                    resp = await self._connect(ex, req, pod, headers)
                    assert ex.watch is not None
                    ex.watch.upstream = resp
                    if resp.status != 200:
                        error = await self._pod_error(pod, resp)
                        if resp.status in (502, 503):
                            raise Retryable(error, f"status_{resp.status}")
                        raise error
                    content_type = resp.headers.get("content-type", "application/json").encode("latin-1")
                    streaming = req.stream and content_type.startswith(b"text/event-stream")
                    if streaming:
                        head = await self._await_first_token(pod, resp)
            except TimeoutError:
                if first_token_at < ex.deadline:
                    raise Retryable(self._timeout(ex, "first_token"), "first_token_timeout") from None
                raise self._timeout(ex, "total") from None
            self.registry.report_success(pod)
            reported = True
            if streaming:
                await self._relay_stream(ex, pod, resp, content_type, head)
            else:
                await self._relay_whole(ex, pod, resp, content_type)
        except Retryable as failure:
            self.registry.report_failure(pod, failure.outcome)
            reported = True
            raise
        except GatewayError as err:
            if not reported and err.status >= 500:  # the pod's 5xx or a gateway timeout; never a 4xx
                self.registry.report_failure(pod, str(err.code or err.type))
                reported = True
            raise
        finally:
            if not reported:
                pod.outlier.trial_out = False  # a client that left says nothing about the pod
            if resp is not None:
                # A fully read answer hands its connection back to the pool; anything else closes
                # it, which is how the pod learns to abort the generation.
                if ex.watch is not None and ex.watch.upstream is resp:
                    ex.watch.upstream = None
                resp.release()
            pod.in_flight -= 1
            gauge.dec()

    async def _connect(
        self, ex: Exchange, req: InferenceRequest, pod: Pod, headers: list[tuple[bytes, bytes]]
    ) -> PodResponse:
        try:
            assert ex.budget is not None
            return await self._client().request(
                pod.host,
                pod.port,
                ROUTE_PATHS[req.route],
                upstream_headers(headers, ex.rid),
                req.body,
                pod.tls,
                ex.budget.connect_s,
            )
        except PodConnectTimeout:
            # A full accept queue under load times connects out too: the outlier breaker hears of it
            # (as a Retryable), but only a refusal says the pod is gone.
            self.metrics.upstream_errors.labels(pod.name, "connect").inc()
            pod.last_error = "connect timed out"
            raise Retryable(self._timeout(ex, "connect"), "connect_timeout") from None
        except PodConnectError as exc:
            self.metrics.upstream_errors.labels(pod.name, "connect").inc()
            # Stop sending it new work; discovery asks it again within retry_interval_s.
            pod.reachable = False
            pod.last_error = f"connect: {_reason(exc)}"
            error = upstream_failed(pod.name, f"could not connect ({_reason(exc)}).")
            raise Retryable(error, "connect_error") from None
        except PodBrokenError as exc:
            self.metrics.upstream_errors.labels(pod.name, "protocol").inc()
            error = upstream_failed(pod.name, f"connection failed ({_reason(exc)}).")
            raise Retryable(error, "reset") from None

    async def _pod_error(self, pod: Pod, resp: PodResponse) -> GatewayError:
        """Turn a pod's non-200 answer into the client's: OpenAI error bodies pass through as is."""
        self.metrics.upstream_errors.labels(pod.name, "status").inc()
        try:
            raw = await resp.read_all(self.config.upstream.max_error_body_bytes)
        except PodBrokenError:
            raw = b""
        retry_after = resp.headers.get("retry-after")
        extra = (("retry-after", retry_after),) if retry_after else ()
        try:
            payload = json.loads(raw)
        except ValueError:
            payload = None
        if isinstance(payload, dict):
            err = payload.get("error")
            if isinstance(err, dict) and isinstance(err.get("message"), str):
                return GatewayError(resp.status, err["message"], headers=extra, raw_body=raw)
            if payload.get("object") == "error" and isinstance(payload.get("message"), str):
                # vLLM before 0.10.1 answered with a flat error object; give clients the nested one.
                return GatewayError(
                    resp.status,
                    payload["message"],
                    str(payload.get("type") or "upstream_error"),
                    payload.get("code"),
                    payload.get("param"),
                    extra,
                )
        status = resp.status if resp.status < 500 or resp.status in (502, 503, 504) else 502
        return GatewayError(
            status,
            f"Upstream pod '{pod.name}' answered HTTP {resp.status} without an error body.",
            "upstream_error",
            "bad_gateway" if status == 502 else f"upstream_{resp.status}",
            None,
            extra,
        )

    async def _await_first_token(self, pod: Pod, resp: PodResponse) -> bytes:
        """Everything the pod sent up to and including the first event a client would see.

        At most ``upstream.max_event_bytes`` of it, and no line longer than that (also enforced
        by the pod response for the rest of the stream): a pod cannot grow the gateway's memory.
        """
        cap = resp.max_line = self.config.upstream.max_event_bytes
        head = b""
        pos = 0
        try:
            while chunk := await resp.read():
                head += chunk
                found, pos = sse.scan_first_token(head, pos)
                if found:
                    return head
                if len(head) > cap:
                    raise sse.MalformedEvent(f"more than {cap} bytes and no token")
        except (sse.MalformedEvent, PodLineTooLong) as exc:
            resp.close()
            self.metrics.upstream_errors.labels(pod.name, "protocol").inc()
            raise upstream_failed(pod.name, f"sent a malformed event before the first token: {exc}") from None
        except PodBrokenError as exc:
            self.metrics.upstream_errors.labels(pod.name, "broken_stream").inc()
            detail = f"broke the stream before the first token ({_reason(exc)})."
            raise Retryable(upstream_failed(pod.name, detail), "reset") from None
        if not head:
            raise upstream_failed(pod.name, "closed the stream before sending anything.")
        return head  # the stream ended without a token (e.g. only a role chunk): pass it on

    async def _relay_stream(
        self, ex: Exchange, pod: Pod, resp: PodResponse, content_type: bytes, head: bytes
    ) -> None:
        send = ex.send
        req = ex.req
        assert req is not None and ex.budget is not None and ex.watch is not None
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [*ex.response_headers(content_type), *_SSE_HEADERS],
            }
        )
        ex.status = 200
        ex.ttft = time.perf_counter() - ex.started
        recorder = Recorder() if self.config.resume.enabled_for(req.model) else None
        first = recorder.filter(head) if recorder is not None else head
        await send({"type": "http.response.body", "body": first, "more_body": True})
        choices = choices_of(req.payload)
        finish = FinishWatch() if choices > 1 else None
        if finish is not None:
            finish.feed(head)

        # relay: the pod's bytes, as they arrive, under the stall and total deadlines; on a break,
        # continue on another pod when this stream may be resumed
        while True:
            err, broke = await self._pump(ex, pod, resp, recorder, choices, finish)
            ex.chunks += resp.chunks
            if err is None or not broke or recorder is None:
                break
            resumed = await self._resume(ex, req, recorder, err)
            if resumed is None:
                break
            err = None
            pod, resp = resumed
        if err is not None:
            event = err.sse_event()
            if recorder is None and not sse.ends_event(resp.last):
                event = b"\n\n" + event  # the pod's bytes stopped inside an event: close it first
            await send({"type": "http.response.body", "body": event, "more_body": True})
        elif resp.complete:
            self._count_tokens(ex, sse.find_usage(resp.previous + resp.last))
        ex.watch.finished = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _pump(
        self,
        ex: Exchange,
        pod: Pod,
        resp: PodResponse,
        recorder: Recorder | None,
        choices: int = 1,
        finish: FinishWatch | None = None,
    ) -> tuple[GatewayError | None, bool]:
        """Relay one pod's answer to its end; returns (the error that ended it, whether it broke).

        A stream that ends cleanly but not whole (see ``gateway/completeness.py``) is a break too.
        """
        assert ex.budget is not None
        send = ex.send
        stall = StallWatch(resp, ex.budget.stall_s)
        try:
            async with asyncio.timeout_at(ex.deadline):
                socket = client_socket(send)
                if socket is not None:
                    write = socket.writer(resp)
                    sink = write if recorder is None else _recording(recorder, write, resp)
                    resp.splice(sink if finish is None else finish.wrap(sink))
                    await resp.done
                else:
                    while chunk := await resp.read():
                        if finish is not None:
                            finish.feed(chunk)
                        if recorder is not None:
                            chunk = recorder.filter(chunk)
                            if recorder.broken:
                                resp.close(PodBrokenError("the pod reported an error mid-stream"))
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
            why = incomplete(resp, choices, finish)
            if why is None:
                return None, False
            resp.close()  # a pod that ends answers short gets no keep-alive reuse
            self.metrics.upstream_errors.labels(pod.name, "truncated").inc()
            self.registry.report_failure(pod, "truncated stream")
            ex.detail = "upstream_truncated"
            return upstream_truncated(pod.name, f"{why}."), True
        except TimeoutError:
            resp.close()
            return self._timeout(ex, "total"), False
        except PodStalledError:
            self.registry.report_failure(pod, "stalled mid-stream")
            return self._timeout(ex, "stall"), True
        except PodLineTooLong as exc:
            self.metrics.upstream_errors.labels(pod.name, "protocol").inc()
            self.registry.report_failure(pod, "oversized event")
            ex.detail = "upstream_truncated"
            return upstream_truncated(pod.name, f"sent an oversized event ({_reason(exc)})."), True
        except PodBrokenError as exc:
            self.metrics.upstream_errors.labels(pod.name, "broken_stream").inc()
            self.registry.report_failure(pod, "broke mid-stream")
            ex.detail = "upstream_broke_mid_stream"
            return upstream_truncated(pod.name, f"broke the stream mid-answer ({_reason(exc)})."), True
        finally:
            stall.cancel()

    def _hold(self, ex: Exchange, pod: Pod, resp: PodResponse) -> None:
        """Count a continuation pod as busy until the request ends."""
        pod.in_flight += 1
        self._gauge(pod).inc()
        ex.held.append((pod, resp))

    async def _resume(
        self, ex: Exchange, req: InferenceRequest, recorder: Recorder, err: GatewayError
    ) -> tuple[Pod, PodResponse] | None:
        """Continue the answer on another pod; None (and a counted outcome) when it cannot be."""
        why = unsupported_reason(req.route, req.payload)
        if why is not None:
            self.metrics.stream_resumes.labels("unsupported").inc()
            err.message += f" The stream cannot be resumed on another pod ({why})."
            return None
        assert ex.budget is not None
        loop = asyncio.get_running_loop()
        while ex.resumes < self.config.resume.max_per_request and loop.time() < ex.deadline:
            done = Transcript.read(bytes(recorder.sent))
            pod = self.registry.pick(req.model, exclude=tuple(ex.tried), criticality=ex.criticality)
            if pod is None:
                break
            ex.resumes += 1
            ex.tried.append(pod)
            body = continuation_body(req.route, req.payload, done)
            cont = InferenceRequest(req.route, req.model, True, body, req.payload)
            resp: PodResponse | None = None
            try:
                async with asyncio.timeout_at(min(loop.time() + ex.budget.first_token_s, ex.deadline)):
                    resp = await self._connect(ex, cont, pod, ex.headers)
                    assert ex.watch is not None
                    ex.watch.upstream = resp
                    if resp.status != 200:
                        raise upstream_failed(pod.name, f"answered HTTP {resp.status}")
                    head = await self._await_first_token(pod, resp)
            except (Retryable, GatewayError, TimeoutError):
                if resp is not None:
                    resp.close()
                continue
            self._hold(ex, pod, resp)
            recorder.broken = False
            recorder.tail = b""
            recorder.splicer = Splicer(created=done.created, tokens_before=done.tokens)
            out = recorder.filter(recorder.splicer.head(head))
            await ex.send({"type": "http.response.body", "body": out, "more_body": True})
            self.metrics.stream_resumes.labels("ok").inc()
            ex.pod = pod
            ex.detail = "resumed"
            return pod, resp
        self.metrics.stream_resumes.labels("failed").inc()
        err.message += " No other pod could continue the stream."
        return None

    async def _relay_whole(self, ex: Exchange, pod: Pod, resp: PodResponse, content_type: bytes) -> None:
        try:
            async with asyncio.timeout_at(ex.deadline):
                body = await resp.read_all()
        except TimeoutError:
            raise self._timeout(ex, "total") from None
        except PodBrokenError as exc:
            self.metrics.upstream_errors.labels(pod.name, "broken_stream").inc()
            raise upstream_failed(pod.name, f"broke the answer ({_reason(exc)}).") from None
        try:
            answer = json.loads(body)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):  # cut short, or not an answer at all: never passed on
            self.metrics.upstream_errors.labels(pod.name, "truncated").inc()
            detail = f"sent an answer that is not a JSON object ({len(body)} bytes, {content_type.decode()})."
            raise upstream_truncated(pod.name, detail)
        self._count_tokens(ex, answer.get("usage"))
        if ex.degraded is not None:
            try:
                body = as_sse(body, ex.degraded)
            except ValueError as exc:
                raise upstream_failed(pod.name, f"sent an unreadable answer ({_reason(exc)}).") from None
            content_type = b"text/event-stream"
        assert ex.watch is not None
        ex.watch.finished = True
        ex.status = 200
        headers = ex.response_headers(content_type)
        if ex.degraded is not None:
            headers.append((b"x-sluicegate-degraded", b"non-streaming"))
        headers.append((b"content-length", str(len(body)).encode()))
        await ex.send({"type": "http.response.start", "status": 200, "headers": headers})
        await ex.send({"type": "http.response.body", "body": body, "more_body": False})

    async def _end_cut(self, ex: Exchange) -> None:
        """The gateway ended this request (drain deadline): say so in the client's protocol."""
        assert ex.cut is not None
        ex.detail = str(ex.cut.code)
        if ex.status == 0:
            raise ex.cut
        await ex.send({"type": "http.response.body", "body": ex.cut.sse_event(), "more_body": False})

    def _timeout(self, ex: Exchange, stage: str) -> GatewayError:
        """The error for an expired stage; counted here when it ends a stream already under way."""
        assert ex.budget is not None
        seconds = {
            "connect": ex.budget.connect_s,
            "first_token": ex.budget.first_token_s,
            "stall": ex.budget.stall_s,
            "total": ex.budget.total_s,
        }[stage]
        if ex.status:  # mid-stream: no status code left to carry it, so count it now
            self.metrics.timeouts.labels(stage).inc()
            ex.detail = f"timeout_{stage}"
        return timed_out(stage, seconds)

    # -- finish --------------------------------------------------------------------------------

    def _count_tokens(self, ex: Exchange, usage: Any) -> None:
        if not isinstance(usage, dict):
            return
        for kind in ("prompt", "completion"):
            value = usage.get(f"{kind}_tokens")
            if isinstance(value, int) and value > 0:
                self.metrics.tokens.labels(ex.model_label, kind).inc(value)

    def _finish(self, ex: Exchange) -> None:
        elapsed = time.perf_counter() - ex.started
        m = self.metrics
        model = ex.model_label
        m.child(m.requests, ex.route, model, str(ex.status), ex.transport).inc()
        m.child(m.request_duration, ex.route, model).observe(elapsed)
        if ex.ttft is not None:
            m.child(m.time_to_first_token, model, ex.transport).observe(ex.ttft)
        if ex.chunks:
            m.child(m.stream_chunks, model).inc(ex.chunks)
        if self.config.server.access_log:
            access_log.info(
                "rid=%s route=%s transport=%s model=%s stream=%s pod=%s status=%d outcome=%s ttft_ms=%s "
                "duration_ms=%.1f chunks=%d attempts=%s resumes=%d",
                ex.rid,
                ex.route,
                ex.transport,
                model,
                int(bool(ex.req and ex.req.stream)),
                ex.pod.name if ex.pod else "-",
                ex.status,
                ex.detail,
                "-" if ex.ttft is None else f"{ex.ttft * 1000:.1f}",
                elapsed * 1000,
                ex.chunks,
                ",".join(ex.attempts) or "-",
                ex.resumes,
            )


_TRANSPORTS = {"1.1": "h1", "1.0": "h1", "2": "h2", "3": "h3"}


def transport_of(scope: Scope) -> str:
    """The client's transport, a metric label: a handler that translates another protocol (gRPC-Web)
    names itself in ``scope["sluicegate.transport"]``; otherwise the HTTP version."""
    named = scope.get("sluicegate.transport")
    if named is not None:
        return str(named)
    return _TRANSPORTS.get(scope.get("http_version", "1.1"), "h1")


def _recording(
    recorder: Recorder, write: Callable[[bytes], None], resp: PodResponse
) -> Callable[[bytes], None]:
    """A splice sink that records what it passes and ends the answer at a pod's error event."""

    def sink(body: bytes) -> None:
        out = recorder.filter(body)
        if out:
            write(out)
        if recorder.broken:
            resp.close(PodBrokenError("the pod reported an error mid-stream"))

    return sink


def _reason(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) < 200 else text[:200] + "..."


async def _send_error(send: Send, err: GatewayError, rid: str, alt_svc: bytes | None = None) -> None:
    body = err.body()
    headers = [
        (b"content-type", _JSON),
        (b"content-length", str(len(body)).encode()),
        (b"x-request-id", rid.encode()),
    ]
    if alt_svc is not None:
        headers.append((b"alt-svc", alt_svc))
    headers.extend((k.encode(), v.encode()) for k, v in err.headers)
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
