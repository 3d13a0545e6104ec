"""Pod state machines and pod selection: health hysteresis, pressure breaker, outlier ejection,
stale metrics, criticality, and the better of two choices. Pure logic, on an explicit clock."""

from __future__ import annotations

from collections import Counter

from gateway.config import HealthConfig, PodConfig
from gateway.config_load import parse_config
from gateway.pods.registry import PodRegistry
from gateway.pods.state import DEGRADED, HALF_OPEN, HEALTHY, OPEN, UNHEALTHY, HealthState

HEALTH = parse_config({}).health


def registry(n: int = 2, health: HealthConfig = HEALTH) -> PodRegistry:
    return PodRegistry(
        [PodConfig(name=f"p{i}", url=f"http://127.0.0.1:{9000 + i}", models=("m",)) for i in range(n)], health
    )


def scraped(reg: PodRegistry, name: str, now: float, kv: float = 0.1, waiting: float = 0) -> None:
    pod = reg.get(name)
    pod.load.kv_cache_usage, pod.load.waiting, pod.load.scraped_at = kv, waiting, now
    reg.load_changed(pod, pod.pressure.update(pod.load))


def test_probe_failures_degrade_then_eject_and_clean_probes_bring_the_pod_back() -> None:
    h = HealthState(HEALTH.probe)  # 3 failures out, 2 successes back
    assert h.probe_result(True) is None and h.state == HEALTHY
    assert h.probe_result(False, "HTTP 503") == DEGRADED and h.routable
    h.probe_result(False)
    assert h.probe_result(False) == UNHEALTHY and not h.routable
    assert h.probe_result(True) is None and h.state == UNHEALTHY  # one success is not enough
    assert h.probe_result(True) == HEALTHY


def test_a_device_fault_is_immediate_and_outlasts_clean_probes() -> None:
    h = HealthState(HEALTH.probe)
    assert h.set_device_fault("XID 79", now=10.0) == UNHEALTHY
    for _ in range(5):
        h.probe_result(True)
    assert h.state == UNHEALTHY and h.reason == "XID 79"
    assert not h.quarantine_over(1000.0, None)  # no quarantine: only an operator clears it
    assert h.quarantine_over(70.0, 60.0) and not h.quarantine_over(69.0, 60.0)
    assert h.set_device_fault(None, now=70.0) == HEALTHY


def test_pressure_breaker_opens_at_the_high_mark_and_closes_only_under_the_low_one() -> None:
    reg = registry(1)
    pod = reg.get("p0")
    scraped(reg, "p0", 0.0, kv=0.93)
    assert pod.pressure.open and reg.pick("m", now=0.0) is None
    scraped(reg, "p0", 1.0, kv=0.88)  # under the high mark, above the low one: stays open
    assert pod.pressure.open
    scraped(reg, "p0", 2.0, kv=0.80)
    assert not pod.pressure.open and reg.pick("m", now=2.0) is pod
    scraped(reg, "p0", 3.0, waiting=40)  # the queue alone opens it too
    assert pod.pressure.open


def test_critical_traffic_passes_the_pressure_breaker_and_sheddable_stops_first() -> None:
    reg = registry(1)
    pod = reg.get("p0")
    scraped(reg, "p0", 0.0, kv=0.85)  # above sheddable_kv (0.80), under kv_high (0.92)
    assert reg.pick("m", criticality="standard", now=0.0) is pod
    assert reg.pick("m", criticality="sheddable", now=0.0) is None
    assert reg.shed_reason("m", "sheddable", now=0.0)[:2] == (429, "sheddable_pressure")
    scraped(reg, "p0", 1.0, kv=0.95)
    assert reg.pick("m", now=1.0) is None and reg.pick("m", criticality="critical", now=1.0) is pod
    assert reg.shed_reason("m", "standard", now=1.0)[:2] == (429, "pressure")


def test_stale_metrics_count_as_saturated_unless_every_pod_is_stale() -> None:
    reg = registry(2)
    scraped(reg, "p0", 0.0)
    scraped(reg, "p1", 0.0)
    assert reg.pick("m", now=1.0) is not None and not reg.failing_open
    scraped(reg, "p1", 10.0)  # p0's data is now 10 s old (stale after 5 s)
    assert {reg.pick("m", now=10.0).name for _ in range(6)} == {"p1"}
    # nobody fresh: fail open on in-flight counts, and say so
    assert {reg.pick("m", now=100.0).name for _ in range(6)} == {"p0", "p1"}
    assert reg.failing_open == {"m"}
    scraped(reg, "p0", 101.0)
    assert reg.pick("m", now=101.0).name == "p0" and not reg.failing_open


def test_consecutive_failures_eject_and_a_single_trial_brings_the_pod_back() -> None:
    reg = registry(2)
    pod = reg.get("p0")
    for _ in range(4):
        reg.report_failure(pod, "connect_error", now=0.0)
    assert pod.outlier.state != OPEN
    reg.report_failure(pod, "connect_error", now=0.0)
    assert pod.outlier.state == OPEN
    assert {reg.pick("m", now=1.0).name for _ in range(6)} == {"p1"}
    reg.tick(31.0)  # base ejection 30 s
    assert pod.outlier.state == HALF_OPEN
    picks = [reg.pick("m", now=31.0).name for _ in range(6)]
    assert picks.count("p0") == 1  # one trial at a time
    reg.report_failure(pod, "reset", now=31.0)  # the trial failed: out again, for longer
    assert pod.outlier.state == OPEN and pod.outlier.ejected_until == 31.0 + 60.0
    reg.tick(91.0)
    reg.pick("m", exclude=(reg.get("p1"),), now=91.0)
    reg.report_success(pod)
    assert pod.outlier.state == "closed"


def test_never_more_than_max_ejection_percent_of_the_pool_is_ejected() -> None:
    reg = registry(2)  # 50 %: one of two
    for pod in reg.pods:
        for _ in range(5):
            reg.report_failure(pod, "status_503", now=0.0)
    assert sorted(p.outlier.state for p in reg.pods) == ["closed", "open"]


def test_the_lighter_pod_wins_and_equal_pods_share() -> None:
    reg = registry(2)
    scraped(reg, "p0", 0.0, kv=0.70)
    scraped(reg, "p1", 0.0, kv=0.20)
    assert {reg.pick("m", now=0.0).name for _ in range(10)} == {"p1"}
    scraped(reg, "p0", 0.0, kv=0.20)
    assert Counter(reg.pick("m", now=0.0).name for _ in range(10)) == {"p0": 5, "p1": 5}


def test_two_random_choices_among_many_avoid_the_worst_pods() -> None:
    reg = registry(5)
    for i, pod in enumerate(reg.pods):
        scraped(reg, pod.name, 0.0, kv=0.1 * i)
    picks = Counter(reg.pick("m", now=0.0).name for _ in range(2000))
    assert picks["p4"] == 0  # the worst pod never wins a pair
    assert picks["p0"] > picks["p1"] > picks["p2"] > picks["p3"] > 0
