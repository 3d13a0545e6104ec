"""A canary route through a real gateway: weights hold, cohorts stick, overrides need the right.

Two simulated pods serve the same models, one labelled stable and one canary; each route splits a
public model between them with sticky cohorts by the OpenAI ``user`` field. Which variant served a
request is the pod the gateway names in ``x-sluicegate-pod``.

The split is checked over thousands of distinct callers at two weights, each against an exact
binomial interval that a correct gateway leaves less than once in a million runs; stickiness is
checked through a rollout's steps, moved by the judge's own passes with the admin API's pause and
resume holding each step while it is measured.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from tests.conftest import counter_totals, wait_for
from tests.keys import auth_on, key_store

# A false failure of any one binomial check below is less likely than this (exact tails, not a
# normal approximation, which understates the far tail at 5%).
FALSE_ALARM = 1e-6
SPLITS = {"split-5": 5, "split-30": 30}  # route -> canary percent
SPLIT_CALLERS = 2000  # distinct callers, one request each, per route: 4000 in all
STEPPED = "stepped"
STEPS = [5, 20, 50, 80]  # the rollout's steps; passing 80 promotes to 100
STEP_CALLERS, REQUESTS_PER_STEP = 200, 2
PODS = ["--itl-ms", "0", "--itl-per-seq-ms", "0", "--ttft-ms", "0", "--max-num-seqs", "1024"]


@dataclass
class Canary:
    gateway: GatewayProcess
    keys: dict[str, str]


def _route(canary_percent: float, **extra: Any) -> dict[str, Any]:
    return {"sticky": "user", "variants": {
        "stable": {"pods": {"variant": "stable"}, "weight": 100 - canary_percent},
        "canary": {"pods": {"variant": "canary"}, "weight": canary_percent},
    }, **extra}  # fmt: skip


@pytest.fixture(scope="module")
def canary(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Canary]:
    store: Path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys = key_store(
        store,
        {"id": "app"},
        {"id": "tester", "rights": ["variant_override"]},
        {"id": "admin", "rights": ["admin"]},
    )
    models = ["llama-8b", STEPPED, *SPLITS]
    served = [arg for model in models for arg in ("--model", model)]
    with PodsimProcess([*served, *PODS]) as stable, PodsimProcess([*served, *PODS]) as new:
        rollout = {"steps": STEPS, "min_hold_s": 0, "min_samples": 10}
        config = {
            "server": {"host": "127.0.0.1", "access_log": False},
            "auth": auth_on(store),
            "pods": [
                {"name": "stable-1", "url": stable.url, "models": models, "labels": {"variant": "stable"}},
                {"name": "canary-1", "url": new.url, "models": models, "labels": {"variant": "canary"}},
            ],
            "routes": {
                "llama-8b": _route(20),
                STEPPED: _route(STEPS[0], rollout=rollout),
                **{model: _route(percent) for model, percent in SPLITS.items()},
            },
        }
        with GatewayProcess(config) as gw:
            yield Canary(gw, keys)


def served_by(canary: Canary, user: str | None, key: str = "app", **headers: str) -> str:
    body = {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    if user is not None:
        body["user"] = user
    resp = httpx.post(canary.gateway.url + "/v1/chat/completions", json=body, timeout=30,
                      headers={"authorization": f"Bearer {canary.keys[key]}", **headers})  # fmt: skip
    assert resp.status_code == 200, resp.text
    return resp.headers["x-sluicegate-pod"]


def many_served_by(canary: Canary, model: str, users: list[str], concurrency: int = 48) -> list[str]:
    """The pod that served each user's one-token request, sent ``concurrency`` at a time over
    kept-alive connections (a few thousand requests take seconds, not a minute)."""

    async def run() -> list[str]:
        gate = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        headers = {"authorization": f"Bearer {canary.keys['app']}"}
        async with httpx.AsyncClient(timeout=30, limits=limits, headers=headers) as client:

            async def one(user: str) -> str:
                body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 1, "user": user}  # fmt: skip
                async with gate:
                    resp = await client.post(canary.gateway.url + "/v1/chat/completions", json=body)
                assert resp.status_code == 200, resp.text
                pod = resp.headers["x-sluicegate-pod"]
                # the answer names its variant too (what load tests break their numbers down by)
                assert resp.headers["x-sluicegate-variant"] == pod.split("-")[0], (pod, resp.headers)
                return pod

            return await asyncio.gather(*(one(user) for user in users))

    return asyncio.run(run())


def binomial_interval(n: int, p: float, alpha: float = FALSE_ALARM) -> tuple[int, int]:
    """The narrowest [lo, hi] with P(X < lo) <= alpha/2 and P(X > hi) <= alpha/2 for X ~ Bin(n, p),
    from exact probabilities (log-gamma, so n in the thousands is cheap and exact enough)."""
    log_p, log_q = math.log(p), math.log1p(-p)
    log_n = math.lgamma(n + 1)
    pmf = [
        math.exp(log_n - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * log_p + (n - k) * log_q)
        for k in range(n + 1)
    ]
    lo, tail = 0, 0.0
    while tail + pmf[lo] <= alpha / 2:
        tail += pmf[lo]
        lo += 1
    hi, tail = n, 0.0
    while tail + pmf[hi] <= alpha / 2:
        tail += pmf[hi]
        hi -= 1
    return lo, hi


def test_the_binomial_interval_is_exact_where_it_can_be_checked_by_hand() -> None:
    assert binomial_interval(10, 0.5, 0.02) == (1, 9)  # P(X = 0) = 1/1024 <= 0.01 < P(X <= 1) = 11/1024
    lo, hi = binomial_interval(SPLIT_CALLERS, 0.05)
    assert lo < 100 < hi and hi - 100 > 100 - lo  # right-skewed at 5%, as a normal bound is not


@pytest.mark.parametrize("model", SPLITS)
def test_the_split_holds_over_thousands_of_callers(canary: Canary, model: str) -> None:
    """2000 distinct callers at 5% and 2000 at 30%: the canary's count lies in the exact binomial
    interval with false-alarm probability 1e-6 (at 5%: 56..151 of 2000; at 30%: 501..702)."""
    before = counter_totals(canary.gateway.admin_url, "sluicegate_variant_requests", "variant", model=model)
    seen = Counter(many_served_by(canary, model, [f"{model}-caller-{i}" for i in range(SPLIT_CALLERS)]))
    assert set(seen) <= {"stable-1", "canary-1"}
    lo, hi = binomial_interval(SPLIT_CALLERS, SPLITS[model] / 100)
    assert lo <= seen["canary-1"] <= hi, (seen, (lo, hi))
    after = counter_totals(canary.gateway.admin_url, "sluicegate_variant_requests", "variant", model=model)
    for variant, pod in (("canary", "canary-1"), ("stable", "stable-1")):
        assert after.get(variant, 0) - before.get(variant, 0) == seen[pod]


def admin(canary: Canary) -> dict[str, str]:
    return {"authorization": f"Bearer {canary.keys['admin']}"}


def rollout_of(canary: Canary, model: str) -> dict[str, Any]:
    resp = httpx.get(canary.gateway.admin_url + "/admin/rollouts", headers=admin(canary))
    rollouts = resp.json()["rollouts"]
    return next(r for r in rollouts if r["route"] == model)


def steer(canary: Canary, action: str) -> dict[str, Any]:
    url = f"{canary.gateway.admin_url}/admin/rollouts/{STEPPED}/{action}?why=measuring"
    resp = httpx.post(url, headers=admin(canary))
    assert resp.status_code == 200, resp.text
    return resp.json()


def step_passed(canary: Canary) -> bool:
    return rollout_of(canary, STEPPED)["history"][-1]["what"] in ("advanced", "promoted")


def test_callers_keep_their_variant_within_a_step_and_only_move_into_the_canary(canary: Canary) -> None:
    """Each step is paused while 200 callers send 2 requests each (a pause holds the weights; the
    samples still count), then resumed: the judge passes it on its next tick, and the next step
    starts with no traffic, so it cannot pass before it is paused and measured in turn."""
    users = [f"sticky-{i}" for i in range(STEP_CALLERS)]
    assert steer(canary, "pause")["state"] == "paused"
    in_canary: set[str] = set()
    shares = []
    for step, percent in enumerate([*STEPS, 100]):
        status = rollout_of(canary, STEPPED)
        assert status["step"] == min(step, len(STEPS) - 1) and status["percent"] == percent, status
        pods = many_served_by(canary, STEPPED, users * REQUESTS_PER_STEP)
        variants: dict[str, set[str]] = {}
        for user, pod in zip(users * REQUESTS_PER_STEP, pods, strict=True):
            variants.setdefault(user, set()).add(pod)
        flipped = {user: pods for user, pods in variants.items() if len(pods) > 1}
        assert not flipped, f"at {percent}%, callers changed variant within the step: {flipped}"
        now_in = {user for user, pods in variants.items() if pods == {"canary-1"}}
        assert in_canary <= now_in, f"at {percent}%, left the canary: {sorted(in_canary - now_in)}"
        if step:
            assert now_in > in_canary, f"nobody moved into the canary at {percent}%"
        lo, hi = binomial_interval(STEP_CALLERS, percent / 100) if percent < 100 else (STEP_CALLERS,) * 2
        assert lo <= len(now_in) <= hi, (percent, len(now_in), (lo, hi))
        in_canary = now_in
        shares.append(len(now_in))
        if percent == 100:
            break
        assert steer(canary, "resume")["state"] == "progressing"
        assert wait_for(lambda: step_passed(canary), timeout_s=15), rollout_of(canary, STEPPED)
        if rollout_of(canary, STEPPED)["state"] == "progressing":
            assert steer(canary, "pause")["state"] == "paused"
    assert rollout_of(canary, STEPPED)["state"] == "promoted"
    assert shares == sorted(shares) and shares[-1] == STEP_CALLERS, shares


def test_a_caller_keeps_its_variant(canary: Canary) -> None:
    for user in ("alice", "bob", "carol", "dave"):
        assert len({served_by(canary, user) for _ in range(10)}) == 1


def test_the_override_header_needs_the_right(canary: Canary) -> None:
    on_stable = next(u for u in (f"u{i}" for i in range(200)) if served_by(canary, u) == "stable-1")
    force = {"x-sluicegate-variant": "canary"}
    assert served_by(canary, on_stable, "tester", **force) == "canary-1"
    assert served_by(canary, on_stable, "app", **force) == "stable-1"  # no right: its cohort's variant
