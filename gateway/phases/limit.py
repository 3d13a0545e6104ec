"""Limit: how much this request may take — its own size (messages, choices, tokens), and the
caller's quota (requests and tokens per minute, streams at once).

Tokens are charged when they are reserved, not after the fact: admission reserves the prompt's
estimate plus the request's ``max_tokens`` (capped by the tier) and refuses what does not fit; the
finish phase settles the reservation to what the pods reported (``usage``, asked of the pod even
when the client did not ask, and stripped from its answer), or, when the client left before the
end, to the prompt's estimate plus the tokens relayed. An admitted stream is never cut for quota.
"""

from __future__ import annotations

from gateway.admit import InferenceRequest
from gateway.config import Config
from gateway.exchange import Exchange
from gateway.metrics import GatewayMetrics
from gateway.quota import QuotaPolicy, Quotas, policy_for
from gateway.quota.estimate import completion_reserve, prompt_estimate
from gateway.request_limits import enforce, limits_by_tier
from gateway.usage import ask_for_usage

_STREAMS_WITH_USAGE = ("chat", "completions")


def build_quotas(config: Config, metrics: GatewayMetrics) -> Quotas | None:
    """The quota counters, when anything may set a quota: a tier, the default, or (auth on) a key
    record, which the key store can add at any reload."""
    configured = config.quotas.default is not None or any(t.quota is not None for t in config.tiers.values())
    if not (configured or config.auth.enabled):
        return None
    return Quotas(config.quotas, metrics)


class Limit:
    """The limit phase; ``quotas`` is None when no tier, key or default sets a quota."""

    def __init__(self, config: Config, quotas: Quotas | None) -> None:
        self.config = config
        self.quotas = quotas
        self._limits = limits_by_tier(config)
        self._chars_per_token = config.quotas.chars_per_token
        self._policies: dict[str | None, QuotaPolicy | None] = {}

    async def admit(self, ex: Exchange, req: InferenceRequest) -> InferenceRequest:
        """``req`` within its tier's limits (a 400 when not), its quota reserved (a 429 when not)."""
        limits = self._limits[ex.tier]
        req = enforce(req, limits)
        if self.quotas is None:
            return req
        policy = self._policy(ex)
        if policy is None:
            return req
        tokens = 0
        if policy.tokens_per_minute is not None:
            ex.prompt_estimate = prompt_estimate(req.payload, self._chars_per_token)
            asked = _asked(req.payload, limits.max_tokens)
            tokens = ex.prompt_estimate + completion_reserve(req.payload, req.route, asked)
            if req.stream and req.route in _STREAMS_WITH_USAGE:
                req, ex.usage_injected = ask_for_usage(req)
        subject = ex.caller.key_id if ex.caller.key_id is not None else f"tier:{ex.tier or '-'}"
        ex.admission = await self.quotas.admit(subject, policy, tokens)
        ex.answer_headers.extend(ex.admission.headers)
        return req

    def _policy(self, ex: Exchange) -> QuotaPolicy | None:
        record = ex.caller.record
        key_quota = record.quota if record is not None else None
        if key_quota is not None:
            return policy_for(self.config, ex.tier, key_quota)
        if ex.tier not in self._policies:
            self._policies[ex.tier] = policy_for(self.config, ex.tier, None)
        return self._policies[ex.tier]

    @staticmethod
    def settle(ex: Exchange) -> None:
        """Charge what was used and give the rest back (and the stream's concurrency slot)."""
        admission = ex.admission
        if admission is None:
            return
        ex.admission = None
        if ex.usage is not None:
            used = ex.usage[0] + ex.usage[1]
        elif ex.tried and ex.status in (200, 499):
            # a pod worked on it but said no usage: the client left (the pod's generation was
            # aborted then), or the pod never sends usage: the prompt and what was relayed
            used = ex.prompt_estimate + ex.tokens_relayed
        else:  # no pod took it on
            used = 0
        admission.settle(used)


_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def _asked(payload: dict, cap: int | None) -> int | None:
    """The completion tokens a request may generate: what it asked for (already checked against
    the cap, or the cap written in by ``request_limits.enforce``), else the cap."""
    for field in _TOKEN_FIELDS:
        value = payload.get(field)
        if type(value) is int and value > 0:
            return value if cap is None else min(value, cap)
    return cap
