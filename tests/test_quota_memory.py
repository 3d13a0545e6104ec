"""Quotas in one process: policy choice, the reservation estimate, and the in-memory counters."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import CollectorRegistry

from gateway.config import Config, QuotaConfig, QuotasConfig
from gateway.errors import GatewayError
from gateway.metrics import GatewayMetrics
from gateway.quota import Admission, QuotaPolicy, Quotas, policy_for, reservation
from gateway.quota.breaker import Breaker
from gateway.quota.headers import duration

MINUTE = 29_000_000 * 60  # an epoch minute's start


class Clock:
    """A settable epoch clock, so windows and resets are exact."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def config(**extra: object) -> Config:
    return Config.model_validate({"server": {"max_tokens": 1000}, **extra})


def headers(admission: Admission) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in admission.headers}


def test_policy_key_then_tier_then_default() -> None:
    cfg = config(
        tiers={"gold": {"quota": {"requests_per_minute": 100, "on_store_down": "fail_closed"}}, "free": {}},
        quotas={"default": {"tokens_per_minute": 500}},
    )
    own = QuotaConfig(max_concurrent=2)
    assert policy_for(cfg, "gold", own) == QuotaPolicy(None, None, 2, True)
    assert policy_for(cfg, "gold", None) == QuotaPolicy(100, None, None, False)
    assert policy_for(cfg, "free", None) == QuotaPolicy(None, 500, None, True)
    assert policy_for(cfg, None, None) == QuotaPolicy(None, 500, None, True)
    assert policy_for(cfg, "made-up-by-a-header", None) == QuotaPolicy(None, 500, None, True)
    assert policy_for(cfg, "gold", None) is policy_for(cfg, "gold", None)  # cached
    # a new config (a reload) is read afresh
    assert policy_for(config(), "gold", None) is None
    assert policy_for(config(), None, QuotaConfig()) is None


def test_store_down_share_is_limit_over_replicas_at_least_one() -> None:
    policy = QuotaPolicy(10, 1000, 2, True)
    assert policy.scaled(3) == QuotaPolicy(3, 333, 1, True)
    assert policy.scaled(1) is policy
    assert QuotaPolicy(None, 5, None, False).scaled(8) == QuotaPolicy(None, 1, None, False)


def test_reservation_estimates_prompt_and_completion() -> None:
    chat = {"messages": [{"role": "system", "content": "x" * 10}, {"role": "user", "content": "y" * 7}]}
    # 17 chars / 4 = 4.25 -> 5, + 4 per message, + max_tokens
    assert reservation(chat, "chat", 100, 4) == 5 + 8 + 100
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "z" * 8}]}], "n": 3}
    assert reservation(parts, "chat", 10, 4) == 2 + 4 + 30
    assert reservation({"prompt": "a" * 9, "best_of": 2, "n": 1}, "completions", 5, 4) == 3 + 10
    assert reservation({"prompt": [1, 2, 3, 4]}, "completions", None, 4) == 4  # token ids count exactly
    assert reservation({"prompt": [[1, 2], [3]]}, "completions", 1, 4) == 3 + 1
    assert reservation({"input": ["abcd", "efgh"]}, "embeddings", 50, 4) == 2  # nothing generated
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    with_tools = reservation({"messages": [], "tools": tools}, "chat", 0, 1)
    assert with_tools == len(json.dumps(tools, separators=(",", ":")))
    assert reservation({"input": "hello there", "instructions": "be brief"}, "responses", 20, 2) == 10 + 20


def test_duration_is_openais_form() -> None:
    assert [duration(s) for s in (0.12, 1, 59.2, 59.21, 60, 360, 0.0001)] == [
        "120ms", "1s", "59.2s", "59.3s", "1m0s", "6m0s", "1ms",
    ]  # fmt: skip


def test_breaker_opens_probes_once_and_closes() -> None:
    clock = Clock(0)
    breaker = Breaker(2.0, clock)
    assert breaker.attempt() == "call"
    assert breaker.failed(False) is True
    assert breaker.failed(False) is False  # already open: one transition, one log line
    assert breaker.attempt() is None
    clock.now = 2.0
    assert breaker.attempt() == "probe"
    assert breaker.attempt() is None  # only one probe at a time
    assert breaker.failed(True) is False
    assert breaker.attempt() is None
    clock.now = 4.0
    assert breaker.attempt() == "probe"
    breaker.abandoned()  # a cancelled probe lets the next caller probe
    assert breaker.attempt() == "probe"
    assert breaker.succeeded(False) is False  # a late call does not close it
    assert breaker.succeeded(True) is True
    assert breaker.attempt() == "call"


async def test_requests_per_minute_exact_with_headers() -> None:
    clock = Clock(MINUTE + 20.5)
    quotas = Quotas(QuotasConfig(), clock=clock)
    policy = QuotaPolicy(3, None, None, True)
    seen = [headers(await quotas.admit("key-a", policy, 10)) for _ in range(3)]
    assert [h["x-ratelimit-remaining-requests"] for h in seen] == ["2", "1", "0"]
    assert seen[0] == {
        "x-ratelimit-limit-requests": "3",
        "x-ratelimit-remaining-requests": "2",
        "x-ratelimit-reset-requests": "39.5s",
    }
    with pytest.raises(GatewayError) as refused:
        await quotas.admit("key-a", policy, 10)
    err = refused.value
    assert err.status == 429
    body = json.loads(err.body())["error"]
    assert body["type"] == "rate_limit_exceeded" and body["code"] == "rate_limit_exceeded"
    assert "requests per minute" in body["message"] and "39.5s" in body["message"]
    hdrs = dict(err.headers)
    assert hdrs["retry-after"] == "40" and hdrs["retry-after-ms"] == "39500"
    assert hdrs["x-ratelimit-remaining-requests"] == "0"
    # another key has its own count; the next minute starts afresh
    await quotas.admit("key-b", policy, 10)
    clock.now = MINUTE + 60
    assert headers(await quotas.admit("key-a", policy, 10))["x-ratelimit-remaining-requests"] == "2"


async def test_tokens_per_minute_reserve_settle_refund_and_excess() -> None:
    clock = Clock(MINUTE + 1)
    quotas = Quotas(QuotasConfig(), clock=clock)
    policy = QuotaPolicy(None, 1000, None, True)
    first = await quotas.admit("k", policy, 600)
    assert headers(first)["x-ratelimit-remaining-tokens"] == "400"
    with pytest.raises(GatewayError) as refused:
        await quotas.admit("k", policy, 500)
    assert "tokens per minute" in refused.value.message and "used 600, requested 500" in refused.value.message
    first.settle(100)  # 500 refunded
    first.settle(100)  # idempotent
    second = await quotas.admit("k", policy, 500)
    assert headers(second)["x-ratelimit-remaining-tokens"] == "400"
    second.settle(800)  # used more than reserved: the excess is charged
    with pytest.raises(GatewayError):
        await quotas.admit("k", policy, 101)
    assert headers(await quotas.admit("k", policy, 100))["x-ratelimit-remaining-tokens"] == "0"
    # a request that can never fit says so
    with pytest.raises(GatewayError) as too_large:
        await quotas.admit("other", policy, 1001)
    assert "Request too large" in too_large.value.message


async def test_settle_in_a_later_window_refunds_nothing_there() -> None:
    clock = Clock(MINUTE + 59)
    quotas = Quotas(QuotasConfig(), clock=clock)
    policy = QuotaPolicy(None, 100, None, True)
    admission = await quotas.admit("k", policy, 90)
    clock.now = MINUTE + 61
    current = await quotas.admit("k", policy, 50)
    admission.settle(0)  # the refund belongs to the window that ended
    assert headers(await quotas.admit("k", policy, 50))["x-ratelimit-remaining-tokens"] == "0"
    current.settle(50)


async def test_concurrency_slots_released_by_settle() -> None:
    quotas = Quotas(QuotasConfig(), clock=Clock(MINUTE))
    policy = QuotaPolicy(None, None, 2, True)
    held = [await quotas.admit("k", policy, 1), await quotas.admit("k", policy, 1)]
    assert held[0].headers == ()  # no rate headers for a concurrency-only quota
    with pytest.raises(GatewayError) as refused:
        await quotas.admit("k", policy, 1)
    assert refused.value.status == 429 and "concurrent" in refused.value.message
    assert dict(refused.value.headers)["retry-after"] == "1"
    held[0].settle(1)
    held[0].settle(1)  # idempotent: frees one slot, not two
    held.append(await quotas.admit("k", policy, 1))
    with pytest.raises(GatewayError):
        await quotas.admit("k", policy, 1)


async def test_many_subjects_at_once_and_idle_ones_pruned() -> None:
    clock = Clock(MINUTE + 5)
    registry = CollectorRegistry()
    quotas = Quotas(QuotasConfig(), GatewayMetrics(registry), clock=clock)
    policy = QuotaPolicy(5, 50, 10, True)

    async def one(subject: str) -> bool:
        try:
            admission = await quotas.admit(subject, policy, 10)
        except GatewayError:
            return False
        await asyncio.sleep(0)
        admission.settle(10)
        return True

    results = await asyncio.gather(*(one(f"key-{i % 200}") for i in range(2000)))
    assert sum(results) == 200 * 5  # 5 per key: 5 requests and 50 tokens both bind at 5
    assert registry.get_sample_value("sluicegate_quota_decisions_total", {"outcome": "admitted"}) == 1000
    assert registry.get_sample_value("sluicegate_quota_decisions_total", {"outcome": "refused"}) == 1000
    assert registry.get_sample_value("sluicegate_quota_store_mode", {"mode": "local"}) == 1
    assert len(quotas._memory) == 200
    held = await quotas.admit("busy", policy, 1)  # a stream in flight keeps its subject
    clock.now += 60
    await quotas.admit("key-new", policy, 1)
    assert len(quotas._memory) == 2  # the idle keys of the last minute are gone
    held.settle(1)
