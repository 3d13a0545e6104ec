"""Finish: what the request cost and how it ended — its quota settled, its metrics, its access-log
line. Runs once per request, whatever happened before."""

from __future__ import annotations

import json
import time
from typing import Any

from gateway.access_log import ACCESS
from gateway.exchange import Exchange
from gateway.metrics import GatewayMetrics
from gateway.phases.limit import Limit
from gateway.usage import relayed_usage

# the stream reached its end (a resumed one on a second pod; on stable after a canary rollback)
_WHOLE = frozenset(("ok", "resumed", "resumed_rollback"))


def finish(
    ex: Exchange, metrics: GatewayMetrics, log_access: bool, log_json: bool = False, rollouts: Any = None
) -> None:
    """Settle the quota, count the request, and write its access-log line (never the key: its id):
    ``key=value`` text, or one JSON object per line (``server.access_log_format: json``)."""
    Limit.settle(ex)
    if ex.usage is None:  # no usage from the pods: what was relayed (gateway/usage.py)
        relayed_usage(ex, metrics)
    elapsed = time.perf_counter() - ex.started
    m = metrics
    model = ex.model_label
    m.child(m.requests, ex.route, model, str(ex.status), ex.transport).inc()
    m.child(m.request_duration, ex.route, model).observe(elapsed)
    if ex.ttft is not None:
        m.child(m.time_to_first_token, model, ex.transport).observe(ex.ttft)
    if ex.chunks:
        m.child(m.stream_chunks, model).inc(ex.chunks)
    variant = ex.variant or "none"
    usage = ex.usage
    if usage is not None:
        m.child(m.variant_tokens, model, variant, "prompt").inc(usage[0])
        m.child(m.variant_tokens, model, variant, "completion").inc(usage[1])
    if ex.status == 200 and ex.detail in _WHOLE:
        itl = ex.time_per_output_token(elapsed)
        if itl is not None:
            m.child(m.time_per_output_token, model, variant, ex.transport).observe(itl)
    if ex.variant is not None:
        if rollouts is not None:
            rollouts.observe(ex, elapsed)  # a sample for the canary's judge
        m.child(m.variant_requests, model, ex.variant, str(ex.status)).inc()
        if ex.ttft is not None:
            m.child(m.variant_time_to_first_token, model, ex.variant).observe(ex.ttft)
    if ex.span is not None:  # tracing on: the request's span ends with its outcome
        ex.span.end(ex)
    if log_access and log_json:
        ACCESS.write(json.dumps(access_record(ex, elapsed), separators=(",", ":")))
    elif log_access:
        caller = ex.caller
        key = "-" if caller is None or caller.key_id is None else caller.key_id
        stream = int(bool(ex.req and ex.req.stream))
        pod = ex.pod.name if ex.pod else "-"
        ttft = "-" if ex.ttft is None else f"{ex.ttft * 1000:.1f}"
        ACCESS.write(
            f"rid={ex.rid} client={ex.client} key={key} route={ex.route} transport={ex.transport} "
            f"model={model} variant={ex.variant or '-'} stream={stream} pod={pod} status={ex.status} "
            f"outcome={ex.detail} ttft_ms={ttft} duration_ms={elapsed * 1000:.1f} chunks={ex.chunks} "
            f"attempts={','.join(ex.attempts) or '-'} resumes={ex.resumes}"
        )


def access_record(ex: Exchange, elapsed_s: float) -> dict[str, Any]:
    """One request as the JSON access log writes it (for log pipelines: no parsing of text)."""
    caller = ex.caller
    pod = ex.pod
    mig = pod.config.mig if pod is not None else None
    req = ex.req
    return {
        "request_id": ex.rid,
        "client": ex.client,
        "key_id": caller.key_id if caller is not None else None,
        "tier": ex.tier,
        "route": ex.route,
        "model": ex.model_label,
        "variant": ex.variant,
        "stream": bool(req and req.stream),
        "transport": ex.transport,
        "pod": pod.name if pod is not None else None,
        "mig_slice": (mig.mig_uuid or mig.gpu_uuid) if mig is not None else None,
        "status": ex.status,
        "outcome": ex.detail,
        "ttft_ms": None if ex.ttft is None else round(ex.ttft * 1000, 2),
        "duration_ms": round(elapsed_s * 1000, 2),
        "prompt_tokens": ex.usage[0] if ex.usage is not None else None,
        "completion_tokens": ex.usage[1] if ex.usage is not None else None,
        "chunks": ex.chunks,
        "attempts": list(ex.attempts),
        "resumes": ex.resumes,
    }
