"""The admission-cost benchmark, small and fast: the three configurations run and report rows.

What is asserted is that each configuration measured what it claims, not its cost (too noisy at this
size): no failed requests; with auth off no quota decision; with keys and quotas every measured
request admitted by the quota (so the key was checked and its tier's quota applied) and none
refused; with Redis one script round trip per admission, none failed, and no decision made with
Redis counted down.
"""

from __future__ import annotations

from loadtest.bench_admission import aggregate, render, run
from loadtest.redis_server import redis_server_binary


def test_keys_and_quotas_cost_is_measured_with_memory_and_redis_counters() -> None:
    runs, notes = run(streams=4, tokens=8, duration_s=1.0, key_count=20, load_keys=4)
    rows = {row.config: row for row in aggregate(runs)}
    report = render(list(rows.values()), "test", notes, "test machine", 0.10)
    expected = {"off", "memory", "redis"} if redis_server_binary() else {"off", "memory"}
    assert set(rows) == expected, report
    for row in rows.values():
        assert row.requests > 0 and row.errors == 0, report
        assert row.cpu_ms_per_request is not None and row.cpu_ms_per_request > 0, report
        assert row.ttft_p50 is not None, report
    assert rows["off"].admitted == 0, report
    for config in expected - {"off"}:
        row = rows[config]
        assert row.admitted == row.requests and row.refused == 0 and row.store_down == 0, report
    if "redis" in rows:
        assert rows["redis"].redis_round_trips >= rows["redis"].requests, report
        assert rows["redis"].redis_errors == 0, report
        assert rows["memory"].redis_round_trips == 0, report
    else:
        assert any("redis-server is not installed" in note for note in notes)
    assert "| keys + quotas, in-memory counters |" in report and "Targets:" in report
