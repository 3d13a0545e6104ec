"""The gateway's own API key towards pods (vLLM's ``--api-key``): resolved at start, sent on
inference and discovery, rotated from a key file without a restart; and the pod simulator's
``--api-key`` answering as vLLM does."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.config import ConfigError, PodConfig, PodCredentials
from gateway.config_load import parse_config
from gateway.pods import credentials as creds
from gateway.pods.credentials import ApiKey, PodAccess
from gateway.pods.dns import DnsDiscovery
from gateway.pods.kubernetes import KubePod
from gateway.pods.registry import PodRegistry
from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from tests.conftest import FAST, pod_state, wait_for

POD_KEY = "pod-key-0123456789"

# gateway/app.py (the lead's) must build the registry with PodAccess.from_config(config) and hand the
# discovery sources their credentials; until it does, the gateway process sends no pod key and has
# no TLS settings, and these tests say so. Drop the marker with that wiring.


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --- resolving keys ------------------------------------------------------------------------------


def test_a_key_from_the_environment_becomes_a_bearer_header(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("A2_POD_KEY", f"  {POD_KEY}\n")
    key = ApiKey.resolve(PodCredentials(api_key_env="A2_POD_KEY"), "upstream.credentials")
    assert key.header == b"Bearer " + POD_KEY.encode()


def test_a_missing_environment_variable_names_the_key_and_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("A2_ABSENT", raising=False)
    with pytest.raises(ConfigError) as err:
        ApiKey.resolve(PodCredentials(api_key_env="A2_ABSENT"), "pods.1.credentials")
    assert "pods.1.credentials.api_key_env" in str(err.value) and "A2_ABSENT is not set" in str(err.value)


@pytest.mark.parametrize(("content", "why"), [(None, "cannot read"), ("\n", "is empty"),
                                              ("a\x00b", "cannot carry")])  # fmt: skip
def test_an_unusable_key_file_names_the_key_and_the_file(
    tmp_path: Path, content: str | None, why: str
) -> None:
    path = tmp_path / "key"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as err:
        ApiKey.resolve(PodCredentials(api_key_file=str(path)), "discovery.dns.credentials")
    text = str(err.value)
    assert text.startswith("discovery.dns.credentials.api_key_file:") and str(path) in text and why in text


def test_a_rotated_key_file_is_picked_up_within_the_recheck_interval(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_text("first\n")
    clock = Clock()
    key = ApiKey.resolve(PodCredentials(api_key_file=str(path)), "upstream.credentials", clock)
    assert key.header == b"Bearer first"
    # A Kubernetes Secret update: the new file is renamed over the old one (a new inode).
    (tmp_path / "next").write_text("second\n")
    os.replace(tmp_path / "next", path)
    assert key.header == b"Bearer first"  # not looked at again before RECHECK_S
    clock.now += creds.RECHECK_S
    assert key.header == b"Bearer second"
    # Mid-rotation the file may be missing for a moment: the last good key stays in use.
    path.unlink()
    clock.now += creds.RECHECK_S
    assert key.header == b"Bearer second"
    path.write_text("third")
    clock.now += creds.RECHECK_S
    assert key.header == b"Bearer third"


def test_a_key_file_is_not_read_again_while_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "key"
    path.write_text("same")
    clock = Clock()
    key = ApiKey.resolve(PodCredentials(api_key_file=str(path)), "upstream.credentials", clock)
    reads: list[str] = []
    monkeypatch.setattr(creds, "_read", lambda p: reads.append(p) or "same")
    for _ in range(3):
        clock.now += creds.RECHECK_S
        assert key.header == b"Bearer same"
    assert reads == []  # only stat()ed


# --- which pod gets which key --------------------------------------------------------------------


def _config(tmp_path: Path, **extra: Any) -> Any:
    (tmp_path / "default").write_text("default-key")
    (tmp_path / "own").write_text("own-key")
    return parse_config({
        "upstream": {"credentials": {"api_key_file": str(tmp_path / "default")}},
        "pods": [
            {"name": "plain", "url": "http://10.0.0.1:8000", "models": ["m"]},
            {"name": "own", "url": "http://10.0.0.2:8000", "models": ["m"],
             "credentials": {"api_key_file": str(tmp_path / "own")}},
        ],
        **extra,
    })  # fmt: skip


def test_pods_get_their_own_key_else_the_upstream_default(tmp_path: Path) -> None:
    config = _config(tmp_path)
    registry = PodRegistry(config.pods, config.health, access=PodAccess.from_config(config))
    assert registry.get("plain").auth_header == b"Bearer default-key"
    assert registry.get("own").auth_header == b"Bearer own-key"
    assert PodRegistry(config.pods[:1]).get("plain").auth_header is None  # no access: no key


def test_every_key_in_the_config_is_resolved_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("A2_DNS_KEY", raising=False)
    config = _config(tmp_path, discovery={"dns": {"host": "pods.local", "port": 8000,
                                                  "credentials": {"api_key_env": "A2_DNS_KEY"}}})  # fmt: skip
    with pytest.raises(ConfigError, match=r"^discovery\.dns\.credentials\.api_key_env: .*A2_DNS_KEY"):
        PodAccess.from_config(config)


def test_discovered_pods_carry_their_source_s_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("A2_DNS_KEY", "dns-key")
    source = PodCredentials(api_key_env="A2_DNS_KEY")
    config = _config(tmp_path, discovery={"dns": {"host": "pods.local", "port": 8000,
                                                  "credentials": source.model_dump()}})  # fmt: skip
    registry = PodRegistry(config.pods, config.health, access=PodAccess.from_config(config))
    found = DnsDiscovery("pods.local", 8000, models=["m"], credentials=source).pods(["10.1.0.7"])
    kube = KubePod(name="ns/p", url="http://10.1.0.8:8000", models=("m",), credentials=source)
    registry.sync([*config.pods, *(p.to_pod_config() for p in found), kube.to_pod_config()])
    assert registry.get("10.1.0.7").auth_header == b"Bearer dns-key"
    assert registry.get("ns/p").auth_header == b"Bearer dns-key"
    # a pod that stays but whose source changed its credentials follows them
    registry.sync([PodConfig(name="ns/p", url="http://10.1.0.8:8000", models=("m",))])
    assert registry.get("ns/p").auth_header == b"Bearer default-key"


# --- the simulator's --api-key, as vLLM answers ---------------------------------------------------


@pytest.fixture(scope="module")
def guarded_pod() -> Iterator[PodsimProcess]:
    with PodsimProcess(["--api-key", POD_KEY, "--api-key", "second-key", *FAST]) as pod:
        yield pod


def test_podsim_refuses_v1_without_the_key_exactly_as_vllm(guarded_pod: PodsimProcess) -> None:
    chat = {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {POD_KEY}"},
                    {"authorization": POD_KEY}):  # fmt: skip
        listed = httpx.get(guarded_pod.url + "/v1/models", headers=headers)
        chatted = httpx.post(guarded_pod.url + "/v1/chat/completions", json=chat, headers=headers)
        for resp in (listed, chatted):
            assert resp.status_code == 401
            assert resp.content == b'{"error":"Unauthorized"}'
            assert resp.headers["content-type"] == "application/json"
    for key in (POD_KEY, "second-key"):
        ok = httpx.post(
            guarded_pod.url + "/v1/chat/completions", json=chat, headers={"authorization": f"bearer {key}"}
        )
        assert ok.status_code == 200 and ok.json()["object"] == "chat.completion"


def test_podsim_leaves_health_and_metrics_open(guarded_pod: PodsimProcess) -> None:
    for path in ("/health", "/metrics", "/ping", "/version", "/load"):
        assert httpx.get(guarded_pod.url + path).status_code == 200, path
    assert httpx.options(guarded_pod.url + "/v1/models").status_code != 401  # preflights pass


# --- the gateway before a pod that wants a key ---------------------------------------------------


def _gateway(pod: PodsimProcess, key_file: Path | None, models: tuple[str, ...] = ()) -> GatewayProcess:
    """A gateway before the pod; without ``models``, they come from its (guarded) /v1/models."""
    config: dict[str, Any] = {
        "server": {"host": "127.0.0.1"},
        "discovery": {"refresh_interval_s": 60, "retry_interval_s": 60},
        # the rotation test provokes refusals on purpose: they must not eject the only pod
        "health": {"outlier": {"consecutive_failures": 1000}},
        "pods": [{"name": "guarded", "url": pod.url, "models": list(models)}],
    }
    if key_file is not None:
        config["upstream"] = {"credentials": {"api_key_file": str(key_file)}}
    return GatewayProcess(config)


def _stream(url: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="the-client-s-own-key", max_retries=0)
    chunks = client.chat.completions.create(
        model="llama-8b", messages=[{"role": "user", "content": "hello"}], max_tokens=4, stream=True
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_with_the_pod_s_key_the_gateway_discovers_and_streams(
    guarded_pod: PodsimProcess, tmp_path: Path
) -> None:
    key_file = tmp_path / "pod-key"
    key_file.write_text(POD_KEY + "\n")
    with _gateway(guarded_pod, key_file) as gw:
        state = pod_state(gw.admin_url, "guarded")
        assert state["reachable"] and state["last_error"] is None
        # the client's own key (sent by the SDK) is not what reached the pod: the pod's key did
        assert _stream(gw.url)


def test_without_a_key_the_pod_is_unreachable_and_says_why(guarded_pod: PodsimProcess) -> None:
    with _gateway(guarded_pod, None, ("llama-8b",)) as gw:
        state = pod_state(gw.admin_url, "guarded")
        assert not state["reachable"]
        assert state["last_error"].startswith("/v1/models: HTTP 401 (the pod wants an API key")
        with pytest.raises(openai.APIStatusError) as err:
            _stream(gw.url)
        assert err.value.status_code == 503  # the pod's refusal is not the client's: no pod can take it


def test_a_rotated_key_file_takes_effect_without_a_restart(
    guarded_pod: PodsimProcess, tmp_path: Path
) -> None:
    key_file = tmp_path / "pod-key"
    key_file.write_text(POD_KEY)
    with _gateway(guarded_pod, key_file) as gw:
        assert _stream(gw.url)
        # a key the pod does not know: its 401 reaches the client as the gateway's 502, naming the pod
        (tmp_path / "next").write_text("revoked-key")
        os.replace(tmp_path / "next", key_file)
        chat = {"model": "llama-8b", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}

        def refused() -> bool:
            resp = httpx.post(gw.url + "/v1/chat/completions", json=chat, timeout=10)
            return resp.status_code == 502

        assert wait_for(refused, timeout_s=creds.RECHECK_S + 4)
        error = httpx.post(gw.url + "/v1/chat/completions", json=chat, timeout=10).json()["error"]
        assert error["type"] == "upstream_error" and error["code"] == "upstream_auth_failed"
        assert "'guarded' refused the gateway's credentials (HTTP 401)" in error["message"]
        # and back: the pod's key again
        (tmp_path / "next").write_text(POD_KEY)
        os.replace(tmp_path / "next", key_file)
        assert wait_for(lambda: httpx.post(gw.url + "/v1/chat/completions", json=chat, timeout=10)
                        .status_code == 200, timeout_s=creds.RECHECK_S + 4)  # fmt: skip
        assert _stream(gw.url)
