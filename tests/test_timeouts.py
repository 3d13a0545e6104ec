"""Staged timeouts over real sockets: each stage fires, names itself, and aborts the pod's work."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest

from loadtest.procs import GatewayProcess
from tests.conftest import Fleet, counter_totals, gateway_in_flight, pod_aborts, wait_for

CHAT = {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
LONG = {**CHAT, "max_tokens": 4000, "ignore_eos": True}  # ~8 s at the fleet's 2 ms per token


@pytest.fixture(scope="module")
def strict_gateway(fleet: Fleet) -> Iterator[GatewayProcess]:
    """A gateway with short timeouts in front of the same pods."""
    config = {
        "server": {"host": "127.0.0.1"},
        "timeouts": {
            "connect_s": 1,
            "first_token_s": 2.0,
            "stall_s": 0.4,
            "total_s": 30,
            "models": {"qwen-0.5b": {"first_token_s": 0.3}},
        },
        "tiers": {  # no stage may outlast the total (a config error), so the tier shortens them too
            "fast": {
                "timeouts": {"connect_s": 0.5, "first_token_s": 0.5, "stall_s": 0.4, "total_s": 0.6},
            }
        },
        "pods": [
            {"name": "pod-a", "url": fleet.pod_a.url, "models": ["llama-8b"]},
            {"name": "pod-b", "url": fleet.pod_b.url, "models": ["llama-8b", "qwen-0.5b"]},
        ],
    }
    with GatewayProcess(config) as gw:
        yield gw


@pytest.fixture(scope="module")
def strict(strict_gateway: GatewayProcess) -> str:
    return strict_gateway.url


@pytest.fixture(scope="module")
def strict_admin(strict_gateway: GatewayProcess) -> str:
    """The strict gateway's admin listener, where its metrics are."""
    return strict_gateway.admin_url


def _post(url: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


def _timeout_error(resp: httpx.Response, stage: str) -> None:
    assert resp.status_code == 504, resp.text
    error = resp.json()["error"]
    assert error["type"] == "timeout" and error["code"] == stage, error


def _ends_with_timeout_event(resp: httpx.Response, stage: str) -> list[bytes]:
    assert resp.status_code == 200
    events = [e for e in resp.content.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2].removeprefix(b"data: "))["error"]
    assert error["type"] == "timeout" and error["code"] == stage, error
    return events


def _timeouts(admin_url: str) -> dict[str, float]:
    return counter_totals(admin_url, "sluicegate_timeouts", "stage")


@pytest.mark.parametrize("stream", [True, False])
def test_first_token_timeout_is_a_504_naming_the_stage(strict: str, fleet: Fleet, stream: bool) -> None:
    aborts = pod_aborts(fleet)
    resp = _post(strict, {**CHAT, "stream": stream}, **{"x-podsim-fault": "first_token_delay_ms=5000"})
    _timeout_error(resp, "first_token")
    assert wait_for(lambda: pod_aborts(fleet) >= aborts + 1)


def test_stall_after_tokens_ends_the_stream_with_a_timeout_event(
    strict: str, strict_admin: str, fleet: Fleet
) -> None:
    before = _timeouts(strict_admin).get("stall", 0)
    aborts = pod_aborts(fleet)
    resp = _post(strict, {**LONG, "stream": True}, **{"x-podsim-fault": "stall_after=3"})
    events = _ends_with_timeout_event(resp, "stall")
    assert sum(b'"content":"' in e and b'"content":""' not in e for e in events) == 3
    assert _timeouts(strict_admin)["stall"] == before + 1
    assert wait_for(lambda: pod_aborts(fleet) >= aborts + 1)  # the stalled generation was aborted
    assert wait_for(lambda: gateway_in_flight(strict_admin) == 0)


def test_client_may_shorten_the_total_deadline(strict: str) -> None:
    resp = _post(strict, {**LONG, "stream": True}, **{"x-request-timeout-ms": "400"})
    events = _ends_with_timeout_event(resp, "total")
    assert 10 < len(events) < 4000  # tokens flowed, then the deadline cut the stream


def test_a_long_client_deadline_does_not_extend_the_first_token_budget(strict: str) -> None:
    slow = {"x-podsim-fault": "first_token_delay_ms=5000", "x-request-timeout-ms": "600000"}
    _timeout_error(_post(strict, {**CHAT, "stream": True}, **slow), "first_token")


def test_non_streaming_requests_honour_the_total_deadline(strict: str) -> None:
    resp = _post(strict, {**LONG, "max_tokens": 400}, **{"x-request-timeout-ms": "300"})
    _timeout_error(resp, "total")


def test_tier_budgets_apply_by_the_tier_header_with_auth_off(strict: str) -> None:
    # (with auth on, the key's tier applies instead: tests/test_request_limits.py, tests/test_degrade.py)
    tier = {"x-sluicegate-tier": "fast"}
    _ends_with_timeout_event(_post(strict, {**LONG, "stream": True}, **tier), "total")


def test_per_model_override(strict: str) -> None:
    delay = {"x-podsim-fault": "first_token_delay_ms=600"}
    _timeout_error(_post(strict, {**CHAT, "model": "qwen-0.5b", "stream": True}, **delay), "first_token")
    assert _post(strict, {**CHAT, "stream": True}, **delay).status_code == 200  # llama-8b allows 2 s


def test_bad_client_deadline_is_a_400(strict: str) -> None:
    resp = _post(strict, CHAT, **{"x-request-timeout-ms": "soon"})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_timeout"


class BlackHolePod:
    """A pod that answers the gateway's first probe, then stops accepting connections with its
    backlog full: from then on a connect attempt's SYN goes unanswered, as behind a dead node."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=1)
        self.port = self.listener.getsockname()[1]
        self.probed = threading.Event()
        self.fillers: list[socket.socket] = []
        threading.Thread(target=self._answer_one_probe, daemon=True).start()

    def _answer_one_probe(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            conn.recv(65536)
            body = json.dumps({"object": "list", "data": [{"id": "llama-8b", "object": "model"}]}).encode()
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
                b"content-length: %d\r\n\r\n%b" % (len(body), body)
            )
        self.probed.set()

    def stop_accepting(self) -> None:
        for _ in range(4):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", self.port))
            self.fillers.append(filler)

    def close(self) -> None:
        for sock in (*self.fillers, self.listener):
            sock.close()


def test_connect_timeout_is_a_504_naming_the_stage() -> None:
    hole = BlackHolePod()
    config = {
        "server": {"host": "127.0.0.1"},
        "timeouts": {"connect_s": 0.3},
        "pods": [{"name": "hole", "url": f"http://127.0.0.1:{hole.port}"}],
    }
    try:
        with GatewayProcess(config) as gw:
            assert hole.probed.wait(10)  # discovery saw it serving llama-8b
            hole.stop_accepting()
            before = _timeouts(gw.admin_url).get("connect", 0)
            _timeout_error(_post(gw.url, {**CHAT, "stream": True}), "connect")
            assert _timeouts(gw.admin_url).get("connect", 0) == before + 1
            assert gateway_in_flight(gw.admin_url) == 0
    finally:
        hole.close()


def test_a_connect_timeout_is_retried_on_another_pod(fleet: Fleet) -> None:
    hole = BlackHolePod()
    config = {
        "server": {"host": "127.0.0.1"},
        "timeouts": {"connect_s": 0.3},
        # Metrics count as stale at once and probes wait an hour: otherwise the hole's silence
        # would mark it saturated or unhealthy, and picks (by in-flight count) would never reach it.
        "health": {"scrape": {"stale_after_s": 0.001}, "probe": {"interval_s": 3600}},
        "pods": [
            {"name": "hole", "url": f"http://127.0.0.1:{hole.port}"},
            {"name": "pod-a", "url": fleet.pod_a.url},
        ],
    }
    try:
        with GatewayProcess(config) as gw:
            assert hole.probed.wait(10)
            hole.stop_accepting()
            # Picks rotate between the two pods; by the second request the hole has been tried.
            for _ in range(2):
                resp = _post(gw.url, {**CHAT, "stream": True})
                assert resp.status_code == 200 and resp.content.endswith(b"data: [DONE]\n\n")
            outcomes = counter_totals(gw.admin_url, "sluicegate_upstream_attempts", "outcome")
            assert outcomes.get("connect_timeout") == 1 and outcomes.get("ok") == 2
    finally:
        hole.close()
