"""The hot path: relay one inference request to a pod and its answer back to the client.

A raw ASGI handler, not a Starlette endpoint: at 100 concurrent streams every per-chunk layer of
Python (response wrappers, middleware send-wrappers, queues) costs a measurable share of a core.
Once the first token is out, the pod's bytes are spliced to the client's socket from the pod
connection's parser callback (see ``transports/pod_client.py``), untouched.

Phases, in order: admit → pick → connect → await first token → relay → finish. ``Relay.__call__``
and ``_serve``/``_attempt`` read as that list, with each phase's failure hook beside it; the phases
that are more than a few lines live in their own modules:

- ``gateway/exchange.py``: the ``Exchange`` that carries what each phase learned;
- ``gateway/disconnect_watch.py``: the client leaving, noticed at once, ends the pod's work;
- ``gateway/pod_errors.py``: a pod's non-200 answer as the client's error;
- ``gateway/stream_relay.py``: hold until the first token, splice, the completeness verdict,
  resume on another pod;
- ``gateway/whole_answer.py``: a non-streaming answer (and a degraded one re-sent as SSE).

Response status and headers are held until the pod's first token has arrived, so any failure before
that is still answered with a proper status code.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from gateway.admit import ROUTE_PATHS, ClientGone, InferenceRequest, parse_request, read_body, request_id
from gateway.affinity import affinity_key
from gateway.config import Config
from gateway.deadlines import TimeoutPolicy
from gateway.degrade import non_streaming_body
from gateway.disconnect_watch import DisconnectWatch
from gateway.errors import GatewayError, model_not_found, no_capacity, overloaded, upstream_failed
from gateway.exchange import Exchange, Receive, Scope, Send, transport_of
from gateway.metrics import GatewayMetrics
from gateway.pod_errors import pod_error
from gateway.pod_errors import reason as _reason
from gateway.pods.registry import Pod, PodRegistry
from gateway.request_limits import enforce as enforce_limits
from gateway.request_limits import limits_by_tier
from gateway.retries import Retryable, RetryBudget, backoff_s
from gateway.stream_relay import StreamRelay
from gateway.whole_answer import relay_whole
from transports.hangups import HangupWatcher
from transports.pod_client import (
    PodBrokenError,
    PodClient,
    PodConnectError,
    PodConnectTimeout,
    PodResponse,
)

# Re-exported: the app and the gRPC-Web endpoint import the ASGI types from here.
__all__ = ["DisconnectWatch", "Exchange", "Receive", "Relay", "Scope", "Send", "transport_of"]

access_log = logging.getLogger("sluicegate.access")
log = logging.getLogger("sluicegate.relay")

_JSON = b"application/json"

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
        self.stream = StreamRelay(config, registry, metrics, self._connect)

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
        # The whole body within the body deadline, whatever the transport: HTTP/1.1's protocol
        # enforces it (and an idle one) itself; this bounds an HTTP/2 or HTTP/3 body that trickles.
        seconds = self.config.server.limits.body_timeout_s
        try:
            async with asyncio.timeout(seconds):
                body = await read_body(receive, headers, self.config.server.max_body_bytes)
        except TimeoutError:
            raise GatewayError(
                408, f"The request body did not arrive within {seconds:g} s.",
                "invalid_request_error", "request_timeout",
            ) from None
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
            self.stream.release_held(ex)

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
                        self.metrics.upstream_errors.labels(pod.name, "status").inc()
                        max_bytes = self.config.upstream.max_error_body_bytes
                        error = await pod_error(pod.name, resp, max_bytes)
                        if resp.status in (502, 503):
                            raise Retryable(error, f"status_{resp.status}")
                        raise error
                    content_type = resp.headers.get("content-type", "application/json").encode("latin-1")
                    streaming = req.stream and content_type.startswith(b"text/event-stream")
                    if streaming:
                        head = await self.stream.first_token(pod, resp)
            except TimeoutError:
                if first_token_at < ex.deadline:
                    raise Retryable(ex.timeout("first_token", self.metrics), "first_token_timeout") from None
                raise ex.timeout("total", self.metrics) from None
            self.registry.report_success(pod)
            reported = True
            if streaming:
                await self.stream.relay(ex, pod, resp, content_type, head)
            else:
                await relay_whole(ex, pod, resp, content_type, self.metrics)
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
            raise Retryable(ex.timeout("connect", self.metrics), "connect_timeout") from None
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

    async def _end_cut(self, ex: Exchange) -> None:
        """The gateway ended this request (drain deadline): say so in the client's protocol."""
        assert ex.cut is not None
        ex.detail = str(ex.cut.code)
        if ex.status == 0:
            raise ex.cut
        await ex.send({"type": "http.response.body", "body": ex.cut.sse_event(), "more_body": False})

    # -- finish --------------------------------------------------------------------------------

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
