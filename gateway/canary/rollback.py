"""``rollout.on_rollback: resume``: on a rollback, the canary's streams in flight continue on stable.

The rollout only swaps the route's weights; this moves what is already streaming. Each exchange of
the route still served by the canary is pointed at stable (its pods, and stable's upstream model
name when it differs) and its canary answer is closed with ``RolledBack``: the stream relay takes
that as a break and continues the answer on a stable pod from the tokens the client already has,
as after a pod failure (``gateway/resume.py``), so the client reads one uninterrupted answer.

A stream that cannot be continued finishes on the canary, as with ``finish``: resume off for its
model, a request resume refuses (n > 1, tools, logprobs, ...), no resumes left, a whole (non-
streaming) answer, or one still waiting for its first token (it has sent nothing, and an answer
that starts on the canary just before a rollback is rare and short-lived; retrying it would cost a
second prefill for nothing the client can see).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from gateway.admit import CHUNK_ROUTES, InferenceRequest, encode_body
from gateway.exchange import Exchange
from gateway.resume import RolledBack, unsupported_reason

if TYPE_CHECKING:
    from gateway.relay import Relay

log = logging.getLogger("sluicegate.rollout")


def move_streams(relay: Relay, model: str, canary: str) -> int:
    """Move ``model``'s in-flight ``canary`` streams to stable; returns how many were moved."""
    router = relay.path.route.routers.get(model)
    if router is None:
        return 0
    stable = router.choose(None, override="stable", may_override=True)
    counter = relay.metrics.rollback_resumed_streams
    moved = kept = 0
    for ex in relay.exchanges():
        if ex.public_model != model or ex.variant != canary:
            continue
        why = _unmovable(relay, ex)
        if why is not None:
            kept += 1
            counter.labels(model, "finished").inc()
            log.debug("rollout %s: stream %s finishes on %s (%s)", model, ex.rid, canary, why)
            continue
        req = ex.req
        assert req is not None and ex.watch is not None and ex.watch.upstream is not None
        ex.variant = "stable"
        ex.selector = stable.pods
        if stable.model != req.model:  # the continuation must name stable's model
            payload = {**req.payload, "model": stable.model}
            ex.req = InferenceRequest(req.route, stable.model, req.stream, encode_body(payload), payload)
        ex.watch.upstream.close(RolledBack(f"the rollout of {model!r} rolled back"))
        moved += 1
    log.warning(
        "rollout %s rolled back: %d in-flight %s stream(s) moved to stable, %d finish on %s",
        model, moved, canary, kept, canary,
    )  # fmt: skip
    return moved


def _unmovable(relay: Relay, ex: Exchange) -> str | None:
    """Why this exchange's answer cannot move to stable now, or None when it can."""
    req, watch = ex.req, ex.watch
    upstream = watch.upstream if watch is not None else None
    if req is None or not req.stream or ex.degraded is not None:
        return "not a stream"
    if ex.status != 200 or watch is None or watch.finished or upstream is None or upstream.complete:
        return "no stream under way"  # before its first token, or already over
    resume = relay.config.resume
    if req.route not in CHUNK_ROUTES or not resume.enabled_for(req.model):
        return "resume is off for it"
    if ex.resumes >= resume.max_per_request:
        return "no resumes left"
    return unsupported_reason(req.route, req.payload)
