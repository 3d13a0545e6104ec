"""A gateway whose pods come from Kubernetes (a fake API server) routes only to ready, healthy ones.

Two simulated pods listen on the same port at two loopback addresses (127.0.0.2 and 127.0.0.3),
as two pods of one Service would on their pod IPs; the fake API server lists them in the Service's
EndpointSlice and serves their Pod objects. The gateway process watches it like a real cluster.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from loadtest.fakekube import FakeKube, make_pod
from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from tests.conftest import FAST, MIG_A, MIG_B

NS = "llm"
MIG_RES = "nvidia.com/mig-1g.10gb"
CHAT = {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
IPS = ("127.0.0.2", "127.0.0.3")


def shared_free_port() -> int:
    """A port free on both loopback addresses."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((IPS[0], 0))
            port = probe.getsockname()[1]
        with socket.socket() as other:
            try:
                other.bind((IPS[1], port))
            except OSError:
                continue
        return port
    raise RuntimeError("no port free on both addresses")


class Cluster:
    def __init__(self, kube: FakeKube, gateway: GatewayProcess) -> None:
        self.kube, self.url, self.admin_url = kube, gateway.url, gateway.admin_url

    async def pods(self) -> dict[str, dict[str, Any]]:
        async with httpx.AsyncClient() as client:
            listing = (await client.get(self.admin_url + "/admin/pods")).json()["pods"]
        return {p["name"]: p for p in listing}

    async def until(self, check: Any, timeout_s: float = 10.0) -> bool:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline:
            if check(await self.pods()):
                return True
            await asyncio.sleep(0.05)
        return False

    async def served(self, n: int) -> set[str]:
        seen = set()
        async with httpx.AsyncClient(timeout=30) as client:
            for _ in range(n):
                resp = await client.post(self.url + "/v1/chat/completions", json=CHAT)
                assert resp.status_code == 200, resp.text
                seen.add(resp.headers["x-sluicegate-pod"])
        return seen


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    port = shared_free_port()
    sims = [
        PodsimProcess(["--model", "llama-8b", "--host", ip, "--port", str(port), *FAST]) for ip in IPS
    ]
    for sim in sims:
        await sim.astart()
    try:
        async with FakeKube(NS) as kube:
            for name, ip, mig in (("vllm-a", IPS[0], MIG_A), ("vllm-b", IPS[1], MIG_B)):
                pod = make_pod(
                    name,
                    ip,
                    namespace=NS,
                    labels={"app": "vllm", "model": "llama-8b", "variant": "stable"},
                    limits={MIG_RES: "1"},
                    device_health=[(MIG_RES, mig, "Healthy")],
                )
                kube.add_pod("vllm", pod, port=("http", port))
            config = {
                "server": {"host": "127.0.0.1"},
                "discovery": {"kubernetes": {"namespace": NS, "service": "vllm", "api_url": kube.url}},
            }
            gateway = GatewayProcess(config)
            await asyncio.to_thread(gateway.start)
            try:
                c = Cluster(kube, gateway)
                names = {f"{NS}/vllm-a", f"{NS}/vllm-b"}
                assert await c.until(
                    lambda pods: set(pods) == names and all(p["state"]["routable"] for p in pods.values())
                )
                yield c
            finally:
                await asyncio.to_thread(gateway.__exit__, None, None, None)
    finally:
        for sim in sims:
            sim.stop()


async def test_pods_of_the_service_get_traffic_and_carry_their_mig_identity(cluster: Cluster) -> None:
    assert await cluster.served(6) == {f"{NS}/vllm-a", f"{NS}/vllm-b"}
    pod = (await cluster.pods())[f"{NS}/vllm-a"]
    assert pod["labels"]["variant"] == "stable" and pod["models"] == ["llama-8b"]


async def test_an_unhealthy_mig_device_in_the_pod_status_takes_the_pod_out(cluster: Cluster) -> None:
    cluster.kube.set_device_health("vllm-a", MIG_RES, MIG_A, "Unhealthy")
    assert await cluster.until(lambda pods: pods[f"{NS}/vllm-a"]["state"]["health"] == "unhealthy")
    assert "Unhealthy" in (await cluster.pods())[f"{NS}/vllm-a"]["state"]["device_fault"]
    assert await cluster.served(4) == {f"{NS}/vllm-b"}


async def test_a_pod_that_is_not_ready_drains_and_a_deleted_one_is_forgotten(cluster: Cluster) -> None:
    cluster.kube.set_endpoint("vllm", "vllm-b", ready=False, terminating=True)
    assert await cluster.until(lambda pods: pods[f"{NS}/vllm-b"]["state"]["health"] == "draining")
    assert await cluster.served(4) == {f"{NS}/vllm-a"}
    cluster.kube.remove_pod("vllm", "vllm-b")
    assert await cluster.until(lambda pods: set(pods) == {f"{NS}/vllm-a"})
