"""Tokens are counted on every ending of a stream, with no quota configured (no usage tap).

For each ending (done, client gone, stall timeout, pod death, resume, drain), the JSON access
log's ``completion_tokens`` and the token counters on ``/metrics`` (``sluicegate_tokens_total``,
``sluicegate_tokens_by_variant_total``) match the content events the client received: exactly for
a stream that ends, and for a client that leaves, what it read (plus at most the one event already
on its way when it hung up). Real gateway, real podsim pods, real sockets.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from tests.conftest import counter_totals, wait_for

ITL_S = 0.03
PACED = ["--model", "llama-8b", "--ttft-ms", "5", "--itl-ms", str(ITL_S * 1000)]
CHAT: dict[str, Any] = {
    "model": "llama-8b",
    "messages": [{"role": "user", "content": "Tell me about sluice gates."}],
    "max_tokens": 20,
    "stream": True,
}
_SERVER = {"host": "127.0.0.1", "access_log": True, "access_log_format": "json"}


def _config(*pods: PodsimProcess, **extra: Any) -> dict[str, Any]:
    return {
        "server": _SERVER,
        "timeouts": {"stall_s": 0.5},
        "pods": [{"name": f"pod-{i}", "url": p.url, "models": ["llama-8b"]} for i, p in enumerate(pods)],
        **extra,
    }


def content_events(body: bytes) -> int:
    """Events with a token in them, as the client parses them."""
    count = 0
    for raw in body.split(b"\n\n"):
        if raw.startswith(b"data: {") and b'"error"' not in raw[:20]:
            for choice in json.loads(raw[6:]).get("choices", []):
                if (choice.get("delta") or {}).get("content") or choice.get("text"):
                    count += 1
    return count


def record(gw: GatewayProcess, rid: str) -> dict[str, Any]:
    """The request's JSON access-log line, once written."""
    mark = f'"request_id":"{rid}"'
    assert wait_for(lambda: mark in gw.log(), 10)
    line = next(line for line in gw.log().splitlines() if mark in line)
    return json.loads(line[line.index("{") :])


def tokens(gw: GatewayProcess, kind: str) -> tuple[float, float]:
    """(sluicegate_tokens_total, sluicegate_tokens_by_variant_total) of ``kind`` for llama-8b."""
    total = counter_totals(gw.admin_url, "sluicegate_tokens", "kind", model="llama-8b").get(kind, 0.0)
    by_variant = counter_totals(gw.admin_url, "sluicegate_tokens_by_variant", "kind").get(kind, 0.0)
    return total, by_variant


@pytest.fixture(scope="module")
def pods() -> Iterator[tuple[PodsimProcess, PodsimProcess]]:
    with PodsimProcess(PACED) as good, PodsimProcess(PACED) as bad:
        yield good, bad


@pytest.fixture(scope="module")
def gw(pods: tuple[PodsimProcess, PodsimProcess]) -> Iterator[GatewayProcess]:
    with GatewayProcess(_config(pods[0])) as gateway:
        yield gateway


def _check(gw: GatewayProcess, rid: str, received: int, before: tuple[float, float], slack: int = 0) -> None:
    line = record(gw, rid)
    assert received <= line["completion_tokens"] <= received + slack, line
    assert line["prompt_tokens"] and line["prompt_tokens"] > 0, line
    after = tokens(gw, "completion")
    assert after[0] - before[0] == line["completion_tokens"]
    assert after[1] - before[1] == line["completion_tokens"]


@pytest.mark.parametrize("usage", [False, True], ids=["no_usage_asked", "usage_asked"])
def test_done(gw: GatewayProcess, usage: bool) -> None:
    before = tokens(gw, "completion")
    body = {**CHAT, "stream_options": {"include_usage": True}} if usage else CHAT
    resp = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=30)
    assert resp.content.endswith(b"data: [DONE]\n\n")
    received = content_events(resp.content)
    assert received == 20
    _check(gw, resp.headers["x-request-id"], received, before)
    assert record(gw, resp.headers["x-request-id"])["outcome"] == "ok"


def test_client_leaves_after_some_events(gw: GatewayProcess) -> None:
    before = tokens(gw, "completion")
    body = {**CHAT, "max_tokens": 200}
    got = b""
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=30) as resp:
        rid = resp.headers["x-request-id"]
        for chunk in resp.iter_raw():
            got += chunk
            if content_events(got[: got.rfind(b"\n\n") + 2]) >= 6:
                break
        last_read = time.monotonic()
    hung_up = time.monotonic()
    received = content_events(got[: got.rfind(b"\n\n") + 2])
    line = record(gw, rid)
    assert line["outcome"] == "client_gone" and line["status"] == 499
    # one more may have been on its way, and one each token interval (30 ms) this client took to
    # hang up after its last read (a starved test machine can take a few)
    _check(gw, rid, received, before, slack=1 + int((hung_up - last_read) / ITL_S))


@pytest.mark.parametrize("fault", ["stall_after=5", "drop_after=5"], ids=["stall_timeout", "pod_dies"])
def test_stream_cut_mid_answer(gw: GatewayProcess, fault: str) -> None:
    before = tokens(gw, "completion")
    resp = httpx.post(
        gw.url + "/v1/chat/completions", json=CHAT, headers={"x-podsim-fault": fault}, timeout=30
    )
    assert b'"error"' in resp.content  # the stream ends with the gateway's error event
    received = content_events(resp.content)
    assert received == 5
    _check(gw, resp.headers["x-request-id"], received, before)


def test_resumed_stream(pods: tuple[PodsimProcess, PodsimProcess]) -> None:
    good, bad = pods
    httpx.post(bad.url + "/admin/faults", json={"drop_after": 5}).raise_for_status()
    try:
        config = _config(bad, good, resume={"models": ["*"]})
        with GatewayProcess(config) as gateway:
            for _ in range(4):  # ties rotate between the pods: some start on the bad one
                before = tokens(gateway, "completion")
                resp = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT, timeout=30)
                assert resp.content.endswith(b"data: [DONE]\n\n") and b'"error"' not in resp.content
                received = content_events(resp.content)
                assert received == 20
                _check(gateway, resp.headers["x-request-id"], received, before)
            outcomes = {record(gateway, rid)["outcome"] for rid in _rids(gateway)}
            assert "resumed" in outcomes
    finally:
        httpx.delete(bad.url + "/admin/faults")


def _rids(gw: GatewayProcess) -> list[str]:
    return [json.loads(line[line.index("{") :])["request_id"] for line in gw.log().splitlines()
            if '"request_id"' in line]  # fmt: skip


def test_stream_cut_by_drain(pods: tuple[PodsimProcess, PodsimProcess]) -> None:
    server = {**_SERVER, "drain_timeout_s": 0.3}
    with GatewayProcess(_config(pods[0], server=server)) as gateway:
        body = {**CHAT, "max_tokens": 2000}  # a minute at 30 ms a token: outlasts the drain deadline
        got = b""
        with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body, timeout=30) as resp:
            rid = resp.headers["x-request-id"]
            chunks = resp.iter_raw()
            while content_events(got[: got.rfind(b"\n\n") + 2]) < 3:
                got += next(chunks)
            gateway.proc.send_signal(signal.SIGTERM)
            for chunk in chunks:
                got += chunk
        assert b'"shutting_down"' in got
        received = content_events(got)
        gateway.proc.wait(30)
        line = record(gateway, rid)
        assert line["outcome"] == "shutting_down"
        assert line["completion_tokens"] == received and line["prompt_tokens"] > 0
