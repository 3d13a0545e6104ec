"""Pick: a routable pod for the request — or shed it, with the status that says why.

The registry decides which pods may take work (health, breakers, GPU pressure, criticality); this
phase asks it, in the request's terms: its model, its criticality (the tier's, which a client may
lower but never raise), its affinity key. Also here: the pod for a retry, and whether the chosen
pod is streaming so slowly that the tier wants the answer whole (``degrade``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from gateway.admit import InferenceRequest
from gateway.affinity import affinity_key
from gateway.config import Config
from gateway.degrade import non_streaming_body
from gateway.errors import model_not_found, no_capacity, overloaded
from gateway.exchange import Exchange
from gateway.metrics import GatewayMetrics
from gateway.pods.registry import Pod, PodRegistry
from gateway.request_head import RequestHead
from gateway.retries import Retryable, RetryBudget

_CRITICALITY_RANK = {"sheddable": 0, "standard": 1, "critical": 2}
_DEGRADABLE = ("chat", "completions")


class Pick:
    """The pick phase, over the process's one pod registry."""

    def __init__(self, config: Config, registry: PodRegistry, metrics: GatewayMetrics) -> None:
        self.config = config
        self.registry = registry
        self.metrics = metrics
        retries = config.retries
        self.retry_budget = RetryBudget(retries.budget_ratio, retries.min_retries_per_s)
        self._default_criticality = config.shedding.default_criticality

    def criticality(self, tier: str | None, head: RequestHead) -> str:
        """The tier's criticality (else the default); a client's header may lower it, never raise it."""
        granted = self.config.tiers[tier].criticality if tier is not None else self._default_criticality
        if head.criticality is not None:
            asked = head.criticality.decode("latin-1").strip().lower()
            if asked in _CRITICALITY_RANK and _CRITICALITY_RANK[asked] < _CRITICALITY_RANK[granted]:
                return asked
        return granted

    def affinity(self, ex: Exchange, req: InferenceRequest, head: RequestHead) -> None:
        affinity = self.config.affinity
        if affinity is not None and (not affinity.models or req.model in affinity.models):
            ex.affinity = affinity_key(affinity, req.payload, head.affinity)

    def pod(self, ex: Exchange, req: InferenceRequest) -> Pod:
        """A pod for the first attempt, or the 404/429/503 that says why there is none."""
        if not self.registry.knows(req.model):
            raise model_not_found(req.model)
        ex.model_label = req.model
        only = ex.selector  # a canary route's variant: its pods only
        pod = self.registry.pick(req.model, criticality=ex.criticality, pods=only, **self._affinity_of(ex))
        if pod is None:
            status, reason, retry_after = self.registry.shed_reason(req.model, ex.criticality, only=only)
            retry_after = min(retry_after, self.config.shedding.retry_after_max_s)
            self.metrics.child(self.metrics.shed, req.model, ex.criticality, reason).inc()
            if status == 429:
                raise overloaded(req.model, reason, retry_after)
            raise no_capacity(req.model, retry_after)
        ex.pod = pod
        return pod

    def retry_pod(self, ex: Exchange, req: InferenceRequest, failure: Retryable) -> Pod:
        """Another pod for a retry, or the failure's own error when a retry is not allowed."""
        tried = ex.tried
        loop_time = asyncio.get_running_loop().time()
        if len(tried) >= self.config.retries.max_attempts or loop_time >= ex.deadline:
            raise failure.error
        pod = self.registry.pick(
            req.model, exclude=tuple(tried), criticality=ex.criticality, pods=ex.selector,
            **self._affinity_of(ex),
        )
        if pod is None:
            status, _, retry_after = self.registry.shed_reason(req.model, ex.criticality, only=ex.selector)
            if status == 503:  # the last live pod just went (refused): say so as later requests will hear
                raise no_capacity(req.model, min(retry_after, self.config.shedding.retry_after_max_s))
            raise failure.error
        if not self.retry_budget.try_retry(loop_time):
            self.metrics.retries_denied.inc()
            raise failure.error
        return pod

    def _affinity_of(self, ex: Exchange) -> dict[str, Any]:
        if ex.affinity is None:
            return {}
        assert self.config.affinity is not None
        return {"affinity": ex.affinity, "max_load_factor": self.config.affinity.max_load_factor}

    def maybe_degrade(self, ex: Exchange, req: InferenceRequest, pod: Pod) -> InferenceRequest:
        """The request as the pod gets it: without streaming when the tier degrades and the pod is slow."""
        if not req.stream or ex.tier is None or req.route not in _DEGRADABLE:
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
