"""A whole (non-streaming) answer: read it within the total deadline, check it, pass it on.

An answer that is not a JSON object (cut short, or not an answer at all) is never passed on: the
client gets the gateway's own error instead. A request the relay degraded to non-streaming (its
tier's pod was slow) gets the whole answer re-sent as an SSE stream (``gateway/degrade.py``).
"""

from __future__ import annotations

import json

from gateway.deadlines import TOTAL_DEADLINES
from gateway.degrade import as_sse
from gateway.errors import upstream_failed, upstream_truncated
from gateway.exchange import Exchange
from gateway.metrics import GatewayMetrics
from gateway.pod_errors import reason
from gateway.pods.registry import Pod
from gateway.usage import whole_answer_usage
from transports.deadline import Deadline
from transports.pod_client import PodBrokenError, PodResponse


async def relay_whole(
    ex: Exchange, pod: Pod, resp: PodResponse, content_type: bytes, metrics: GatewayMetrics
) -> None:
    """Read the pod's whole answer and send it to the client as one response."""
    try:
        with Deadline(ex.task, ex.deadline, TOTAL_DEADLINES):
            body = await resp.read_all()
    except TimeoutError:
        raise ex.timeout("total", metrics) from None
    except PodBrokenError as exc:
        metrics.upstream_errors.labels(pod.name, "broken_stream").inc()
        raise upstream_failed(pod.name, f"broke the answer ({reason(exc)}).") from None
    try:
        answer = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nested past the decoder's depth
        answer = None
    if not isinstance(answer, dict):  # cut short, or not an answer at all: never passed on
        metrics.upstream_errors.labels(pod.name, "truncated").inc()
        detail = f"sent an answer that is not a JSON object ({len(body)} bytes, {content_type.decode()})."
        raise upstream_truncated(pod.name, detail)
    ex.count_tokens(metrics, whole_answer_usage(ex, answer))
    if ex.degraded is not None:
        try:  # usage the gateway asked for (a quota) stays out of a client's stream that did not ask
            body = as_sse(body, ex.degraded and not ex.usage_injected)
        except ValueError as exc:
            raise upstream_failed(pod.name, f"sent an unreadable answer ({reason(exc)}).") from None
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
