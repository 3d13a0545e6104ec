"""Rollouts through a real gateway: a worse canary is rolled back by itself, an equal one promoted,
an operator can steer, and a rollback cuts no stream.

Two simulated pods serve the model; the canary's is slower to its first token where a test wants a
bad canary. The rollout's state is read where an operator reads it: ``/admin/rollouts``.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from loadtest.procs import GatewayProcess
from tests.canary import canary_config, canary_pods
from tests.conftest import wait_for

_users = itertools.count()


@contextmanager
def rollout_gateway(canary_ttft_ms: int, steps: list[float], **plan: Any) -> Iterator[GatewayProcess]:
    with canary_pods(canary_ttft_ms) as (stable, new), \
            GatewayProcess(canary_config(stable.url, new.url, {"steps": steps, **plan})) as gw:  # fmt: skip
        yield gw


def stream(gw: GatewayProcess, max_tokens: int = 4) -> str:
    body = {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "max_tokens": max_tokens, "user": f"user-{next(_users)}"}  # fmt: skip
    resp = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n")
    return resp.headers["x-sluicegate-pod"]


def rollout(gw: GatewayProcess) -> dict[str, Any]:
    return httpx.get(gw.admin_url + "/admin/rollouts").json()["rollouts"][0]


def drive_until(gw: GatewayProcess, state: str, limit: int = 3000) -> int:
    """Streams with fresh users until the rollout is in ``state``; how many it took."""
    for sent in range(1, limit + 1):
        stream(gw)
        if sent % 10 == 0 and rollout(gw)["state"] == state:
            return sent
    raise AssertionError(f"not {state} after {limit} streams: {rollout(gw)}")


def test_a_canary_slower_to_its_first_token_is_rolled_back_by_itself() -> None:
    with rollout_gateway(80, [50, 100], min_hold_s=1, min_samples=20) as gw:
        sent = drive_until(gw, "rolled_back")
        status = rollout(gw)
        assert status["weights"]["canary"] == 0
        assert any("ttft" in str(event).lower() for event in status["history"]), status["history"]
        assert {stream(gw) for _ in range(30)} == {"stable-1"}  # the whole cohort is back on stable
        assert sent < 1000
        metrics = httpx.get(gw.admin_url + "/metrics").text
        assert 'sluicegate_rollout_state{model="llama-8b",state="rolled_back"} 1.0' in metrics
        assert 'sluicegate_rollout_canary_percent{model="llama-8b"} 0.0' in metrics


def test_a_canary_as_good_as_stable_is_promoted() -> None:
    with rollout_gateway(5, [50, 100], min_hold_s=0.5, min_samples=30) as gw:
        drive_until(gw, "promoted")
        assert rollout(gw)["weights"]["canary"] == 100
        assert {stream(gw) for _ in range(20)} == {"canary-1"}


def test_an_operator_steers_and_a_rollback_cuts_no_stream() -> None:
    with rollout_gateway(5, [50, 100], min_hold_s=3600, min_samples=10**6) as gw:
        steer = gw.admin_url + "/admin/rollouts/llama-8b/"
        assert httpx.post(steer + "pause?why=test").json()["state"] == "paused"
        assert httpx.post(gw.admin_url + "/admin/rollouts/llama-8b/resume").json()["state"] == "progressing"
        assert httpx.post(gw.admin_url + "/admin/rollouts/llama-8b/sideways").status_code == 400
        assert httpx.post(gw.admin_url + "/admin/rollouts/nope/abort").status_code == 404
        results: list[str] = []
        started = threading.Barrier(9)

        def long_stream() -> None:
            body = {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                    "max_tokens": 300, "user": f"user-{next(_users)}"}  # fmt: skip
            with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=30) as resp:
                chunks = resp.iter_bytes()
                text = next(chunks)
                started.wait(10)
                results.append((text + b"".join(chunks)).decode())

        threads = [threading.Thread(target=long_stream) for _ in range(8)]
        for thread in threads:
            thread.start()
        started.wait(10)
        aborted = httpx.post(gw.admin_url + "/admin/rollouts/llama-8b/abort?why=bad%20smell").json()
        assert aborted["state"] == "rolled_back" and aborted["weights"]["canary"] == 0
        for thread in threads:
            thread.join(30)
        assert len(results) == 8 and all(text.endswith("data: [DONE]\n\n") for text in results)
        assert wait_for(lambda: {stream(gw) for _ in range(10)} == {"stable-1"})
