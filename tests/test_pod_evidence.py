"""How probe results, live traffic and device faults combine into "may this pod get traffic?".

Pure logic on an explicit clock: the monitor's verdict on each probe (``record_probe``) and the
registry's healthy panic threshold. The system-level version (a real pod whose ``/health`` is slow
while it serves) is in ``test_overload_health.py``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from gateway.config import HealthConfig, PodConfig
from gateway.config_load import parse_config
from gateway.metrics import GatewayMetrics
from gateway.pods.monitor import PodMonitor
from gateway.pods.prober import ProbeResult
from gateway.pods.registry import PodRegistry
from gateway.pods.state import DEGRADED, HEALTHY, UNHEALTHY

HEALTH = parse_config({}).health  # 3 failures out, 2 successes back, passive window 10 s, panic at 50 %
TIMEOUT = ProbeResult(False, False, "timed out after 1 s", 1.0)
ANSWERED_503 = ProbeResult(False, True, "HTTP 503", 0.002)
REFUSED = ProbeResult(False, True, "[Errno 111] Connection refused", 0.001)
OK = ProbeResult(True, True, "HTTP 200", 0.001)


def fleet(n: int, health: HealthConfig = HEALTH) -> tuple[PodRegistry, PodMonitor, GatewayMetrics]:
    metrics = GatewayMetrics(CollectorRegistry())
    pods = [PodConfig(name=f"p{i}", url=f"http://127.0.0.1:{9000 + i}", models=("m",)) for i in range(n)]
    reg = PodRegistry(pods, health, metrics)
    return reg, PodMonitor(reg, health), metrics


def sample(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return value or 0.0


def test_probe_timeouts_are_not_held_against_a_pod_that_is_serving_live_traffic() -> None:
    reg, monitor, metrics = fleet(1)
    pod = reg.get("p0")
    pod.served_at = 100.0  # a first token reached a client at t=100
    for t in (101.0, 103.0, 105.0, 107.0, 109.0):
        monitor.record_probe(pod, TIMEOUT, now=t)
    assert pod.health.state == HEALTHY
    assert sample(metrics, "sluicegate_probe_timeouts_excused_total", pod="p0") == 5
    # traffic stopped 10 s ago: the same timeouts now count
    monitor.record_probe(pod, TIMEOUT, now=111.0)
    assert pod.health.state == DEGRADED
    monitor.record_probe(pod, TIMEOUT, now=113.0)
    monitor.record_probe(pod, TIMEOUT, now=115.0)
    assert pod.health.state == UNHEALTHY and not pod.health.condemned  # soft: a panic may still use it


def test_a_pod_that_answers_it_is_broken_or_refuses_is_believed_whatever_the_traffic_says() -> None:
    for result in (ANSWERED_503, REFUSED):
        reg, monitor, _ = fleet(1)
        pod = reg.get("p0")
        pod.served_at = 100.0
        for t in (100.5, 101.0, 101.5):
            monitor.record_probe(pod, result, now=t)
        assert pod.health.state == UNHEALTHY and pod.health.condemned, result


def test_a_streak_with_one_hard_failure_is_hard() -> None:
    reg, monitor, _ = fleet(1)
    pod = reg.get("p0")
    for result in (TIMEOUT, ANSWERED_503, TIMEOUT):
        monitor.record_probe(pod, result, now=50.0)
    assert pod.health.state == UNHEALTHY and pod.health.condemned
    for _ in range(2):
        monitor.record_probe(pod, OK, now=51.0)
    assert pod.health.state == HEALTHY


def test_below_the_panic_threshold_routing_spans_every_live_pod() -> None:
    reg, monitor, metrics = fleet(3)
    _, p1, p2 = reg.pods
    for pod in (p1, p2):  # two of three time out on their probes with no traffic to vouch for them
        for _ in range(3):
            monitor.record_probe(pod, TIMEOUT, now=50.0)
    assert (p1.health.state, p2.health.state) == (UNHEALTHY, UNHEALTHY)
    # 1 of 3 routable is under 50 %: the probes are more likely wrong than two pods broken at once
    assert {reg.pick("m", now=50.0).name for _ in range(30)} == {"p0", "p1", "p2"}
    assert reg.panicking == {"m"}
    assert sample(metrics, "sluicegate_panic", model="m") == 1
    for _ in range(2):
        monitor.record_probe(p1, OK, now=52.0)
    assert {reg.pick("m", now=52.0).name for _ in range(30)} == {"p0", "p1"}  # 2 of 3: normal routing
    assert not reg.panicking and sample(metrics, "sluicegate_panic", model="m") == 0


def test_a_panic_never_sends_traffic_to_a_device_fault_a_drain_or_a_pod_that_said_it_is_broken() -> None:
    reg, monitor, _ = fleet(4)
    p0, p1, p2, p3 = reg.pods
    for _ in range(3):
        monitor.record_probe(p0, TIMEOUT, now=50.0)  # soft: may be used in a panic
        monitor.record_probe(p1, ANSWERED_503, now=50.0)  # the engine said it is dead
    p2.health.set_device_fault("XID 79 (dcgm)", now=50.0)
    p3.health.set_draining(True)
    picks = {reg.pick("m", now=50.0).name for _ in range(20)}
    assert picks == {"p0"} and reg.panicking == {"m"}


def test_no_pod_alive_is_a_503_and_live_but_full_pods_are_a_429() -> None:
    reg, monitor, _ = fleet(2)
    for pod in reg.pods:
        for _ in range(3):
            monitor.record_probe(pod, TIMEOUT, now=50.0)
    pod = reg.pick("m", now=50.0)
    assert pod is not None  # every probe timing out is not an outage
    for pod in reg.pods:
        pod.load.kv_cache_usage, pod.load.scraped_at = 0.99, 50.0
        pod.pressure.update(pod.load)
    assert reg.pick("m", now=50.0) is None
    assert reg.shed_reason("m", "standard", now=50.0)[:2] == (429, "pressure")
    for pod in reg.pods:
        pod.health.set_device_fault("XID 48 (dcgm)", now=50.0)
    assert reg.shed_reason("m", "standard", now=50.0)[:2] == (503, "no_healthy_pod")


def test_the_panic_threshold_can_be_turned_off() -> None:
    health = parse_config({"health": {"panic_threshold_percent": 0}}).health
    reg, monitor, _ = fleet(2, health)
    for _ in range(3):
        monitor.record_probe(reg.get("p1"), TIMEOUT, now=50.0)
    assert {reg.pick("m", now=50.0).name for _ in range(20)} == {"p0"}
    for _ in range(3):
        monitor.record_probe(reg.get("p0"), TIMEOUT, now=50.0)
    assert reg.pick("m", now=50.0) is None and not reg.panicking
    assert reg.shed_reason("m", "standard", now=50.0)[0] == 503


def test_a_pod_out_by_hard_failures_stays_out_of_a_panic_until_it_is_back() -> None:
    reg, monitor, _ = fleet(3)
    p0 = reg.get("p0")
    for _ in range(3):
        monitor.record_probe(p0, ANSWERED_503, now=50.0)
    monitor.record_probe(p0, OK, now=52.0)  # one clean probe is not enough to come back ...
    monitor.record_probe(p0, TIMEOUT, now=54.0)  # ... and a timeout after it does not soften the verdict
    assert p0.health.state == UNHEALTHY and p0.health.condemned
    for pod in reg.pods[1:]:
        for _ in range(3):
            monitor.record_probe(pod, TIMEOUT, now=54.0)
    assert reg.panicking == {"m"} and {reg.pick("m", now=54.0).name for _ in range(30)} == {"p1", "p2"}


async def test_a_pod_whose_model_list_is_nested_too_deep_is_unreachable_and_discovery_goes_on() -> None:
    import asyncio

    from gateway.config import DiscoveryConfig
    from gateway.pods.discovery import refresh_pod

    body = b"[" * 100_000

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                     b"connection: close\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    metrics = GatewayMetrics(CollectorRegistry())
    reg = PodRegistry([PodConfig(name="deep", url=f"http://127.0.0.1:{port}")], HEALTH, metrics)
    pod = reg.get("deep")
    async with server:
        await refresh_pod(pod, DiscoveryConfig(), metrics)  # must not raise
    assert not pod.reachable and pod.last_error
