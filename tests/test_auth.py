"""API keys at the front door, on every transport, with real clients.

Keys are made with the real ``sluicegate keys`` command; the gateway is a real process with auth on
(a key store file), in front of the simulated pods and, for what pods receive, an independent
raw-socket pod that records every request head it gets.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess, free_tcp_and_udp_port
from tests.conftest import Fleet, tls_config, wait_for
from tests.keys import add_key
from tests.test_grpc_web import NODE_PROBLEM, connect, descriptor_set, grpc_web  # noqa: F401 (fixture)
from tests.test_truncation import RawPod
from transports.client import SluicegateClient, SluicegateError
from transports.tls import self_signed

MESSAGES = [{"role": "user", "content": "hi"}]
CHAT = {"model": "llama-8b", "messages": MESSAGES, "max_tokens": 8}


def make_key(store: Path, key_id: str, *flags: str) -> str:
    """A key made as an operator makes one: ``sluicegate keys create`` prints it once."""
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "keys", "create", "--file", str(store), "--id", key_id, *flags],
        capture_output=True, text=True, check=True,
    )
    return done.stdout.strip()


@dataclass
class Keys:
    store: Path
    good: str  # any model
    llama_only: str  # may use llama-8b only
    expired: str


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    store = tmp_path_factory.mktemp("keys") / "keys.yaml"
    return Keys(
        store,
        make_key(store, "team-a", "--tier", "gold"),
        make_key(store, "llama-only", "--model", "llama-8b"),
        add_key(store, {"id": "old", "expires": "2001-01-01T00:00:00Z"}),  # the CLI refuses a past date
    )


def auth_config(base: dict[str, Any], keys: Keys) -> dict[str, Any]:
    return {**base, "auth": {"enabled": True, "keys_file": str(keys.store), "reload_interval_s": 0.05},
            "tiers": {"gold": {"quota": {"requests_per_minute": 100_000}}}}  # fmt: skip


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return self_signed(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def gateway(fleet: Fleet, keys: Keys, certificate: tuple[Path, Path]) -> Iterator[tuple[GatewayProcess, str]]:
    port = free_tcp_and_udp_port()
    with GatewayProcess(auth_config(tls_config(fleet, *certificate, port), keys)) as gw:
        yield gw, f"https://localhost:{port}"


# (key attribute or None, model) -> expected HTTP status and gRPC code name
OUTCOMES = [
    ("no_key", None, "llama-8b", 401, "Unauthenticated"),
    ("unknown_key", "sk-sg-not-a-key", "llama-8b", 401, "Unauthenticated"),
    ("expired_key", "expired", "llama-8b", 401, "Unauthenticated"),
    ("model_not_allowed", "llama_only", "qwen-0.5b", 403, "PermissionDenied"),
    ("allowed", "llama_only", "llama-8b", 200, "OK"),
    ("good", "good", "llama-8b", 200, "OK"),
]


def _key(keys: Keys, which: str | None) -> str | None:
    if which is None or which.startswith("sk-"):
        return which
    return getattr(keys, which)


async def _stream(base: str, transport: str, key: str | None, model: str, verify: Any = True) -> int:
    options: dict[str, Any] = {"transport": transport, "verify": verify}
    if transport == "h2":
        options = {"transport": "h2", "h2c": True}
    elif transport == "h1":
        options = {"transport": "h1"}
    async with SluicegateClient(base, api_key=key, **options) as client:
        try:
            async with client.stream_chat(model, MESSAGES, max_tokens=6) as stream:
                text = "".join([token async for token in stream])
        except SluicegateError as exc:
            assert exc.type == "invalid_request_error"
            assert exc.code == ("invalid_api_key" if exc.status == 401 else "model_not_allowed")
            return exc.status or 0
    assert text
    return 200


@pytest.mark.parametrize("transport", ["h1", "h2", "h3"])
@pytest.mark.parametrize(("case", "which", "model", "status", "grpc"), OUTCOMES, ids=[o[0] for o in OUTCOMES])
async def test_every_auth_outcome_over_http(
    gateway: tuple[GatewayProcess, str], keys: Keys, certificate: tuple[Path, Path],
    transport: str, case: str, which: str | None, model: str, status: int, grpc: str,
) -> None:
    gw, https = gateway
    base = https if transport == "h3" else gw.url
    got = await _stream(base, transport, _key(keys, which), model, verify=str(certificate[0]))
    assert got == status, case


@pytest.mark.skipif(NODE_PROBLEM is not None, reason=f"Connect for Node.js: {NODE_PROBLEM}")
def test_every_auth_outcome_over_grpc_web(
    gateway: tuple[GatewayProcess, str], keys: Keys, descriptor_set: Path  # noqa: F811
) -> None:
    gw, _ = gateway
    calls = []
    for _, which, model, _, _ in OUTCOMES:
        key = _key(keys, which)
        calls.append({
            "baseUrl": gw.url, "method": "StreamChatCompletion",
            "request": {"model": model, "messages": MESSAGES, "max_tokens": 6},
            "headers": {"authorization": f"Bearer {key}"} if key else {},
        })  # fmt: skip
    results = connect(descriptor_set, *calls)
    for (case, _, _, _, grpc), result in zip(OUTCOMES, results, strict=True):
        assert result["codeName"] == grpc, (case, result)
        if grpc == "OK":
            assert result["text"], case


def test_the_openai_sdk_raises_its_own_auth_errors(gateway: tuple[GatewayProcess, str], keys: Keys) -> None:
    gw, _ = gateway
    with pytest.raises(openai.AuthenticationError) as wrong:  # (the SDK itself refuses to send no key)
        openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-sg-wrong").chat.completions.create(**CHAT)
    assert wrong.value.code == "invalid_api_key"
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=keys.llama_only, max_retries=0)
    with pytest.raises(openai.PermissionDeniedError) as denied:
        client.chat.completions.create(**{**CHAT, "model": "qwen-0.5b"})
    assert denied.value.code == "model_not_allowed"
    answer = client.chat.completions.create(**CHAT)
    assert answer.choices[0].message.content


def test_x_api_key_is_accepted_and_authorization_wins(
    gateway: tuple[GatewayProcess, str], keys: Keys
) -> None:
    gw, _ = gateway
    url = gw.url + "/v1/chat/completions"
    assert httpx.post(url, json=CHAT, headers={"x-api-key": keys.good}, timeout=30).status_code == 200
    both = {"x-api-key": keys.good, "authorization": "Bearer sk-sg-wrong"}
    assert httpx.post(url, json=CHAT, headers=both, timeout=30).status_code == 401
    refused = httpx.post(url, json=CHAT, timeout=30)
    assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Bearer")
    assert refused.json()["error"]["code"] == "invalid_api_key"


def test_the_keys_quota_headers_reach_every_kind_of_client(
    gateway: tuple[GatewayProcess, str], keys: Keys
) -> None:
    gw, _ = gateway
    auth = {"authorization": f"Bearer {keys.good}"}
    sse = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}, headers=auth, timeout=30)
    assert sse.status_code == 200 and sse.headers["x-ratelimit-limit-requests"] == "100000"
    resp, messages, status = grpc_web(gw.url, "StreamChatCompletion", {**CHAT, "max_tokens": 4}, headers=auth)
    assert status["grpc-status"] == "0" and messages
    assert resp.headers["x-ratelimit-limit-requests"] == "100000"
    assert int(resp.headers["x-ratelimit-remaining-requests"]) < 100_000
    wrong = {"authorization": "Bearer sk-sg-x"}
    _, _, refused = grpc_web(gw.url, "StreamChatCompletion", CHAT, headers=wrong)
    assert refused["grpc-status"] == "16"  # UNAUTHENTICATED, without a Node client too


def test_a_refused_caller_never_reaches_a_pod_nor_sends_its_body(
    gateway: tuple[GatewayProcess, str], fleet: Fleet
) -> None:
    gw, _ = gateway
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 60_000}]}
    refused = httpx.post(gw.url + "/v1/chat/completions", json=big, timeout=30,
                         headers={"x-request-id": "refused-at-the-door"})  # fmt: skip
    assert refused.status_code == 401
    for pod in (fleet.pod_a, fleet.pod_b):
        arrivals = httpx.get(pod.url + "/podsim/arrivals").json()["arrivals"]
        assert "refused-at-the-door" not in {a["id"] for a in arrivals}


# -- the key goes nowhere ------------------------------------------------------------------------------


class RecordingPod(RawPod):
    """The raw-socket pod, keeping every request head it was sent."""

    def __init__(self) -> None:
        self.heads: list[bytes] = []
        super().__init__()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        original = reader.readuntil

        async def readuntil(separator: bytes = b"\n") -> bytes:
            head = await original(separator)
            self.heads.append(head)
            return head

        reader.readuntil = readuntil  # type: ignore[method-assign]
        await super()._serve(reader, writer)


def test_the_key_never_reaches_pods_logs_or_metrics(keys: Keys) -> None:
    pod = RecordingPod()
    config = {
        "server": {"host": "127.0.0.1", "access_log": True},
        "pods": [{"name": "raw", "url": f"http://127.0.0.1:{pod.port}", "models": ["llama-8b"]}],
    }
    try:
        with GatewayProcess(auth_config(config, keys)) as gw:
            for headers in ({"authorization": f"Bearer {keys.good}"}, {"x-api-key": keys.good}):
                resp = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                                  headers=headers, timeout=30)  # fmt: skip
                assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n")
            wrong = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30,
                               headers={"authorization": "Bearer sk-sg-a-wrong-key-to-log"})  # fmt: skip
            assert wrong.status_code == 401
            metrics = httpx.get(gw.admin_url + "/metrics").text
            gw.stop()
            log = gw.log()
    finally:
        pod.stop()
    posts = [head for head in pod.heads if head.startswith(b"POST")]
    assert len(posts) == 2
    for head in posts:
        assert keys.good.encode() not in head
        assert b"x-api-key" not in head.lower() and b"authorization" not in head.lower()
    assert "rid=" in log and "key=team-a" in log  # the access log names the key by its id
    for secret in (keys.good, "sk-sg-a-wrong-key-to-log"):
        assert secret not in log and secret not in metrics
    assert keys.good[:12] not in log


# -- the key store changes under load ------------------------------------------------------------------


def test_keys_reload_under_load_without_dropping_a_stream(tmp_path: Path) -> None:
    store = tmp_path / "keys.yaml"
    first = make_key(store, "first")
    slow = PodsimProcess(["--model", "llama-8b", "--ttft-ms", "5", "--itl-ms", "20"])
    with slow, GatewayProcess(auth_config(
        {"server": {"host": "127.0.0.1", "access_log": False},
         "pods": [{"name": "slow", "url": slow.url, "models": ["llama-8b"]}]},
        Keys(store, first, first, first),
    )) as gw:  # fmt: skip
        url = gw.url + "/v1/chat/completions"
        results: list[str] = []
        started = threading.Barrier(9)

        def stream() -> None:
            body = {**CHAT, "stream": True, "max_tokens": 250}
            with httpx.stream("POST", url, json=body, headers={"authorization": f"Bearer {first}"},
                              timeout=30) as resp:  # fmt: skip
                assert resp.status_code == 200
                chunks = resp.iter_bytes()
                text = next(chunks)
                started.wait(10)
                text += b"".join(chunks)
            results.append(text.decode())

        threads = [threading.Thread(target=stream) for _ in range(8)]
        for thread in threads:
            thread.start()
        started.wait(10)  # eight streams under way; now the store changes twice
        second = make_key(store, "second")
        subprocess.run([sys.executable, "-m", "gateway.cli", "keys", "revoke", "--file", str(store), "first"],
                       check=True, capture_output=True)  # fmt: skip

        def status_with(key: str) -> int:
            headers = {"authorization": f"Bearer {key}"}
            return httpx.post(url, json=CHAT, headers=headers, timeout=30).status_code

        assert wait_for(lambda: status_with(second) == 200, 10)  # the new store is in force
        assert status_with(first) == 401
        for thread in threads:
            thread.join(30)
        assert len(results) == 8
        assert all(text.endswith("data: [DONE]\n\n") for text in results)  # nothing cut


def test_serve_refuses_to_start_without_a_key_store(tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(f"auth: {{keys_file: {tmp_path / 'missing.yaml'}}}\n")
    serve = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--upstream", "http://127.0.0.1:9"]
    done = subprocess.run(serve, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "missing.yaml" in done.stderr
    assert "sluicegate keys create" in done.stderr

