"""A/A rollouts through a real gateway never roll back; a canary 2x slower to its first token does.

The small version of ``make canary-aa`` (``loadtest/canary_aa.py``): five seeded A/A runs and one bad
canary in one gateway, each run on its own route with its own judge. The bad one is what makes the
A/A result mean something: the same harness, plan and load must catch a real regression.
"""

from __future__ import annotations

import pytest

from loadtest.canary_aa import Plan, Result, main, run_batch

AA_SEEDS = range(1, 6)


def test_identical_canaries_are_promoted_and_a_slower_one_is_rolled_back() -> None:
    runs = [Result("aa", seed) for seed in AA_SEEDS] + [Result("ttft", 1)]
    run_batch(runs, Plan(), max_seconds=45)
    *aa, bad = runs
    assert [r.outcome for r in aa] == ["promoted"] * len(aa), aa
    assert all(r.percent == 100 and r.canary_requests > 0 for r in aa), aa
    assert bad.outcome == "rolled_back" and "ttft" in bad.triggered, bad
    assert bad.percent == Plan().steps[0]  # caught at its first step


def test_the_command_refuses_an_unknown_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--scenarios", "aa,nope"])
    assert exited.value.code == 2
    assert "unknown scenario nope" in capsys.readouterr().err
