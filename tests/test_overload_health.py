"""Overload is not failure: a real pod whose ``/health`` answers late while it streams to clients.

The pod's ``health_delay_ms`` knob makes its probe answer later than the gateway's probe timeout,
as an overloaded vLLM's API server does while it is busy streaming. The gateway must keep routing to
it while live traffic gets first tokens from it, hold the timeouts against it once that traffic
stops, and even then route to it (healthy panic threshold) rather than answer 503 to everyone.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from tests.conftest import FAST, counter_totals, pod_state, wait_for

CHAT = {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}


def gateway_config(pod_url: str, probe_interval_s: float = 0.1) -> dict:
    return {
        "server": {"host": "127.0.0.1", "access_log": False},
        "discovery": {"refresh_interval_s": 30, "retry_interval_s": 30},
        "health": {
            "probe": {
                "interval_s": probe_interval_s,
                "timeout_s": 0.2,
                "unhealthy_after": 2,
                "healthy_after": 2,
                "passive_window_s": 1.0,
            },
            "scrape": {"interval_s": 0.1},
        },
        "pods": [{"name": "pod-a", "url": pod_url, "models": ["llama-8b"]}],
    }


@pytest.fixture(scope="module")
def slow_probe() -> Iterator[tuple[PodsimProcess, GatewayProcess]]:
    with PodsimProcess(["--model", "llama-8b", *FAST]) as pod, GatewayProcess(gateway_config(pod.url)) as gw:
        yield pod, gw


def transitions(admin: str, to: str) -> float:
    return counter_totals(admin, "sluicegate_pod_transitions", "to", pod="pod-a", kind="health").get(to, 0.0)


def excused(admin_url: str) -> float:
    return counter_totals(admin_url, "sluicegate_probe_timeouts_excused", "pod").get("pod-a", 0.0)


def test_a_pod_slow_to_answer_its_probe_stays_in_service_while_it_serves(slow_probe) -> None:
    pod, gw = slow_probe
    statuses: list[int] = []
    stop = threading.Event()

    def traffic() -> None:
        with httpx.Client(timeout=10) as client:
            while not stop.is_set():
                statuses.append(client.post(gw.url + "/v1/chat/completions", json=CHAT).status_code)

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        # the pod is serving before its probes slow down (and the counts are this test's own)
        assert wait_for(lambda: len(statuses) >= 3, timeout_s=20)
        unhealthy, degraded = transitions(gw.admin_url, "unhealthy"), transitions(gw.admin_url, "degraded")
        assert httpx.post(pod.url + "/admin/faults", json={"health_delay_ms": 600}).status_code == 200
        # several probes in a row time out (each would count towards unhealthy_after=2) ...
        assert wait_for(lambda: excused(gw.admin_url) >= 5, timeout_s=20)
    finally:
        stop.set()
        worker.join()
    # ... and none was held against the pod: it never left service, no client saw an error
    assert transitions(gw.admin_url, "unhealthy") == unhealthy
    assert transitions(gw.admin_url, "degraded") == degraded
    assert statuses and set(statuses) == {200}
    assert pod_state(gw.admin_url, "pod-a")["health"] == "healthy"

    # With no traffic to vouch for it, the timeouts count: the pod is unhealthy by its probes ...
    assert wait_for(lambda: pod_state(gw.admin_url, "pod-a")["health"] == "unhealthy", timeout_s=20)
    # ... yet it is the model's only live pod, so the panic threshold still routes to it: a slow
    # probe is not an outage
    resp = httpx.post(gw.url + "/v1/chat/completions", json=CHAT)
    assert resp.status_code == 200 and "[DONE]" in resp.text
    assert httpx.get(gw.admin_url + "/admin/pods").json()["panic"] == ["llama-8b"]
    assert 'sluicegate_panic{model="llama-8b"} 1.0' in httpx.get(gw.admin_url + "/metrics").text
    assert httpx.get(gw.url + "/readyz").status_code == 200

    httpx.delete(pod.url + "/admin/faults")
    assert wait_for(lambda: pod_state(gw.admin_url, "pod-a")["health"] == "healthy", timeout_s=20)
    assert httpx.get(gw.admin_url + "/admin/pods").json()["panic"] == []


def test_a_pod_that_says_it_is_broken_is_not_rescued_by_the_panic_threshold(slow_probe) -> None:
    pod, gw = slow_probe
    assert httpx.post(pod.url + "/admin/faults", json={"unhealthy": 1}).status_code == 200
    try:
        assert wait_for(lambda: pod_state(gw.admin_url, "pod-a")["health"] == "unhealthy", timeout_s=20)
        resp = httpx.post(gw.url + "/v1/chat/completions", json=CHAT)
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_healthy_upstream"
        assert int(resp.headers["retry-after"]) >= 1
    finally:
        httpx.delete(pod.url + "/admin/faults")
    assert wait_for(lambda: pod_state(gw.admin_url, "pod-a")["health"] == "healthy", timeout_s=20)


def test_when_the_last_pod_goes_away_the_first_request_already_gets_503_and_retry_after() -> None:
    # probes every 60 s: the request itself is the first to find the pod gone
    with (
        PodsimProcess(["--model", "llama-8b", *FAST]) as pod,
        GatewayProcess(gateway_config(pod.url, probe_interval_s=60)) as gw,
    ):
        assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT).status_code == 200
        pod.stop()
        answers = [httpx.post(gw.url + "/v1/chat/completions", json=CHAT) for _ in range(3)]
    for resp in answers:
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "no_healthy_upstream"
        assert int(resp.headers["retry-after"]) >= 1
