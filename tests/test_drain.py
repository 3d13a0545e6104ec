"""SIGTERM: readiness drops at once, new work is refused with 503, streams finish, the process exits 0."""

from __future__ import annotations

import json
import signal

import httpx

from loadtest.procs import GatewayProcess
from tests.conftest import Fleet, wait_for

CHAT = {
    "model": "llama-8b",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "ignore_eos": True,
}


def _config(fleet: Fleet, drain_timeout_s: float) -> dict:
    return {
        "server": {"host": "127.0.0.1", "drain_timeout_s": drain_timeout_s},
        "pods": [{"name": "pod-a", "url": fleet.pod_a.url, "models": ["llama-8b"]}],
    }


def test_sigterm_lets_streams_finish_and_refuses_new_work(fleet: Fleet) -> None:
    with GatewayProcess(_config(fleet, drain_timeout_s=30)) as gw:
        body = {**CHAT, "max_tokens": 2400}  # ~5 s at the fleet's pace: it outlasts the checks below
        with (
            httpx.Client(timeout=30) as client,
            client.stream("POST", gw.url + "/v1/chat/completions", json=body) as resp,
        ):
            chunks = resp.iter_bytes()
            received = next(chunks)
            gw.proc.send_signal(signal.SIGTERM)
            assert wait_for(lambda: httpx.get(gw.url + "/readyz").status_code == 503)
            refused = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "draining"
            received += b"".join(chunks)
        assert received.endswith(b"data: [DONE]\n\n") and b'"error"' not in received
        assert received.count(b'"content":"') == 2401  # the role chunk and every token
        assert gw.proc.wait(30) == 0


def test_streams_still_running_at_the_drain_deadline_end_with_an_error_event(fleet: Fleet) -> None:
    with GatewayProcess(_config(fleet, drain_timeout_s=0.3)) as gw:
        body = {**CHAT, "max_tokens": 4000}  # ~8 s: outlasts the drain deadline
        with (
            httpx.Client(timeout=30) as client,
            client.stream("POST", gw.url + "/v1/chat/completions", json=body) as resp,
        ):
            chunks = resp.iter_bytes()
            received = next(chunks)
            gw.proc.send_signal(signal.SIGTERM)
            received += b"".join(chunks)
        events = [e for e in received.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]"
        assert json.loads(events[-2].removeprefix(b"data: "))["error"]["code"] == "shutting_down"
        assert gw.proc.wait(30) == 0
