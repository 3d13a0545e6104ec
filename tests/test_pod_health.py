"""Pod health, GPU pressure and load shedding through a real gateway, with two simulated pods.

The pods' fault knobs stand in for what a real fleet does: ``unhealthy=1`` fails ``/health``,
``kv_usage``/``waiting`` make ``/metrics`` report a full KV cache or queue, ``status=500`` makes
every answer an error. The gateway probes every 0.1 s and scrapes every 0.1 s here, so each change
shows within a few rounds; the tests wait for it on ``/admin/pods``, not on a timer.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from tests.conftest import FAST, GPU, MIG_A, MIG_B, pod_state, wait_for

CHAT = {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


class Pods:
    def __init__(self, a: PodsimProcess, b: PodsimProcess, gateway: GatewayProcess) -> None:
        self.a, self.b, self.gateway = a, b, gateway
        self.url = gateway.url
        self.admin_url = gateway.admin_url

    def fault(self, pod: PodsimProcess, **knobs: Any) -> None:
        assert httpx.post(pod.url + "/admin/faults", json=knobs).status_code == 200

    def state(self, name: str) -> dict[str, Any]:
        return pod_state(self.admin_url, name)

    def served_by(self, n: int) -> Counter[str]:
        """Which pods answered ``n`` requests, by the pods' own count of finished requests."""
        before = {name: finished(pod) for name, pod in (("pod-a", self.a), ("pod-b", self.b))}
        for _ in range(n):
            assert httpx.post(self.url + "/v1/chat/completions", json=CHAT).status_code == 200
        after = {name: finished(pod) for name, pod in (("pod-a", self.a), ("pod-b", self.b))}
        served = {name: int(after[name] - before[name]) for name in after}
        return Counter({name: n for name, n in served.items() if n})


def finished(pod: PodsimProcess) -> float:
    families = text_string_to_metric_families(httpx.get(pod.url + "/metrics").text)
    family = next(f for f in families if f.name == "vllm:request_success")
    return sum(s.value for s in family.samples if s.name.endswith("_total"))


@pytest.fixture(scope="module")
def pods() -> Iterator[Pods]:
    a = PodsimProcess(["--model", "llama-8b", "--gpu-uuid", GPU, "--mig-uuid", MIG_A, *FAST])
    b = PodsimProcess(["--model", "llama-8b", "--gpu-uuid", GPU, "--mig-uuid", MIG_B, *FAST])
    with a, b:
        config = {
            "server": {"host": "127.0.0.1"},
            "health": {
                "probe": {"interval_s": 0.1, "unhealthy_after": 2, "healthy_after": 2},
                "scrape": {"interval_s": 0.1, "stale_after_s": 2},
                "outlier": {"consecutive_failures": 3, "base_ejection_s": 60},
            },
            "tiers": {"ops": {"criticality": "critical"}},  # auth off: the tier header names it
            "pods": [
                {"name": n, "url": pod.url, "models": ["llama-8b"], "mig": {"gpu_uuid": GPU, "mig_uuid": mig}}
                for n, pod, mig in (("pod-a", a, MIG_A), ("pod-b", b, MIG_B))
            ],
        }
        with GatewayProcess(config) as gw:
            p = Pods(a, b, gw)
            assert wait_for(lambda: p.state("pod-a")["load"]["fresh"] and p.state("pod-b")["load"]["fresh"])
            yield p


@pytest.fixture(autouse=True)
def clean(pods: Pods) -> Iterator[None]:
    yield
    for pod in (pods.a, pods.b):
        httpx.delete(pod.url + "/admin/faults")
    assert wait_for(
        lambda: all(
            s["health"] == "healthy" and s["breaker"]["pressure"] == "closed"
            for s in (pods.state("pod-a"), pods.state("pod-b"))
        )
    )


def test_a_pod_failing_its_health_probe_gets_no_traffic_until_it_recovers(pods: Pods) -> None:
    pods.fault(pods.a, unhealthy=1)
    assert wait_for(lambda: pods.state("pod-a")["health"] == "unhealthy")
    assert "probe failed: HTTP 503" in pods.state("pod-a")["health_reason"]
    assert pods.served_by(6) == {"pod-b": 6}
    httpx.delete(pods.a.url + "/admin/faults")
    assert wait_for(lambda: pods.state("pod-a")["health"] == "healthy")
    assert set(pods.served_by(6)) == {"pod-a", "pod-b"}


def test_a_full_kv_cache_stops_new_streams_to_that_pod(pods: Pods) -> None:
    pods.fault(pods.a, kv_usage=0.93)
    # pod-b's long queue would make it the worse choice by load score alone; only the breaker
    # (open at 92 % KV cache, while 31 waiting is under the queue's high mark) sends it everything
    pods.fault(pods.b, kv_usage=0.1, waiting=31)
    assert wait_for(lambda: pods.state("pod-a")["breaker"]["pressure"] == "open")
    assert wait_for(lambda: pods.state("pod-b")["load"]["waiting"] == 31)
    assert pods.served_by(6) == {"pod-b": 6}
    pods.fault(pods.a, kv_usage=0.88)  # under the high mark but not the low one: still closed to us
    assert wait_for(lambda: pods.state("pod-a")["load"]["kv_cache_usage"] == 0.88)
    assert pods.served_by(4) == {"pod-b": 4}


def test_when_every_pod_is_full_clients_get_a_fast_429_and_critical_traffic_still_flows(pods: Pods) -> None:
    pods.fault(pods.a, kv_usage=0.97)
    pods.fault(pods.b, waiting=100)
    assert wait_for(lambda: all(pods.state(n)["breaker"]["pressure"] == "open" for n in ("pod-a", "pod-b")))
    started = time.perf_counter()
    resp = httpx.post(pods.url + "/v1/chat/completions", json={**CHAT, "stream": True})
    elapsed = time.perf_counter() - started
    assert resp.status_code == 429, resp.text
    assert int(resp.headers["retry-after"]) >= 1
    error = resp.json()["error"]
    assert error["type"] == "rate_limit_exceeded" and error["code"] == "pressure"
    assert elapsed < 1.0  # answered at once, never queued (the benchmark measures how fast)
    client = openai.OpenAI(base_url=pods.url + "/v1", api_key="sk-none", max_retries=0)
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(**CHAT)
    ops = openai.OpenAI(base_url=pods.url + "/v1", api_key="sk-any", max_retries=0,
                        default_headers={"x-sluicegate-tier": "ops"})  # fmt: skip
    assert ops.chat.completions.create(**CHAT).choices[0].message.content


def test_a_critical_requests_retry_keeps_its_criticality(pods: Pods) -> None:
    pods.fault(pods.a, kv_usage=0.97)  # full: only critical traffic may go there
    pods.fault(pods.b, status=503)  # the better-scored pod fails every answer
    assert wait_for(lambda: pods.state("pod-a")["breaker"]["pressure"] == "open")
    ops = {"x-sluicegate-tier": "ops"}
    resp = httpx.post(pods.url + "/v1/chat/completions", json=CHAT, headers=ops)
    assert resp.status_code == 200 and resp.headers["x-sluicegate-pod"] == "pod-a"  # retried on the full pod
    standard = httpx.post(pods.url + "/v1/chat/completions", json=CHAT)
    assert standard.status_code == 503  # a standard request's retry may not go to the full pod


def test_sheddable_traffic_is_shed_first(pods: Pods) -> None:
    pods.fault(pods.a, kv_usage=0.85)
    pods.fault(pods.b, kv_usage=0.85)
    assert wait_for(lambda: all(pods.state(n)["load"]["kv_cache_usage"] == 0.85 for n in ("pod-a", "pod-b")))
    shed = httpx.post(
        pods.url + "/v1/chat/completions", json=CHAT, headers={"x-sluicegate-criticality": "sheddable"}
    )
    assert shed.status_code == 429 and shed.json()["error"]["code"] == "sheddable_pressure"
    assert httpx.post(pods.url + "/v1/chat/completions", json=CHAT).status_code == 200
    # a client cannot promote itself: asking for "critical" without the tier is plain standard
    pods.fault(pods.a, kv_usage=0.99)
    pods.fault(pods.b, kv_usage=0.99)
    assert wait_for(lambda: all(pods.state(n)["breaker"]["pressure"] == "open" for n in ("pod-a", "pod-b")))
    claimed = httpx.post(
        pods.url + "/v1/chat/completions", json=CHAT, headers={"x-sluicegate-criticality": "critical"}
    )
    assert claimed.status_code == 429


def test_consecutive_pod_errors_eject_it_but_4xx_answers_never_do(pods: Pods) -> None:
    for _ in range(6):  # the pod's own 400s: the client's fault, not the pod's
        resp = httpx.post(
            pods.url + "/v1/chat/completions", json=CHAT, headers={"x-podsim-fault": "status=400"}
        )
        assert resp.status_code == 400
    assert pods.state("pod-a")["breaker"]["outlier"] == "closed"
    assert pods.state("pod-b")["breaker"]["outlier"] == "closed"
    pods.fault(pods.a, status=500)
    for _ in range(8):
        httpx.post(pods.url + "/v1/chat/completions", json=CHAT)
    state = pods.state("pod-a")
    assert state["breaker"]["outlier"] == "open", state
    assert "3 failures in a row" in state["breaker"]["outlier_reason"]
    assert pods.served_by(4) == {"pod-b": 4}
    metrics = httpx.get(pods.admin_url + "/metrics").text
    assert 'sluicegate_pod_transitions_total{kind="outlier",pod="pod-a",to="open"} 1.0' in metrics
