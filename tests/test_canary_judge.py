"""The canary judge on simulated traffic: A/A never fails, each A/B regression is caught, infra
samples are never held against the canary, and merged replica states judge like one judge.

Traffic: 50 requests/s, each to the canary with the step's weight; TTFT log-normal (median 0.3 s) with
a 2% Pareto tail, ITL log-normal (median 30 ms/token); a failed stream has neither. The verdict is asked
after every request, the way the gateway will ask it.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

import pytest

from gateway.canary import Judge, JudgeConfig, Verdict
from gateway.canary.judge import STATE_KEYS

RATE = 50.0  # requests per second, to turn a request count into the caller's clock


@dataclass(frozen=True)
class Profile:
    """How one variant's pods behave."""

    ttft_scale: float = 1.0
    error_rate: float = 0.005
    stall_rate: float = 0.002


HEALTHY = Profile()


def _sample(rng: random.Random, p: Profile) -> dict:
    failed = rng.random() < p.error_rate
    stalled = not failed and rng.random() < p.stall_rate
    if failed:
        return {"failed": True}
    ttft = p.ttft_scale * rng.lognormvariate(math.log(0.3), 0.6)
    if rng.random() < 0.02:
        ttft *= rng.paretovariate(1.5)
    return {"ttft": ttft, "itl": rng.lognormvariate(math.log(0.03), 0.3), "stalled": stalled}


def _run(
    seed: int,
    requests: int,
    weight: float,
    canary: Profile,
    stable: Profile = HEALTHY,
    judge: Judge | None = None,
) -> tuple[Verdict, int]:
    """Feed ``requests`` requests, asking after each; stop at the first fail. Returns the last verdict
    and how many canary samples had been seen."""
    rng = random.Random(seed)
    judge = judge or Judge(min_samples=100, min_hold_s=60.0, started_at=0.0)
    seen = 0
    verdict = judge.verdict(0.0)
    for i in range(requests):
        to_canary = rng.random() < weight
        seen += to_canary
        judge.add("canary" if to_canary else "stable", **_sample(rng, canary if to_canary else stable))
        verdict = judge.verdict((i + 1) / RATE)
        if verdict.decision == "fail":
            break
    return verdict, seen


def test_a_a_never_fails_and_passes_once_gates_are_met() -> None:
    for seed in range(50):
        weight = 0.05 if seed % 2 else 0.5
        verdict, seen = _run(seed, 4000, weight, HEALTHY)
        assert verdict.decision == "pass", (seed, weight, verdict.reason)
        assert seen >= 100


AB_CASES = {
    # name: (canary, stable, the metric that must trigger, most canary samples the median may take)
    "ttft_2x": (Profile(ttft_scale=2.0), HEALTHY, "ttft", 40),
    "errors_5pct": (Profile(error_rate=0.05), HEALTHY, "errors", 400),
    "stalls_3pct": (Profile(stall_rate=0.03), Profile(stall_rate=0.0), "stalls", 450),
}


@pytest.mark.parametrize("case", sorted(AB_CASES))
def test_a_b_regression_is_caught_at_5_percent_weight(case: str) -> None:
    canary, stable, metric, median_bound = AB_CASES[case]
    needed = []
    for seed in range(15):
        verdict, seen = _run(1000 + seed, 40_000, 0.05, canary, stable)
        assert verdict.decision == "fail", (case, seed, verdict.reason)
        assert metric in verdict.triggered
        evidence = {m.metric: m for m in verdict.metrics}[metric]
        assert evidence.statistic >= evidence.threshold == pytest.approx(math.log(4 / 0.01))
        needed.append(seen)
    median = statistics.median(needed)
    print(
        f"\n{case}: median {median:.0f} canary samples to fail at 5% weight "
        f"(min {min(needed)}, max {max(needed)}; {median / (0.05 * RATE):.0f} s at 50 req/s)"
    )
    assert median <= median_bound


def test_infra_samples_are_never_held_against_the_canary() -> None:
    rng = random.Random(7)
    judge = Judge(min_samples=100, min_hold_s=60.0)
    for i in range(6000):
        to_canary = rng.random() < 0.2
        if to_canary and rng.random() < 0.3:
            # A canary pod under GPU pressure: ten times slower, half its streams fail or stall.
            judge.add(
                "canary",
                ttft=10 * rng.lognormvariate(math.log(0.3), 0.6),
                itl=0.5,
                failed=rng.random() < 0.5,
                stalled=rng.random() < 0.5,
                infra=True,
            )
        else:
            judge.add("canary" if to_canary else "stable", **_sample(rng, HEALTHY))
        assert judge.verdict(i / RATE).decision != "fail"
    verdict = judge.verdict(6000 / RATE)
    assert verdict.decision == "pass"
    infra, clean = verdict.infra["canary"], verdict.clean["canary"]
    assert infra.streams > 300 and infra.errors > 100 and infra.stalls > 50
    assert infra.ttft_gmean_s is not None and infra.ttft_gmean_s > 2.0
    assert clean.ttft_gmean_s is not None and clean.ttft_gmean_s < 0.5
    assert verdict.infra["stable"].streams == 0
    # Only clean samples are judged: a failed stream has no TTFT, infra streams are not counted.
    assert {m.metric: m.n_canary for m in verdict.metrics}["ttft"] == clean.streams - clean.errors


def test_a_canary_seen_only_on_infra_pods_is_inconclusive() -> None:
    judge = Judge(min_samples=10, min_hold_s=0.0)
    for _ in range(500):
        judge.add("stable", ttft=0.3, itl=0.03)
        judge.add("canary", ttft=0.3, itl=0.03, infra=True)
    verdict = judge.verdict(1e6)
    assert verdict.decision == "continue"
    assert verdict.reason.startswith("inconclusive: 0 canary")


def test_no_traffic_is_inconclusive_never_pass() -> None:
    judge = Judge(min_samples=1, min_hold_s=0.0)
    assert judge.verdict(1e9).decision == "continue"
    judge.add("stable", ttft=0.3)
    assert judge.verdict(1e9).decision == "continue"
    judge.add("canary", ttft=0.3)
    assert judge.verdict(1e9).decision == "pass"


def test_pass_waits_for_both_the_sample_and_the_hold() -> None:
    judge = Judge(min_samples=50, min_hold_s=120.0, started_at=1000.0)
    for _ in range(49):
        judge.add("stable", ttft=0.3, itl=0.03)
        judge.add("canary", ttft=0.3, itl=0.03)
    assert judge.verdict(5000.0).reason.startswith("inconclusive: 49 canary and 49 stable")
    judge.add("stable", ttft=0.3, itl=0.03)
    judge.add("canary", ttft=0.3, itl=0.03)
    early = judge.verdict(1119.0)
    assert early.decision == "continue" and early.reason.startswith("holding")
    assert judge.verdict(1120.0).decision == "pass"


def test_merged_replicas_judge_exactly_like_one_judge() -> None:
    rng = random.Random(3)
    one, a, b = Judge(), Judge(), Judge()
    for _ in range(3000):
        variant = "canary" if rng.random() < 0.1 else "stable"
        sample = _sample(rng, Profile(ttft_scale=1.3) if variant == "canary" else HEALTHY)
        sample["infra"] = rng.random() < 0.05
        one.add(variant, **sample)
        (a if rng.random() < 0.5 else b).add(variant, **sample)
    merged = Judge()
    merged.merge(a.to_state())
    # Redis hands a hash back as strings (or bytes): the merge takes them as they come.
    merged.merge({k: str(v).encode() for k, v in b.to_state().items()})
    assert merged.to_state() == one.to_state()
    assert merged.verdict(100.0) == one.verdict(100.0)
    a_state = a.to_state()
    a.merge(b.to_state())
    assert a.to_state() == one.to_state()
    b.merge(a_state)  # the other order gives the same integers
    assert b.to_state() == one.to_state()
    assert set(one.to_state()) == set(STATE_KEYS)


def test_merge_refuses_a_state_it_does_not_know() -> None:
    with pytest.raises(ValueError, match="unknown keys"):
        Judge().merge({"canary.clean.p99": 3})


def test_bad_input_is_refused_with_a_reason() -> None:
    judge = Judge()
    with pytest.raises(ValueError, match="unknown variant"):
        judge.add("blue", ttft=0.1)  # type: ignore[arg-type]
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(ValueError, match="finite, non-negative"):
            judge.add("canary", ttft=bad)
    with pytest.raises(ValueError, match="min_samples"):
        Judge(min_samples=0)
    with pytest.raises(ValueError, match="alpha"):
        JudgeConfig(alpha=0.0)


def test_evidence_says_what_was_compared() -> None:
    judge = Judge(min_samples=20, min_hold_s=0.0)
    for i in range(200):
        judge.add("stable", ttft=0.2 * (1 + (i % 7) / 10), itl=0.03)
        judge.add("canary", ttft=0.3 * (1 + (i % 7) / 10), itl=0.03, failed=i % 50 == 0)
    verdict = judge.verdict(10.0)
    assert verdict.decision == "fail" and verdict.triggered == ("ttft",)
    ttft = verdict.metrics[0]
    assert ttft.metric == "ttft" and ttft.n_stable == 200 and ttft.n_canary == 200
    assert ttft.effect == pytest.approx(1.5, rel=1e-3) and ttft.margin == pytest.approx(1.1)
    errors = {m.metric: m for m in verdict.metrics}["errors"]
    assert errors.canary == pytest.approx(4 / 200) and errors.stable == 0.0 and not errors.triggered
    as_dict = verdict.as_dict()
    assert as_dict["decision"] == "fail" and as_dict["metrics"][0]["metric"] == "ttft"
