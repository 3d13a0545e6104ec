"""What one request may ask of the GPUs: message count and completion tokens, per tier.

A real gateway before a real pod simulator; the pod's own record of each request's ``max_tokens``
shows what reached it.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from tests.conftest import FAST
from tests.keys import auth_on, key_store

KEYS: dict[str, str] = {}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    store = tmp_path_factory.mktemp("keys") / "keys.yaml"
    KEYS.update(key_store(store, {"id": "anyone"}, {"id": "sk-free", "tier": "free"},
                          {"id": "sk-pro", "tier": "pro"}))  # fmt: skip
    with PodsimProcess(["--model", "llama-8b", *FAST]) as pod:
        config = {
            "server": {"host": "127.0.0.1", "max_messages": 8, "max_choices": 2},
            "auth": auth_on(store),
            "tiers": {"free": {"max_tokens": 12, "max_messages": 4}, "pro": {}},
            "pods": [{"name": "pod-a", "url": pod.url, "models": ["llama-8b"]}],
        }
        with GatewayProcess(config) as gw:
            yield gw


def chat(messages: int = 1, **extra: object) -> dict:
    return {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}] * messages, **extra}


def post(gw: GatewayProcess, body: dict, key: str = "anyone") -> httpx.Response:
    """``body`` sent with the key whose id is ``key`` (its tier's limits apply)."""
    headers = {"authorization": f"Bearer {KEYS[key]}"}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


def test_too_many_messages_is_a_400_naming_the_param(gateway: GatewayProcess) -> None:
    assert post(gateway, chat(8, max_tokens=2)).status_code == 200
    resp = post(gateway, chat(9, max_tokens=2))
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "messages" and error["code"] == "too_many_messages"
    assert "at most 8" in error["message"]
    # a tier's own, lower limit
    assert post(gateway, chat(5, max_tokens=2), "sk-free").json()["error"]["code"] == "too_many_messages"
    assert post(gateway, chat(8, max_tokens=2), "sk-pro").status_code == 200


def test_a_tier_may_not_ask_for_more_tokens_than_its_cap(gateway: GatewayProcess) -> None:
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEYS["sk-free"], max_retries=0)
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(**chat(max_tokens=13))
    assert raised.value.body["param"] == "max_tokens"
    assert raised.value.body["code"] == "max_tokens_too_large"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**chat(max_completion_tokens=100))
    assert client.chat.completions.create(**chat(max_tokens=12)).usage.completion_tokens == 12


def test_a_request_that_names_no_limit_gets_its_tiers_cap(gateway: GatewayProcess) -> None:
    # the pod simulator would otherwise answer with its default (16 tokens); ignore_eos makes it
    # generate exactly what it was allowed
    resp = post(gateway, chat(ignore_eos=True), "sk-free")
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 12
    usage = {"include_usage": True}
    stream = post(gateway, chat(ignore_eos=True, stream=True, stream_options=usage), "sk-free")
    assert stream.status_code == 200 and '"completion_tokens":12' in stream.text.replace(" ", "")
    assert post(gateway, chat(ignore_eos=True), "sk-pro").json()["usage"]["completion_tokens"] == 16


def test_a_capped_body_is_rewritten_whatever_unicode_the_client_sent(gateway: GatewayProcess) -> None:
    # a lone surrogate is valid JSON; the body with the tier's cap written in must still encode
    raw = b'{"model":"llama-8b","messages":[{"role":"user","content":"\\ud800 hi"}],"ignore_eos":true}'
    resp = httpx.post(gateway.url + "/v1/chat/completions", content=raw, timeout=30,
                      headers={"authorization": f"Bearer {KEYS['sk-free']}",
                               "content-type": "application/json"})  # fmt: skip
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 12


def test_more_choices_than_allowed_is_a_400(gateway: GatewayProcess) -> None:
    # n=2 is let through to the pod (the simulator itself answers only n=1, with its own 400)
    assert post(gateway, chat(n=2, max_tokens=2)).json()["error"]["code"] != "too_many_choices"
    resp = post(gateway, chat(n=3, max_tokens=2))
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "n" and resp.json()["error"]["code"] == "too_many_choices"
