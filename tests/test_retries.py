"""Retry before the first token: another pod takes over, 4xx are final, and the budget holds."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from tests.conftest import counter_totals, wait_for

CHAT = {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
FAST = ["--model", "llama-8b", "--ttft-ms", "5", "--itl-ms", "2"]


@dataclass
class Pair:
    good: PodsimProcess
    bad: PodsimProcess


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    with PodsimProcess(FAST) as good, PodsimProcess(FAST) as bad:
        yield Pair(good, bad)


def _gateway(pair: Pair, **retries: float) -> GatewayProcess:
    return GatewayProcess(
        {
            "server": {"host": "127.0.0.1"},
            "timeouts": {"first_token_s": 0.5},
            "retries": {"backoff_base_s": 0.001, **retries},
            "pods": [
                {"name": "good", "url": pair.good.url, "models": ["llama-8b"]},
                {"name": "bad", "url": pair.bad.url, "models": ["llama-8b"]},
            ],
        }
    )


def _set_faults(pod: PodsimProcess, faults: dict) -> None:
    httpx.post(pod.url + "/admin/faults", json=faults).raise_for_status()


def _attempts(admin_url: str) -> dict[str, float]:
    return counter_totals(admin_url, "sluicegate_upstream_attempts", "outcome")


@pytest.fixture(autouse=True)
def _clear_faults(pair: Pair) -> Iterator[None]:
    yield
    httpx.delete(pair.bad.url + "/admin/faults")


@pytest.mark.parametrize(
    ("faults", "outcome"),
    [
        ({"status": 503}, "status_503"),
        ({"status": 502}, "status_502"),
        ({"refuse": 1}, "reset"),
        ({"first_token_delay_ms": 5000}, "first_token_timeout"),
    ],
)
def test_retryable_failures_are_retried_on_another_pod(pair: Pair, faults: dict, outcome: str) -> None:
    _set_faults(pair.bad, faults)
    with _gateway(pair) as gw:
        for _ in range(4):  # ties rotate, so some of these try the bad pod first
            resp = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)
            assert resp.status_code == 200 and resp.headers["x-sluicegate-pod"] == "good"
            assert resp.content.endswith(b"data: [DONE]\n\n")
        attempts = _attempts(gw.admin_url)
        assert attempts["ok"] == 4 and attempts[outcome] >= 1


def test_a_pod_that_went_away_is_retried_by_connect_error(pair: Pair) -> None:
    with PodsimProcess(FAST) as doomed:
        config = {
            "server": {"host": "127.0.0.1"},
            "pods": [
                {"name": "good", "url": pair.good.url, "models": ["llama-8b"]},
                {"name": "doomed", "url": doomed.url, "models": ["llama-8b"]},
            ],
        }
        with GatewayProcess(config) as gw:
            # Once both pods' metrics are in, both are candidates; a pod never scraped counts as full.
            admin = gw.admin_url + "/admin/pods"
            assert wait_for(lambda: all(p["state"]["load"]["fresh"] for p in httpx.get(admin).json()["pods"]))
            doomed.stop()
            for _ in range(3):
                resp = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)
                assert resp.status_code == 200 and resp.headers["x-sluicegate-pod"] == "good"
            assert _attempts(gw.admin_url).get("connect_error", 0) == 1  # then it is marked unreachable


def test_a_4xx_from_the_pod_is_final(pair: Pair) -> None:
    bad_request = {**CHAT, "continue_final_message": True, "add_generation_prompt": True}
    with _gateway(pair) as gw:
        resp = httpx.post(gw.url + "/v1/chat/completions", json=bad_request, timeout=30)
        assert resp.status_code == 400
        assert _attempts(gw.admin_url) == {"failed": 1}


def test_the_retry_budget_caps_retries_when_every_pod_fails(pair: Pair) -> None:
    _set_faults(pair.bad, {"status": 503})
    with _gateway(pair, budget_ratio=0.2, min_retries_per_s=0) as gw:
        statuses = []
        for _ in range(20):
            # Both pods fail: the good one through this request's own fault header.
            resp = httpx.post(
                gw.url + "/v1/chat/completions",
                json=CHAT,
                headers={"x-podsim-fault": "status=503"},
                timeout=30,
            )
            statuses.append(resp.status_code)
        assert set(statuses) == {503}
        attempts = _attempts(gw.admin_url)
        retries = sum(attempts.values()) - 20
        assert 1 <= retries <= 4  # at most 20 % of 20 requests
