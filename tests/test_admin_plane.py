"""The admin plane (``/admin/*``, ``/metrics``) answers on its own listener only, and with auth on
its ``/admin`` routes want a key with the ``admin`` right; Prometheus scrapes ``/metrics`` there
without one. Real gateways, real sockets: child processes, and one in-process server where the
test supplies the key lookup."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.config_load import parse_config
from gateway.server import build_server
from loadtest.procs import GatewayProcess
from tests.conftest import Fleet

NOT_FOUND = {
    "error": {
        "message": "No such route on this gateway.", "type": "invalid_request_error", "param": None,
        "code": "not_found",
    }
}


# --- the public port serves none of it ----------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/admin/pods"), ("POST", "/admin/pods/pod-a/clear"), ("GET", "/metrics"), ("GET", "/admin")],
)
def test_the_public_port_answers_admin_routes_like_any_unknown_route(
    fleet: Fleet, method: str, path: str
) -> None:
    unknown = httpx.request(method, fleet.url + "/no-such-route")
    resp = httpx.request(method, fleet.url + path, headers={"authorization": "Bearer sk-anything"})
    assert resp.status_code == unknown.status_code == 404
    assert resp.json() == unknown.json() == NOT_FOUND


def test_the_admin_listener_serves_pods_clear_and_metrics(fleet: Fleet) -> None:
    assert fleet.admin_url.startswith("http://127.0.0.1:")  # admin.host's default: loopback
    assert fleet.admin_url != fleet.url
    pods = httpx.get(fleet.admin_url + "/admin/pods").json()
    assert {p["name"] for p in pods["pods"]} == {"pod-a", "pod-b", "pod-dead"}
    cleared = httpx.post(fleet.admin_url + "/admin/pods/pod-a/clear")
    assert cleared.status_code == 200 and cleared.json()["name"] == "pod-a"
    missing = httpx.post(fleet.admin_url + "/admin/pods/nope/clear")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "pod_not_found"
    scraped = httpx.get(fleet.admin_url + "/metrics")
    assert scraped.status_code == 200 and scraped.headers["content-type"].startswith("text/plain")
    families = {f.name for f in text_string_to_metric_families(scraped.text)}
    assert {"sluicegate_requests", "sluicegate_pod_up", "process_cpu_seconds"} <= families


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/v1/models"])
def test_the_admin_listener_serves_nothing_public(fleet: Fleet, path: str) -> None:
    resp = httpx.get(fleet.admin_url + path)
    assert resp.status_code == 404 and resp.json() == NOT_FOUND


def test_a_disabled_admin_plane_has_no_listener(fleet: Fleet) -> None:
    config = {"pods": [{"name": "pod-a", "url": fleet.pod_a.url, "models": ["llama-8b"]}],
              "admin": {"enabled": False}}  # fmt: skip
    with GatewayProcess(config) as gw:
        assert gw.admin_url == ""
        assert httpx.get(gw.url + "/metrics").status_code == 404
        assert httpx.get(gw.url + "/healthz").status_code == 200


def _serve(tmp_path: Path, config: dict[str, Any]) -> subprocess.Popen[str]:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def test_the_public_line_comes_first_and_the_admin_line_last(tmp_path: Path, fleet: Fleet) -> None:
    config = {"server": {"host": "127.0.0.1", "port": 0}, "auth": {"enabled": False}, "admin": {"port": 0},
              "pods": [{"name": "pod-a", "url": fleet.pod_a.url, "models": ["llama-8b"]}]}  # fmt: skip
    proc = _serve(tmp_path, config)
    try:
        assert proc.stdout is not None
        first, second = proc.stdout.readline(), proc.stdout.readline()
        assert first.startswith("sluicegate listening on http://127.0.0.1:"), first
        assert second.startswith("sluicegate admin listening on http://127.0.0.1:"), second
    finally:
        proc.terminate()
        proc.communicate(timeout=15)


def test_an_admin_port_in_use_is_one_line_and_exit_3(tmp_path: Path, fleet: Fleet) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = {"server": {"host": "127.0.0.1", "port": 0}, "auth": {"enabled": False},
                  "admin": {"port": port},
                  "pods": [{"name": "pod-a", "url": fleet.pod_a.url, "models": ["llama-8b"]}]}  # fmt: skip
        proc = _serve(tmp_path, config)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 3
    assert "listening" not in out
    mine = [line for line in err.splitlines() if line.startswith("sluicegate:")]
    assert len(mine) == 1 and "admin listener" in mine[0] and f"{port}" in mine[0], err
    assert "Traceback" not in err


# --- keys: the admin routes want the admin right ------------------------------------------------


@dataclass(frozen=True)
class FakeRecord:
    """A key record as the key store gives it (``has_right``, ``expired``)."""

    rights: frozenset[str]
    expires: float | None = None

    def has_right(self, name: str) -> bool:
        return name in self.rights

    def expired(self, now: float) -> bool:
        return self.expires is not None and now >= self.expires


KEYS = {
    "sk-admin": FakeRecord(frozenset({"admin"})),
    "sk-user": FakeRecord(frozenset()),
    "sk-override": FakeRecord(frozenset({"variant_override"})),
    "sk-old-admin": FakeRecord(frozenset({"admin"}), expires=time.time() - 60),
}


@dataclass
class Running:
    url: str
    admin_url: str


@contextlib.asynccontextmanager
async def gateway_with_keys(pod_url: str) -> AsyncIterator[Running]:
    """The real server (public and admin listeners) in this process, its admin plane asking the
    test's key lookup."""
    config = parse_config({
        "server": {"host": "127.0.0.1", "port": 0, "access_log": False},
        "admin": {"port": 0},
        "pods": [{"name": "pod-a", "url": pod_url, "models": ["llama-8b"]}],
    })
    assert config.auth.enabled  # the default
    server = build_server(config, "warning", lookup=KEYS.get)
    task = asyncio.create_task(server.serve())
    listening = asyncio.ensure_future(server.listening.wait())
    await asyncio.wait([task, listening], return_when=asyncio.FIRST_COMPLETED)
    assert server.listening.is_set() and server.admin_url is not None, "the server did not start"
    try:
        yield Running(server.urls[0], server.admin_url)
    finally:
        server.should_exit = True
        await task


@pytest.fixture
async def keyed(fleet: Fleet) -> AsyncIterator[Running]:
    async with gateway_with_keys(fleet.pod_a.url) as running:
        yield running


def _error(resp: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error" and error["message"]
    return error


@pytest.mark.parametrize(("method", "path"), [("GET", "/admin/pods"), ("POST", "/admin/pods/pod-a/clear")])
async def test_admin_routes_refuse_callers_without_the_admin_right(
    keyed: Running, method: str, path: str
) -> None:
    async with httpx.AsyncClient(base_url=keyed.admin_url) as client:
        missing = await client.request(method, path)
        _error(missing, 401, "invalid_api_key")
        assert missing.headers["www-authenticate"].startswith("Bearer")
        for headers in (
            {"authorization": "Bearer sk-unknown"},
            {"x-api-key": "sk-unknown"},
            {"authorization": "Basic c2stYWRtaW46"},  # not a bearer key
            {"authorization": "Bearer sk-old-admin"},
        ):
            error = _error(await client.request(method, path, headers=headers), 401, "invalid_api_key")
            assert "sk-" not in error["message"]  # the key is never echoed
        for key in ("sk-user", "sk-override"):
            resp = await client.request(method, path, headers={"authorization": f"Bearer {key}"})
            _error(resp, 403, "permission_denied")


@pytest.mark.parametrize(("method", "path"), [("GET", "/admin/pods"), ("POST", "/admin/pods/pod-a/clear")])
async def test_admin_routes_serve_a_key_with_the_admin_right(keyed: Running, method: str, path: str) -> None:
    async with httpx.AsyncClient(base_url=keyed.admin_url) as client:
        for headers in ({"authorization": "Bearer sk-admin"}, {"x-api-key": "sk-admin"}):
            resp = await client.request(method, path, headers=headers)
            assert resp.status_code == 200, resp.text
            assert "pod-a" in resp.text


async def test_prometheus_scrapes_without_a_key_and_the_public_port_stays_shut(keyed: Running) -> None:
    async with httpx.AsyncClient() as client:
        scraped = await client.get(keyed.admin_url + "/metrics")
        assert scraped.status_code == 200 and "sluicegate_pod_up" in scraped.text
        for path in ("/admin/pods", "/metrics"):
            resp = await client.get(keyed.url + path, headers={"authorization": "Bearer sk-admin"})
            assert resp.status_code == 404 and resp.json() == NOT_FOUND


# --- the real key store -------------------------------------------------------------------------


@pytest.fixture
def key_store(tmp_path: Path) -> Iterator[Path]:
    keystore = pytest.importorskip("gateway.auth.keystore")
    path = tmp_path / "keys.yaml"
    records = [
        {"id": "ops", "hash": keystore.hash_key("sk-sg-ops"), "rights": ["admin"]},
        {"id": "app", "hash": keystore.hash_key("sk-sg-app")},
    ]
    keystore.write_file(path, records)
    yield path


def test_a_gateway_with_a_key_store_opens_the_admin_plane_to_admin_keys_only(
    key_store: Path, fleet: Fleet
) -> None:
    config = {"auth": {"enabled": True, "keys_file": str(key_store)},
              "pods": [{"name": "pod-a", "url": fleet.pod_a.url, "models": ["llama-8b"]}]}  # fmt: skip
    with GatewayProcess(config) as gw:
        pods = gw.admin_url + "/admin/pods"
        _error(httpx.get(pods), 401, "invalid_api_key")
        _error(httpx.get(pods, headers={"authorization": "Bearer sk-sg-nope"}), 401, "invalid_api_key")
        _error(httpx.get(pods, headers={"authorization": "Bearer sk-sg-app"}), 403, "permission_denied")
        assert httpx.get(pods, headers={"authorization": "Bearer sk-sg-ops"}).status_code == 200
        assert httpx.get(gw.admin_url + "/metrics").status_code == 200
        ops = {"authorization": "Bearer sk-sg-ops"}
        assert httpx.get(gw.url + "/admin/pods", headers=ops).status_code == 404
