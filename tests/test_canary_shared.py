"""One rollout shared by two real gateway processes through a real Redis: both serve the same step,
their samples feed one judge, and exactly one of them makes each decision; an operator's command on
one reaches the other within a couple of ticks.

Two simulated pods serve the model (the canary's slower to its first token where a test wants a bad
canary); the gateways take turns, so each sees about half the traffic.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx

from loadtest.procs import GatewayProcess
from tests.canary import canary_config, canary_pods
from tests.conftest import wait_for
from tests.redis_server import RedisServer, needs_redis_server

pytestmark = needs_redis_server()

_users = itertools.count()
DECIDED = "rollout llama-8b: rolled_back"  # the decider's WARNING line; followers log "follows"


@contextmanager
def two_gateways(canary_ttft_ms: int, steps: list[float], **plan: Any) -> Iterator[list[GatewayProcess]]:
    with ExitStack() as stack:
        redis = stack.enter_context(RedisServer())
        stable, new = stack.enter_context(canary_pods(canary_ttft_ms))
        config = canary_config(stable.url, new.url, {"steps": steps, **plan}, quotas={"redis_url": redis.url})
        gws = [stack.enter_context(GatewayProcess(config)) for _ in range(2)]
        gws[0].redis = redis  # type: ignore[attr-defined]  # for the test that takes it away
        yield gws


def stream(gw: GatewayProcess) -> str:
    body = {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "max_tokens": 4, "user": f"user-{next(_users)}"}  # fmt: skip
    resp = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n")
    return resp.headers["x-sluicegate-pod"]


def rollout(gw: GatewayProcess) -> dict[str, Any]:
    return httpx.get(gw.admin_url + "/admin/rollouts").json()["rollouts"][0]


def events(gw: GatewayProcess, what: str) -> list[dict[str, Any]]:
    return [event for event in rollout(gw)["history"] if event["what"] == what]


def test_a_slower_canary_is_rolled_back_once_on_the_samples_of_both() -> None:
    with two_gateways(80, [50, 100], min_hold_s=1, min_samples=20) as gws:
        sent = [0, 0]
        for n in range(3000):
            stream(gws[n % 2])
            sent[n % 2] += 1
            if n % 10 == 9 and rollout(gws[0])["state"] == "rolled_back":
                break
        assert wait_for(lambda: all(rollout(gw)["state"] == "rolled_back" for gw in gws), timeout_s=5)
        statuses = [rollout(gw) for gw in gws]
        assert all(status["weights"]["canary"] == 0 for status in statuses)
        # One decision: the same event in both histories, logged as decided by one gateway only.
        rolled_back = [events(gw, "rolled_back") for gw in gws]
        assert len(rolled_back[0]) == 1 and rolled_back[0] == rolled_back[1], rolled_back
        assert sum(gw.log().count(DECIDED) for gw in gws) == 1, [gw.log() for gw in gws]
        # The judge that failed the canary had both gateways' samples: more than either sent.
        clean = rolled_back[0][0]["evidence"]["clean"]
        judged = clean["stable"]["streams"] + clean["canary"]["streams"]
        assert judged > max(sent), (judged, sent)
        for gw in gws:
            assert {stream(gw) for _ in range(20)} == {"stable-1"}


def test_replicas_advance_in_step_and_follow_an_operator_on_the_other() -> None:
    with two_gateways(5, [20, 50, 100], min_hold_s=0.5, min_samples=20) as (a, b):
        for n in range(2000):
            stream((a, b)[n % 2])
            if n % 10 == 9 and rollout(a)["step"] >= 1:
                break
        # Both serve step 1 (50 %), started at the same instant: one decision, followed.
        assert wait_for(lambda: rollout(b)["step"] == rollout(a)["step"] == 1, timeout_s=6)
        assert rollout(a)["step_started_at"] == rollout(b)["step_started_at"]
        assert rollout(a)["weights"] == rollout(b)["weights"] == {"canary": 50, "stable": 50}
        assert len(events(a, "advanced")) == len(events(b, "advanced")) == 1
        aborted = httpx.post(a.admin_url + "/admin/rollouts/llama-8b/abort?why=bad%20smell").json()
        assert aborted["state"] == "rolled_back"
        began = time.monotonic()
        assert wait_for(lambda: rollout(b)["state"] == "rolled_back", timeout_s=6)
        # within a few 1 s ticks (a tick that waits on a slow Redis costs a whole one)
        assert time.monotonic() - began < 4.5
        assert events(b, "rolled_back")[0]["reason"] == "bad smell"
        assert a.log().count(DECIDED) == 1 and b.log().count(DECIDED) == 0
        assert {stream(b) for _ in range(20)} == {"stable-1"}


def test_without_redis_a_replica_keeps_its_step_and_an_abort_is_shared_when_it_returns() -> None:
    with two_gateways(5, [20, 50, 100], min_hold_s=3600, min_samples=10**6) as (a, b):
        assert wait_for(lambda: "Redis unreachable" not in a.log() and rollout(b)["state"] == "progressing")
        redis = a.redis  # type: ignore[attr-defined]
        redis.pause()
        try:
            assert wait_for(lambda: "Redis unreachable" in a.log() and "Redis unreachable" in b.log())
            aborted = httpx.post(a.admin_url + "/admin/rollouts/llama-8b/abort?why=alone").json()
            assert aborted["state"] == "rolled_back"  # applied where it was asked, at once
            assert {stream(a) for _ in range(10)} == {"stable-1"}
            assert rollout(b)["state"] == "progressing" and rollout(b)["weights"]["canary"] == 20
        finally:
            redis.resume()
        assert wait_for(lambda: rollout(b)["state"] == "rolled_back", timeout_s=5)
        assert events(b, "rolled_back")[0]["reason"] == "alone"
        assert a.log().count(DECIDED) == 1 and b.log().count(DECIDED) == 0
