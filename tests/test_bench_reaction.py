"""The reaction benchmark, small and fast: a faulty or full slice stops getting traffic, and comes back.

Two rounds per scenario on the same pod (so a slice that faults again after an operator cleared it
is covered), with the gateway reading pods and exporter every 0.2 s and four clients. What is
asserted is what users see, not timing: every request answered in full, the pod served requests
before its fault and none once ``/admin/pods`` showed it out, and after clearing it serves again (the
benchmark raises otherwise).
"""

from __future__ import annotations

from loadtest.bench_reaction import SCENARIOS, problems, render, run


def test_a_faulty_or_full_slice_stops_getting_traffic_and_comes_back() -> None:
    result = run(rounds=2, interval_s=0.2, clients=4)
    assert problems(result) == [], render(result, "test")
    assert set(result["statuses"]) == {"200"}
    for scenario in SCENARIOS:
        rounds = result["rounds"][scenario]
        assert len(rounds) == 2
        for r in rounds:
            assert r.served_before > 0
            assert r.shown_out_s is not None
            assert r.stragglers == 0 and r.answered_after == 0
            assert r.back_s is not None
