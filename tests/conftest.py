"""Real processes for system tests: two simulated vLLM pods on MIG slices and a gateway before them."""

from __future__ import annotations

import shutil
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess

GPU = "GPU-5e0f8a2c-1b7d-4c1e-9a55-0c3f2d7e8b11"
MIG_A = "MIG-2ce7a541-c516-5dbc-a76e-26cc100d9b55"
MIG_B = "MIG-7a1d9f30-48c2-5e6b-8f0a-3b9c1d2e4f56"
FAST = ["--ttft-ms", "5", "--itl-ms", "2"]
MAX_BODY = 64 * 1024
REPO = Path(__file__).resolve().parent.parent


def stale_native_modules() -> list[str]:
    """Sources edited since ``make native`` compiled them: Python would import the old build."""
    stale = []
    for built in [*REPO.glob("gateway/**/*.so"), *REPO.glob("transports/*.so")]:
        source = built.with_name(built.name.split(".", 1)[0] + ".py")
        if source.exists() and source.stat().st_mtime > built.stat().st_mtime:
            stale.append(str(source.relative_to(REPO)))
    return stale


def pytest_configure(config: pytest.Config) -> None:
    stale = stale_native_modules()
    if stale:
        raise pytest.UsageError(
            f"{', '.join(stale)} changed since mypyc compiled them: run `make native` "
            "(or `make clean-native` to test the pure Python)"
        )


@dataclass
class Fleet:
    pod_a: PodsimProcess
    pod_b: PodsimProcess
    gateway: GatewayProcess
    dead_url: str

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def admin_url(self) -> str:
        """The admin listener (``/admin/*``, ``/metrics``); the public ``url`` does not serve them."""
        return self.gateway.admin_url


def unused_port() -> int:
    """A loopback port nothing listens on (bound then released, so connects are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def gateway_config(pod_a: str, pod_b: str, dead: str) -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "max_body_bytes": MAX_BODY},
        "discovery": {"refresh_interval_s": 30, "retry_interval_s": 30},
        "pods": [
            {
                "name": "pod-a",
                "url": pod_a,
                "models": ["llama-8b"],
                "mig": {"gpu_uuid": GPU, "mig_uuid": MIG_A, "profile": "1g.10gb"},
                "labels": {"variant": "stable"},
            },
            # pod-b's models are discovered from its /v1/models
            {
                "name": "pod-b",
                "url": pod_b,
                "mig": {"gpu_uuid": GPU, "mig_uuid": MIG_B, "profile": "2g.20gb"},
            },
            {"name": "pod-dead", "url": dead, "models": ["ghost"]},
        ],
    }


@pytest.fixture(scope="session")
def fleet() -> Iterator[Fleet]:
    a = PodsimProcess(
        ["--model", "llama-8b", "--gpu-uuid", GPU, "--mig-uuid", MIG_A, "--mig-profile", "1g.10gb", *FAST]
    )
    b = PodsimProcess(
        [
            "--model",
            "llama-8b",
            "--model",
            "qwen-0.5b",
            "--gpu-uuid",
            GPU,
            "--mig-uuid",
            MIG_B,
            "--mig-profile",
            "2g.20gb",
            *FAST,
        ]
    )
    with a, b:
        dead = f"http://127.0.0.1:{unused_port()}"
        with GatewayProcess(gateway_config(a.url, b.url, dead)) as gw:
            yield Fleet(a, b, gw, dead)


def pod_arrivals(pod_url: str) -> int:
    """How many generation requests a pod simulator has received (a count that only grows)."""
    return len(httpx.get(pod_url + "/podsim/arrivals").json()["arrivals"])


def pod_aborts(fleet: Fleet) -> float:
    total = 0.0
    for pod in (fleet.pod_a, fleet.pod_b):
        for family in text_string_to_metric_families(httpx.get(pod.url + "/metrics").text):
            if family.name == "podsim:aborts":
                total += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return total


def tls_config(fleet: Fleet, cert: Path, key: Path, port: int, **tls: Any) -> dict[str, Any]:
    """A gateway before ``fleet.pod_a`` with TLS (and HTTP/3 unless ``h3=False``) on ``port``."""
    return {
        "server": {
            "host": "127.0.0.1", "access_log": False,
            "tls": {"cert": str(cert), "key": str(key), "port": port, **tls},
        },
        "pods": [{"name": "pod-a", "url": fleet.pod_a.url, "models": ["llama-8b"]}],
    }


def pod_state(admin_url: str, name: str, admin_key: str | None = None) -> dict[str, Any]:
    """The live state of the gateway's pod ``name``, from ``/admin/pods`` on its admin listener
    (with ``admin_key`` when auth is on)."""
    headers = {"authorization": f"Bearer {admin_key}"} if admin_key else {}
    pods = httpx.get(admin_url + "/admin/pods", headers=headers).json()["pods"]
    return next(p for p in pods if p["name"] == name)["state"]


def counter_totals(
    admin_url: str, family: str, label: str, timeout_s: float = 5.0, **where: str
) -> dict[str, float]:
    """A counter's ``_total`` values on the admin listener's /metrics by ``label``, of samples
    matching ``where``."""
    totals: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(admin_url + "/metrics", timeout=timeout_s).text):
        if fam.name == family:
            for s in fam.samples:
                if s.name.endswith("_total") and all(s.labels.get(k) == v for k, v in where.items()):
                    totals[s.labels[label]] = totals.get(s.labels[label], 0.0) + s.value
    return totals


def gateway_in_flight(admin_url: str) -> float:
    text = httpx.get(admin_url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return sum(s.value for s in families["sluicegate_in_flight_requests"].samples)


def wait_for(condition, timeout_s: float = 5.0) -> bool:
    """Poll a metric-based condition with a bounded deadline (the metric is the event)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Debian's headless Chromium driven by Playwright (no browser download), for page tests;
    skipped, saying why, where either is missing."""
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="the python package playwright is not installed (make test installs it)"
    )
    if CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed (make test installs it when run as root)")
    with sync_api.sync_playwright() as playwright:
        try:
            chromium = playwright.chromium.launch(executable_path=CHROMIUM)
        except Exception as err:
            pytest.skip(f"chromium at {CHROMIUM} did not start: {err}")
        yield chromium
        chromium.close()
