"""Attempt: send the request to a pod, await its first token in time, and hand over to the relay
phase; on a failure before anything reached the client, try another pod (the pick phase says
which, within the retry budget and the total deadline).

The client's response status is held until the pod's first token, so every failure here is still
answered with a status code. A client that leaves cancels the attempt, which closes the pod
connection: that is how the pod learns to stop generating.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from gateway.admit import ROUTE_PATHS, SENT, InferenceRequest
from gateway.config import Config
from gateway.deadlines import FIRST_TOKEN_DEADLINES
from gateway.disconnect_watch import DisconnectWatch
from gateway.errors import GatewayError, upstream_failed
from gateway.exchange import Exchange, Receive
from gateway.metrics import GatewayMetrics
from gateway.phases.pick import Pick
from gateway.pod_errors import pod_error
from gateway.pod_errors import reason as _reason
from gateway.pods.registry import Pod, PodRegistry
from gateway.retries import Retryable, backoff_s
from gateway.stream_relay import StreamRelay
from gateway.whole_answer import relay_whole
from transports.deadline import Deadline
from transports.hangups import HangupWatcher
from transports.pod_client import (
    PodBrokenError,
    PodClient,
    PodConnectError,
    PodConnectTimeout,
    PodResponse,
)

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
        b"x-api-key",
        b"cookie",
        b"x-request-id",
        b"content-type",
    }
)


def upstream_headers(headers: list[tuple[bytes, bytes]], rid: str, pod: Pod) -> list[tuple[bytes, bytes]]:
    """The client's end-to-end headers for the pod, plus the request id, identity encoding and the
    pod's own credential (vLLM's ``--api-key``) when it has one. The client's key never goes on."""
    out = [(name, value) for name, value in headers if name not in _NOT_FORWARDED]
    out.append((b"content-type", b"application/json"))
    out.append((b"accept-encoding", b"identity"))
    out.append((b"x-request-id", rid.encode()))
    auth = pod.auth_header
    if auth is not None:
        out.append((b"authorization", auth))
    return out


class Attempt:
    """The attempt phase: attempts on one pod after another, then the relay phase on the one that
    answered."""

    def __init__(
        self,
        config: Config,
        registry: PodRegistry,
        metrics: GatewayMetrics,
        client: Callable[[], PodClient],
        pick: Pick,
    ) -> None:
        self.config = config
        self.registry = registry
        self.metrics = metrics
        self._client = client
        self.pick = pick
        self.hangups: HangupWatcher | None = None  # set by the app while it runs
        self.stream = StreamRelay(config, registry, metrics, self._connect)

    async def serve(self, ex: Exchange, req: InferenceRequest, pod: Pod, receive: Receive) -> None:
        """Attempts on one pod after another while failures are retryable and the client is here."""
        ex.watch = watch = DisconnectWatch(receive, self.hangups, ex.task)
        loop = ex.task.get_loop()
        self.pick.retry_budget.record_request(loop.time())
        tried = ex.tried
        try:
            while True:
                tried.append(pod)
                ex.pod = pod
                try:
                    await self._attempt(ex, req, pod)
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
                    pod = self.pick.retry_pod(ex, req, failure)
                    await asyncio.sleep(
                        min(backoff_s(self.config.retries, len(tried)), max(0.0, ex.deadline - loop.time()))
                    )
        except asyncio.CancelledError:
            if not (watch.gone or ex.cut):
                raise
            ex.task.uncancel()
            if watch.gone:
                ex.status = 499
                ex.detail = "client_gone"
                self.metrics.client_disconnects.labels(req.model).inc()
            elif ex.cut is not None:
                await self._end_cut(ex)
        finally:
            watch.close()
            self.stream.release_held(ex)

    async def _attempt(self, ex: Exchange, req: InferenceRequest, pod: Pod) -> None:
        """One pod: connect, await the first token, relay. Raises ``Retryable`` before the first byte."""
        pod.in_flight += 1
        gauge = self.metrics.child(self.metrics.in_flight, pod.name)
        gauge.inc()
        resp: Any = None  # a PodResponse once connected (Any: see docs/architecture.md, compiled code)
        now = ex.task.get_loop().time()
        first_token_at = ex.first_token_at if len(ex.attempts) == 0 else now + ex.budget.first_token_s  # type: ignore[union-attr]
        reported = False  # the outlier breaker hears of every attempt that says something about the pod
        try:
            # connect and await the first token (streaming) or the answer's first byte, in time
            head = b""
            try:
                with Deadline(ex.task, min(first_token_at, ex.deadline), FIRST_TOKEN_DEADLINES):
                    resp = await self._connect(ex, req, pod, ex.headers)
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
            req.body = SENT
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
        upstream = upstream_headers(headers, ex.rid, pod)
        if ex.span is not None:  # tracing on: the pod's traceparent names this attempt's span
            upstream = ex.span.attempt(ex, pod, upstream)
        try:
            assert ex.budget is not None
            return await self._client().request(
                pod.host,
                pod.port,
                ROUTE_PATHS[req.route],
                upstream,
                req.body,
                pod.tls,
                ex.budget.connect_s,
                server_hostname=pod.server_name,
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
        except PodBrokenError as broken:  # (one name per type: compiled, a name has one type)
            self.metrics.upstream_errors.labels(pod.name, "protocol").inc()
            error = upstream_failed(pod.name, f"connection failed ({_reason(broken)}).")
            raise Retryable(error, "reset") from None

    async def _end_cut(self, ex: Exchange) -> None:
        """The gateway ended this request (drain deadline): say so in the client's protocol."""
        assert ex.cut is not None
        ex.detail = str(ex.cut.code)
        if ex.status == 0:
            raise ex.cut
        await ex.send({"type": "http.response.body", "body": ex.cut.sse_event(), "more_body": False})
