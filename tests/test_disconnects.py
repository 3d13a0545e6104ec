"""Clients that leave: the pod's generation is aborted at once, and nothing leaks in the gateway."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.procs import GatewayProcess
from tests.conftest import Fleet, counter_totals, gateway_in_flight, pod_aborts, wait_for

LONG = {
    "model": "llama-8b",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 4000,
    "ignore_eos": True,
    "stream": True,
}


@pytest.fixture(scope="module")
def gateway(fleet: Fleet) -> Iterator[GatewayProcess]:
    config = {
        "server": {"host": "127.0.0.1", "access_log": False},
        "pods": [
            {"name": "pod-a", "url": fleet.pod_a.url, "models": ["llama-8b"]},
            {"name": "pod-b", "url": fleet.pod_b.url, "models": ["llama-8b"]},
        ],
    }
    with GatewayProcess(config) as gw:
        yield gw


def _runtime(admin_url: str) -> dict[str, float]:
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(admin_url + "/metrics").text)}
    return {
        "tasks": families["sluicegate_asyncio_tasks"].samples[0].value,
        "upstream": families["sluicegate_upstream_connections"].samples[0].value,
        "fds": families["process_open_fds"].samples[0].value,
        "in_flight": sum(s.value for s in families["sluicegate_in_flight_requests"].samples),
    }


def _back_to(admin_url: str, baseline: dict[str, float]) -> bool:
    """Whether the gateway's tasks, descriptors and pod connections are back at or under ``baseline``."""
    now = _runtime(admin_url)
    return all(now[what] <= baseline[what] for what in ("tasks", "fds", "upstream"))


def _open_stream(url: str, headers: str = "") -> socket.socket:
    parts = urlsplit(url)
    body = json.dumps(LONG).encode()
    sock = socket.create_connection((parts.hostname, parts.port))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + headers.encode()
        + b"content-length: %d\r\n\r\n" % len(body)
        + body
    )
    return sock


def test_forty_clients_leaving_abort_forty_generations_and_leak_nothing(
    gateway: GatewayProcess, fleet: Fleet
) -> None:
    url, admin = gateway.url, gateway.admin_url
    httpx.post(url + "/v1/chat/completions", json={**LONG, "max_tokens": 2})  # warm the pools
    baseline = _runtime(admin)
    aborts = pod_aborts(fleet)
    streaming = [_open_stream(url) for _ in range(20)]
    for sock in streaming:
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")  # tokens are flowing
    waiting = [_open_stream(url, "x-podsim-fault: first_token_delay_ms=30000\r\n") for _ in range(20)]
    assert wait_for(lambda: _runtime(admin)["in_flight"] == 40)
    for sock in streaming + waiting:
        sock.close()
    assert wait_for(lambda: pod_aborts(fleet) >= aborts + 40)
    assert wait_for(lambda: _runtime(admin)["in_flight"] == 0)

    # Probe and scrape rounds run tasks and sockets of their own for a moment, in either snapshot:
    # what the 40 streams held must be gone, which a leak never is however long it is given.
    assert wait_for(lambda: _back_to(admin, baseline)), (baseline, _runtime(admin))


def test_a_stream_the_client_leaves_is_still_counted(fleet: Fleet) -> None:
    def chunks() -> float:
        return sum(counter_totals(fleet.admin_url, "sluicegate_stream_chunks", "model").values())

    before = chunks()
    body = {"model": "llama-8b", "messages": [{"role": "user", "content": "go on"}], "stream": True,
            "max_tokens": 200}  # fmt: skip
    with httpx.stream("POST", fleet.url + "/v1/chat/completions", json=body, timeout=30) as resp:
        events = 0
        for line in resp.iter_lines():
            events += line.startswith("data: ")
            if events == 8:
                break  # the client leaves mid-stream
    assert wait_for(lambda: gateway_in_flight(fleet.admin_url) == 0)
    # what it was sent (pod reads, each one or more of the 8 events), not 0 as before
    assert wait_for(lambda: chunks() - before >= 2)


def test_a_client_leaving_during_its_second_request_on_a_connection_aborts_that_generation(
    gateway: GatewayProcess, fleet: Fleet
) -> None:
    """The hang-up watch is kept per client connection: a request after the first on a keep-alive
    connection is still aborted at the pod when the client leaves, and the connection's end
    releases what the watch held."""
    url, admin = gateway.url, gateway.admin_url
    httpx.post(url + "/v1/chat/completions", json={**LONG, "max_tokens": 2})  # warm the pools
    baseline = _runtime(admin)
    aborts = pod_aborts(fleet)
    parts = urlsplit(url)
    short = json.dumps({**LONG, "max_tokens": 2}).encode()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    with socket.create_connection((parts.hostname, parts.port)) as conn:
        conn.sendall(head + b"content-length: %d\r\n\r\n" % len(short) + short)
        answer = b""
        while not answer.endswith(b"0\r\n\r\n"):  # the whole first answer, chunked to its end
            data = conn.recv(65536)
            assert data, answer
            answer += data
        assert answer.startswith(b"HTTP/1.1 200") and b"[DONE]" in answer
        long = json.dumps(LONG).encode()
        conn.sendall(head + b"content-length: %d\r\n\r\n" % len(long) + long)
        assert conn.recv(65536).startswith(b"HTTP/1.1 200")  # the second request streams
        assert wait_for(lambda: _runtime(admin)["in_flight"] == 1)
    assert wait_for(lambda: pod_aborts(fleet) >= aborts + 1)
    assert wait_for(lambda: _runtime(admin)["in_flight"] == 0)
    assert wait_for(lambda: _back_to(admin, baseline)), (baseline, _runtime(admin))
