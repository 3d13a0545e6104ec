"""The rollout state machine on simulated traffic: A/A is promoted step by step, a 2x slower canary is
rolled back at the first step with its reason, a canary with no traffic never advances, and the manual
controls (pause, resume, promote, abort) move state and weights together.

Traffic: 50 requests/s on the simulated clock, each to the canary with the current step's weight; TTFT
log-normal (median 0.3 s), ITL log-normal (30 ms), 0.5% errors and 0.2% stalls, as in
tests/test_canary_judge.py. ``tick`` is called after every request, the way the gateway will.
"""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest
from pydantic import ValidationError

from gateway.canary.judge import JudgeConfig
from gateway.canary.rollout import Change, Rollout, RolloutError
from gateway.canary.routing import Router
from gateway.config_routes import RolloutConfig, RolloutJudgeConfig, RouteConfig

RATE = 50.0
# Small gates keep the test fast; the judge's own tests cover the statistics at realistic sizes.
PLAN = RolloutConfig(steps=(5, 25, 50, 100), min_hold_s=10.0, min_samples=40, canary="next")


def _sample(rng: random.Random, ttft_scale: float = 1.0) -> dict:
    if rng.random() < 0.005:
        return {"failed": True}
    return {
        "ttft": ttft_scale * rng.lognormvariate(math.log(0.3), 0.6),
        "itl": rng.lognormvariate(math.log(0.03), 0.3),
        "stalled": rng.random() < 0.002,
    }


def _drive(
    rollout: Rollout,
    rng: random.Random,
    requests: int,
    *,
    start: float = 0.0,
    canary_ttft: float = 1.0,
    canary_traffic: bool = True,
    first_change_only: bool = False,
) -> tuple[list[Change], float]:
    """Send ``requests`` requests split by the rollout's current weights; returns changes and the clock."""
    changes: list[Change] = []
    now = start
    for _ in range(requests):
        now += 1.0 / RATE
        to_canary = canary_traffic and rng.random() * 100.0 < rollout.canary_percent
        if to_canary:
            rollout.observe(rollout.canary, **_sample(rng, canary_ttft))
        else:
            rollout.observe("stable", **_sample(rng))
        change = rollout.tick(now)
        if change is not None:
            changes.append(change)
            if first_change_only or rollout.state in ("promoted", "rolled_back"):
                break
    return changes, now


def _assert_weights_match(rollout: Rollout) -> None:
    expected = {"promoted": 100.0, "rolled_back": 0.0}.get(rollout.state, rollout.config.steps[rollout.step])
    assert rollout.canary_percent == expected
    assert rollout.weights() == {"next": expected, "stable": 100.0 - expected}


@pytest.mark.parametrize("seed", range(3))
def test_a_a_advances_through_every_step_to_promoted(seed: int) -> None:
    rollout = Rollout("llama", PLAN, started_at=0.0)
    router = Router("llama", RouteConfig(variants={"stable": {"weight": 100}, "next": {"pods": {"v": "n"}}}))
    changes, now = _drive(rollout, random.Random(seed), 20_000)
    assert [c.what for c in changes] == ["advanced", "advanced", "promoted"]
    assert [c.weights["next"] for c in changes] == [25.0, 50.0, 100.0]
    for change in changes:
        router = router.with_weights(change.weights)  # what the caller does with a Change
        assert router.weights["next"] == change.weights["next"]
    assert rollout.state == "promoted"
    _assert_weights_match(rollout)
    # Each step held at least min_hold_s and had min_samples per variant before it passed.
    times = [event.at for event in rollout.history]
    assert all(later - earlier >= PLAN.min_hold_s for earlier, later in itertools.pairwise(times))
    for change in changes:
        clean = change.event.evidence["clean"]
        assert min(clean["canary"]["streams"], clean["stable"]["streams"]) >= PLAN.min_samples
    # Over: more samples are ignored and nothing changes.
    before = rollout.judge.to_state()
    assert _drive(rollout, random.Random(seed), 100, start=now)[0] == []
    assert rollout.judge.to_state() == before


def test_a_2x_slower_canary_is_rolled_back_at_the_first_step() -> None:
    rollout = Rollout("llama", PLAN, started_at=0.0)
    changes, now = _drive(rollout, random.Random(7), 20_000, canary_ttft=2.0)
    assert [c.what for c in changes] == ["rolled_back"]
    change = changes[0]
    assert change.weights == {"next": 0.0, "stable": 100.0}
    assert rollout.state == "rolled_back" and rollout.step == 0
    event = rollout.history[-1]
    assert event.what == "rolled_back" and "ttft" in event.triggered and "ttft" in event.reason
    assert event.evidence is not None and event.evidence["decision"] == "fail"
    assert now < 60.0  # 5% of 50 req/s: caught within seconds, not minutes
    _assert_weights_match(rollout)
    with pytest.raises(RolloutError, match="rolled_back"):
        rollout.promote(now)


def test_no_canary_traffic_stays_inconclusive_at_step_0() -> None:
    rollout = Rollout("llama", PLAN, started_at=0.0)
    changes, now = _drive(rollout, random.Random(3), 10_000, canary_traffic=False)
    assert changes == []
    assert rollout.state == "progressing" and rollout.step == 0
    status = rollout.status()
    assert status["verdict"]["reason"].startswith("inconclusive")
    assert status["samples"]["next"]["clean"] == 0 and status["samples"]["stable"]["clean"] == 10_000
    assert status["hold_elapsed_s"] == pytest.approx(now)
    json.dumps(status, allow_nan=False)  # strict JSON for the admin API: no NaN from empty variants


def test_paused_holds_a_pass_and_resume_advances() -> None:
    rollout = Rollout("llama", PLAN, started_at=0.0)
    change = rollout.pause(1.0, "investigating a page")
    assert change.what == "paused" and change.weights == {"next": 5.0, "stable": 95.0}
    changes, now = _drive(rollout, random.Random(11), 4_000)
    assert changes == [] and rollout.state == "paused" and rollout.step == 0
    assert rollout.last_verdict is not None and rollout.last_verdict.decision == "pass"
    assert rollout.resume(now).what == "resumed"
    change = rollout.tick(now)
    assert change is not None and change.what == "advanced" and change.weights["next"] == 25.0
    _assert_weights_match(rollout)
    assert [e.what for e in rollout.history] == ["started", "paused", "resumed", "advanced"]
    with pytest.raises(RolloutError, match="progressing"):
        rollout.resume(now)


def test_paused_still_rolls_back_a_bad_canary() -> None:
    rollout = Rollout("llama", PLAN, started_at=0.0)
    rollout.pause(0.0, "")
    changes, _ = _drive(rollout, random.Random(5), 20_000, canary_ttft=2.0)
    assert [c.what for c in changes] == ["rolled_back"]
    _assert_weights_match(rollout)


def test_promote_and_abort() -> None:
    promoted = Rollout("llama", PLAN, started_at=0.0)
    change = promoted.promote(2.0)
    assert change.what == "promoted" and change.weights == {"next": 100.0, "stable": 0.0}
    _assert_weights_match(promoted)
    with pytest.raises(RolloutError):
        promoted.abort(3.0, "too late")

    aborted = Rollout("llama", PLAN, started_at=0.0)
    aborted.pause(1.0, "hold on")
    change = aborted.abort(2.0, "bad answers reported")
    assert change.what == "rolled_back" and change.reason == "bad answers reported"
    assert change.weights == {"next": 0.0, "stable": 100.0}
    _assert_weights_match(aborted)
    assert aborted.tick(3.0) is None
    status = aborted.status()
    assert status["state"] == "rolled_back" and status["weights"] == change.weights
    assert [e["what"] for e in status["history"]] == ["started", "paused", "rolled_back"]
    json.dumps(status, allow_nan=False)


def test_other_variants_are_ignored_and_the_judge_is_per_step() -> None:
    rollout = Rollout("llama", PLAN, started_at=0.0)
    rollout.observe("shadow", ttft=0.3)
    assert sum(rollout.judge.to_state().values()) == 0
    _drive(rollout, random.Random(2), 4_000, first_change_only=True)
    assert rollout.step == 1
    # The new step's judge started empty, at the step's start.
    assert rollout.status()["samples"]["next"]["clean"] < PLAN.min_samples


def test_config_validation() -> None:
    assert JudgeConfig(**RolloutJudgeConfig().model_dump()) == JudgeConfig()  # same defaults
    assert RolloutConfig().steps == (1, 5, 25, 50, 100)
    for steps in [(5, 5, 50), (0, 50), (50, 10), (10, 101), (100,), ()]:
        with pytest.raises(ValidationError):
            RolloutConfig(steps=steps)
    variants = {"stable": {"weight": 1}, "canary": {"pods": {"v": "c"}}}
    RouteConfig(variants=variants, rollout={})
    with pytest.raises(ValidationError, match="exactly the variants"):
        RouteConfig(variants=variants, rollout={"canary": "next"})
    with pytest.raises(ValidationError, match="exactly the variants"):
        RouteConfig(variants={**variants, "shadow": {"pods": {"v": "s"}}}, rollout={})
    with pytest.raises(ValueError, match="exactly the variants"):
        Rollout("llama", RolloutConfig(), started_at=0.0, variants=["stable", "canary", "x"])
    with pytest.raises(ValueError, match="cannot be 'stable'"):
        Rollout("llama", RolloutConfig(canary="stable"), started_at=0.0)
