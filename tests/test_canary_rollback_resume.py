"""``rollout.on_rollback: resume`` through a real gateway: an operator's abort moves every canary
stream in flight to the stable pod, where it continues token-exactly; the client reads one whole,
uninterrupted answer. (``finish``, where they end on the canary, is in test_canary_rollout_system.)

Both pods are podsim processes pacing their tokens slowly enough that the streams are mid-answer
when the abort lands; podsim's text is a function of the request, so the answer an uninterrupted
stream would have given is the stable pod's own answer to the same request.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from tests.canary import canary_config
from tests.conftest import counter_totals, wait_for
from tests.redis_server import RedisServer, needs_redis_server

PACED = ["--model", "llama-8b", "--ttft-ms", "5", "--itl-ms", "40"]
STREAMS = 12
# about 4.8 s per stream at 40 ms a token: mid-answer at the abort, and still when a follower replica
# takes it up at its next tick (up to 1 s later), on a starved machine too
MAX_TOKENS = 120


def _body(user: int) -> dict[str, Any]:
    return {
        "model": "llama-8b", "stream": True, "max_tokens": MAX_TOKENS, "user": f"user-{user}",
        "messages": [{"role": "user", "content": f"Tell me about sluice gate number {user}."}],
    }  # fmt: skip


def _text(body: bytes) -> tuple[str, list[Any]]:
    events: list[Any] = []
    for raw in body.split(b"\n\n"):
        if raw.startswith(b"data: "):
            data = raw[6:]
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    text = "".join(
        (c.get("delta") or {}).get("content") or ""
        for e in events
        if isinstance(e, dict)
        for c in e.get("choices", [])
    )
    return text, events


def _moved(admin_url: str) -> dict[str, float]:
    """sluicegate_rollback_resumed_streams_total by outcome."""
    return counter_totals(admin_url, "sluicegate_rollback_resumed_streams", "outcome", model="llama-8b")


@pytest.fixture(scope="module")
def pods() -> Iterator[tuple[PodsimProcess, PodsimProcess]]:
    with PodsimProcess(PACED) as stable, PodsimProcess(PACED) as canary:
        yield stable, canary


def _config(stable: PodsimProcess, canary: PodsimProcess, **extra: Any) -> dict[str, Any]:
    plan = {"steps": [90], "min_hold_s": 3600, "min_samples": 10**6, "on_rollback": "resume"}
    return canary_config(
        stable.url, canary.url, plan,
        server={"host": "127.0.0.1", "access_log": True, "access_log_format": "json"},
        resume={"models": ["*"]}, **extra,
    )  # fmt: skip


def test_an_abort_moves_every_canary_stream_to_stable_token_exactly(
    pods: tuple[PodsimProcess, PodsimProcess],
) -> None:
    stable, canary = pods
    with GatewayProcess(_config(stable, canary)) as gw:
        _abort_moves_every_canary_stream(pods, gw, gw)


@needs_redis_server()
def test_every_replica_moves_its_own_streams_when_it_follows_a_rollback(
    pods: tuple[PodsimProcess, PodsimProcess],
) -> None:
    stable, canary = pods
    with RedisServer() as redis:
        config = _config(stable, canary, quotas={"redis_url": redis.url})
        with GatewayProcess(config) as operator_side, GatewayProcess(config) as streams_side:
            # the abort lands on one replica; the other learns it from Redis within a tick
            _abort_moves_every_canary_stream(pods, streams_side, operator_side)
            assert "follows" in streams_side.log()


def _abort_moves_every_canary_stream(
    pods: tuple[PodsimProcess, PodsimProcess], gw: GatewayProcess, operator: GatewayProcess
) -> None:
    """Canary streams through ``gw``, the abort through ``operator`` (the same or another replica)."""
    stable, canary = pods

    def direct(user: int) -> str:
        return _text(httpx.post(stable.url + "/v1/chat/completions", json=_body(user), timeout=30).content)[0]

    with ThreadPoolExecutor(STREAMS) as pool:  # each stream's answer straight from stable, all at once
        expected = dict(enumerate(pool.map(direct, range(STREAMS))))
    results: dict[int, tuple[str, str, bytes]] = {}
    started = threading.Barrier(STREAMS + 1)

    def one(user: int) -> None:
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json=_body(user), timeout=30) as resp:
            chunks = resp.iter_bytes()
            first = next(chunks)
            started.wait(20)
            rest = b"".join(chunks)
            results[user] = (resp.headers["x-sluicegate-pod"], resp.headers["x-request-id"], first + rest)

    threads = [threading.Thread(target=one, args=(user,)) for user in range(STREAMS)]
    for thread in threads:
        thread.start()
    started.wait(20)  # every stream has its first bytes, none is near its end
    aborted = httpx.post(operator.admin_url + "/admin/rollouts/llama-8b/abort?why=test").json()
    assert aborted["state"] == "rolled_back" and aborted["on_rollback"] == "resume"
    for thread in threads:
        thread.join(30)
    assert len(results) == STREAMS

    on_canary = {user for user, (pod, _, _) in results.items() if pod == "canary-1"}
    assert len(on_canary) >= 5  # 90 % of the users' cohorts started on the canary
    for user, (_, _, body) in results.items():
        text, events = _text(body)
        assert events[-1] == "[DONE]"
        assert not any("error" in e for e in events if isinstance(e, dict))
        assert text == expected[user]  # no token lost, none repeated
        roles = [c for e in events if isinstance(e, dict) for c in e["choices"] if "role" in c["delta"]]
        assert len(roles) == 1

    # every canary stream was moved, and says so in the metrics and its access-log line
    moved = _moved(gw.admin_url)
    assert moved.get("resumed", 0.0) == len(on_canary)
    assert sum(moved.values()) == len(on_canary)
    rids = {rid: user for user, (_, rid, _) in results.items()}
    assert wait_for(lambda: sum(f'"request_id":"{rid}"' in gw.log() for rid in rids) == STREAMS)
    lines = [json.loads(line[line.index("{") :]) for line in gw.log().splitlines() if '"request_id"' in line]
    records = {r["request_id"]: r for r in lines if r["request_id"] in rids}
    for rid, user in rids.items():
        record = records[rid]
        if user in on_canary:
            assert record["outcome"] == "resumed_rollback" and record["resumes"] == 1
            assert record["pod"] == "stable-1" and record["variant"] == "stable"
        else:
            assert record["outcome"] == "ok" and record["pod"] == "stable-1"
    assert f"{len(on_canary)} in-flight canary stream(s) moved to stable" in gw.log()

    # the canary pod saw each of those connections closed mid-answer (its generation aborted)
    def canary_aborts() -> set[str]:
        return {a["id"] for a in httpx.get(canary.url + "/podsim/aborts").json()["aborts"]}

    canary_rids = {rid for rid, user in rids.items() if user in on_canary}
    assert wait_for(lambda: canary_rids <= canary_aborts())
    # and new callers go to stable only
    after = httpx.post(gw.url + "/v1/chat/completions", json={**_body(99), "stream": False}, timeout=30)
    assert after.headers["x-sluicegate-pod"] == "stable-1"


def test_streams_resume_cannot_move_finish_on_the_canary(pods: tuple[PodsimProcess, PodsimProcess]) -> None:
    stable, canary = pods
    plan = {"steps": [90], "min_hold_s": 3600, "min_samples": 10**6, "on_rollback": "resume"}
    config = canary_config(stable.url, canary.url, plan)  # resume is off: no stream can move
    with GatewayProcess(config) as gw:
        results: dict[int, tuple[str, bytes]] = {}
        started = threading.Barrier(5)

        def one(user: int) -> None:
            with httpx.stream("POST", gw.url + "/v1/chat/completions", json=_body(user), timeout=30) as resp:
                chunks = resp.iter_bytes()
                first = next(chunks)
                started.wait(20)
                results[user] = (resp.headers["x-sluicegate-pod"], first + b"".join(chunks))

        threads = [threading.Thread(target=one, args=(user,)) for user in range(4)]
        for thread in threads:
            thread.start()
        started.wait(20)
        assert httpx.post(gw.admin_url + "/admin/rollouts/llama-8b/abort").json()["state"] == "rolled_back"
        for thread in threads:
            thread.join(30)
        on_canary = [user for user, (pod, _) in results.items() if pod == "canary-1"]
        assert on_canary and all(results[u][1].endswith(b"data: [DONE]\n\n") for u in results)
        assert _moved(gw.admin_url).get("finished", 0.0) == len(on_canary)
        assert "moved to stable" in gw.log()
