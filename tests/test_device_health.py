"""Routing only to pods on healthy MIG slices: a fake dcgm-exporter's XIDs through a real gateway.

Two simulated pods on two MIG slices (GPU instances 9 and 3) of one GPU; the gateway scrapes the
fake exporter every 0.1 s. What a user of the gateway sees: a slice with a critical XID gets no
traffic, an application XID changes nothing, a device-wide fault takes every slice of that GPU
out (503: no healthy pod), and the fault stays until an operator clears it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from loadtest.dcgmsim import DcgmsimProcess
from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from tests.conftest import FAST, GPU, MIG_A, MIG_B, pod_state, wait_for

CHAT = {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


class Slices:
    def __init__(self, gateway: GatewayProcess, dcgm: DcgmsimProcess) -> None:
        self.url = gateway.url
        self.admin_url = gateway.admin_url
        self.dcgm = dcgm

    def state(self, name: str) -> dict[str, Any]:
        return pod_state(self.admin_url, name)

    def xid(self, xid: int, gpu_instance_id: int | None) -> None:
        fault = {"gpu_uuid": GPU, "gpu_instance_id": gpu_instance_id, "xid": xid}
        assert httpx.post(self.dcgm.url + "/faults", json=fault).status_code == 200

    def served(self, n: int) -> set[str]:
        pods = set()
        for _ in range(n):
            resp = httpx.post(self.url + "/v1/chat/completions", json=CHAT)
            assert resp.status_code == 200, resp.text
            pods.add(resp.headers["x-sluicegate-pod"])
        return pods


@pytest.fixture(scope="module")
def slices() -> Iterator[Slices]:
    a = PodsimProcess(["--model", "llama-8b", "--gpu-uuid", GPU, "--mig-uuid", MIG_A, *FAST])
    b = PodsimProcess(["--model", "llama-8b", "--gpu-uuid", GPU, "--mig-uuid", MIG_B, *FAST])
    dcgm = DcgmsimProcess(["--gpu", f"{GPU}:1g.10gb@9,2g.20gb@3"])
    with a, b, dcgm:
        mig = {"pod-a": (MIG_A, 9), "pod-b": (MIG_B, 3)}
        config = {
            "server": {"host": "127.0.0.1"},
            "health": {"devices": {"dcgm_urls": [dcgm.url + "/metrics"], "interval_s": 0.1}},
            "pods": [
                {
                    "name": name,
                    "url": pod.url,
                    "models": ["llama-8b"],
                    "mig": {"gpu_uuid": GPU, "mig_uuid": mig[name][0], "gpu_instance_id": mig[name][1]},
                }
                for name, pod in (("pod-a", a), ("pod-b", b))
            ],
        }
        with GatewayProcess(config) as gw:
            s = Slices(gw, dcgm)
            assert wait_for(lambda: all(s.state(n)["load"]["fresh"] for n in ("pod-a", "pod-b")))
            yield s


@pytest.fixture(autouse=True)
def clean(slices: Slices) -> Iterator[None]:
    yield
    httpx.delete(slices.dcgm.url + "/faults")
    for name in ("pod-a", "pod-b"):
        httpx.post(slices.admin_url + f"/admin/pods/{name}/clear")
    assert wait_for(lambda: all(slices.state(n)["health"] == "healthy" for n in ("pod-a", "pod-b")))


def test_an_application_xid_changes_nothing(slices: Slices) -> None:
    slices.xid(13, 9)  # graphics engine exception: the application's fault, not the slice's
    assert wait_for(lambda: "13" in httpx.get(slices.dcgm.url + "/metrics").text)
    assert slices.served(6) == {"pod-a", "pod-b"}
    assert slices.state("pod-a")["health"] == "healthy"


def test_a_critical_xid_takes_the_gpu_out_and_stays_until_cleared(slices: Slices) -> None:
    # dcgm-exporter reports XIDs per GPU (no GPU_I_ID), so an XID inside one slice concerns
    # every slice of that GPU: both pods go.
    slices.xid(79, 9)
    assert wait_for(lambda: slices.state("pod-a")["health"] == "unhealthy")
    assert wait_for(lambda: slices.state("pod-b")["health"] == "unhealthy")
    assert "79" in slices.state("pod-a")["device_fault"]
    resp = httpx.post(slices.url + "/v1/chat/completions", json=CHAT)
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_healthy_upstream"
    assert int(resp.headers["retry-after"]) >= 1
    # the exporter forgets (driver reload): the slices stay out, the fault is sticky
    httpx.delete(slices.dcgm.url + "/faults")
    assert wait_for(lambda: " 79" not in httpx.get(slices.dcgm.url + "/metrics").text)
    assert slices.state("pod-a")["health"] == "unhealthy"
    # an operator checked pod-a's slice
    cleared = httpx.post(slices.admin_url + "/admin/pods/pod-a/clear")
    assert cleared.status_code == 200
    assert wait_for(lambda: slices.state("pod-a")["health"] == "healthy")
    assert slices.served(4) == {"pod-a"}


def test_a_double_bit_ecc_error_marks_the_gpu_too(slices: Slices) -> None:
    assert httpx.post(slices.dcgm.url + "/faults", json={"gpu_uuid": GPU, "ecc_dbe": 2}).status_code == 200
    assert wait_for(lambda: slices.state("pod-b")["health"] == "unhealthy")
    assert "ECC" in slices.state("pod-b")["device_fault"] or "ecc" in slices.state("pod-b")["device_fault"]


def test_clearing_an_unknown_pod_is_a_404(slices: Slices) -> None:
    resp = httpx.post(slices.admin_url + "/admin/pods/nope/clear")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "pod_not_found"
