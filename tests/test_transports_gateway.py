"""The negotiating client against the real gateway: every transport, the same answer, the right label.

A gateway process listens for HTTP/1.1 and h2c, for HTTP/1.1 and HTTP/2 over TLS, and for HTTP/3, and
serves gRPC-Web; ``transports.client`` picks among them as a user's program would. The gateway's own
``sluicegate_requests_total{transport}`` says which way each request came in.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from loadtest.procs import GatewayProcess, free_tcp_and_udp_port
from tests.conftest import Fleet, counter_totals, tls_config
from tests.test_transport_client import Blackhole, udp_endpoint
from transports.client import DEFAULT_RACE_DELAY, SluicegateClient
from transports.tls import self_signed

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return self_signed(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def gateway(fleet: Fleet, certificate: tuple[Path, Path]) -> Iterator[tuple[GatewayProcess, str]]:
    port = free_tcp_and_udp_port()
    with GatewayProcess(tls_config(fleet, *certificate, port)) as gw:
        yield gw, f"https://localhost:{port}"


def requests_by_transport(admin_url: str) -> Counter[str]:
    return Counter(counter_totals(admin_url, "sluicegate_requests", "transport", route="chat"))


async def answer(client: SluicegateClient, **params: Any) -> Any:
    async with client.stream_chat("llama-8b", MESSAGES, max_tokens=12, **params) as stream:
        tokens = [token async for token in stream]
    assert "".join(tokens) == stream.text != ""
    return stream


async def test_every_transport_carries_the_same_answer_and_is_counted_as_itself(
    gateway: tuple[GatewayProcess, str], certificate: tuple[Path, Path]
) -> None:
    gw, https = gateway
    before = requests_by_transport(gw.admin_url)
    cert = str(certificate[0])
    seen = {}
    async with SluicegateClient(https, verify=cert) as client:
        first = await answer(client)  # nothing known of the origin yet: TLS, and ALPN picks h2
        second = await answer(client)  # the first answer's Alt-Svc sent this one over QUIC
        seen[first.transport], seen[second.transport] = first.text, second.text
    for base, transport, options in (
        (gw.url, "h1", {}),
        (gw.url, "h2", {"h2c": True}),
        (gw.url, "grpc-web", {"transport": "grpc-web"}),
    ):
        async with SluicegateClient(base, **options) as client:
            stream = await answer(client)
            assert stream.transport == transport
            seen[transport] = stream.text
    assert list(seen) == ["h2", "h3", "h1", "grpc-web"]
    assert len(set(seen.values())) == 1  # the pod simulator answers the same prompt the same way
    counted = requests_by_transport(gw.admin_url) - before
    assert counted == {"h2": 2, "h3": 1, "h1": 1, "grpc-web": 1}


@pytest.fixture
async def blackholed_gateway(
    fleet: Fleet, certificate: tuple[Path, Path]
) -> AsyncIterator[tuple[str, int, Blackhole]]:
    """A gateway that advertises HTTP/3 on a UDP port where every datagram is silently dropped."""
    hole = Blackhole()
    async with udp_endpoint(hole) as hole_port:
        port = free_tcp_and_udp_port()
        with GatewayProcess(tls_config(fleet, *certificate, port, alt_svc_port=hole_port)):
            yield f"https://localhost:{port}", hole_port, hole


async def test_quic_dropped_on_the_path_falls_back_to_h2_within_the_race_delay(
    blackholed_gateway: tuple[str, int, Blackhole], certificate: tuple[Path, Path]
) -> None:
    https, hole_port, hole = blackholed_gateway
    async with SluicegateClient(https, verify=str(certificate[0]), quic_handshake_timeout=1.0) as client:
        first = await answer(client)
        assert first.transport == "h2"
        second = await answer(client)
        nego = second.negotiation
        assert second.transport == "h2" and nego.raced and hole.datagrams > 0  # QUIC tried, lost
        assert nego.tcp_started_after is not None and nego.tcp_started_after < DEFAULT_RACE_DELAY + 0.3
        await client.wait_background()  # the abandoned QUIC handshake times out...
        assert client.broken.is_broken((https, "localhost", hole_port))  # ...and h3 is marked broken
        tried = hole.datagrams
        third = await answer(client)
        assert third.transport == "h2" and not third.negotiation.raced and hole.datagrams == tried
