"""Degrade to non-streaming: a tier's streams are served whole while the pod streams slowly.

The codec is checked on its own (a whole completion in, an OpenAI stream out), then through a gateway
whose only pod streams at 25 ms a token while the "free" tier degrades above a 15 ms p95.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from gateway.degrade import as_sse, non_streaming_body
from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from tests.conftest import pod_state, wait_for
from tests.keys import auth_on, key_store


def events(stream: bytes) -> list[dict]:
    out = []
    for block in stream.split(b"\n\n"):
        if block.startswith(b"data: ") and block != b"data: [DONE]":
            out.append(json.loads(block[6:]))
    assert stream.endswith(b"data: [DONE]\n\n")
    return out


def test_the_request_asks_for_the_whole_answer_and_remembers_the_usage_option() -> None:
    payload = {"model": "m", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 5}
    body, usage = non_streaming_body(payload)
    assert json.loads(body) == {"model": "m", "stream": False, "max_tokens": 5}
    assert usage is True
    assert non_streaming_body({"model": "m", "stream": True})[1] is False


def test_a_whole_chat_completion_becomes_an_openai_stream() -> None:
    completion = {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 7, "model": "m",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "Hello there"}, "finish_reason": "stop"},
            {
                "index": 1,
                "message": {
                    "role": "assistant", "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ],
                },
                "finish_reason": "tool_calls",
            },
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    chunks = events(as_sse(json.dumps(completion).encode(), include_usage=True))
    assert all(c["id"] == "chatcmpl-1" and c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Hello there"}
    call = chunks[1]["choices"][0]["delta"]["tool_calls"][0]
    assert call["index"] == 0 and call["function"]["name"] == "f"
    assert [c["choices"][0]["finish_reason"] for c in chunks[2:4]] == ["stop", "tool_calls"]
    assert chunks[4]["choices"] == [] and chunks[4]["usage"]["total_tokens"] == 5
    assert len(events(as_sse(json.dumps(completion).encode(), include_usage=False))) == 4


def test_a_whole_text_completion_becomes_a_stream_and_garbage_is_refused() -> None:
    completion = {
        "id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m",
        "choices": [{"index": 0, "text": "abc", "finish_reason": "length"}],
    }
    chunks = events(as_sse(json.dumps(completion).encode(), include_usage=True))
    assert [c["choices"][0]["text"] for c in chunks] == ["abc", ""]
    assert chunks[1]["choices"][0]["finish_reason"] == "length"
    for bad in (b"not json", b"[1]", b'{"error": {"message": "x"}}'):
        with pytest.raises(ValueError):
            as_sse(bad, include_usage=False)


# --- through a gateway ---------------------------------------------------------------------------

CHAT = {"model": "llama-8b", "messages": [{"role": "user", "content": "tell me"}], "max_tokens": 30}


KEYS: dict[str, str] = {}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    store = tmp_path_factory.mktemp("keys") / "keys.yaml"
    KEYS.update(key_store(store, {"id": "sk-free", "tier": "free"}, {"id": "sk-paid", "tier": "paid"},
                          {"id": "ops", "rights": ["admin"]}))  # fmt: skip
    with PodsimProcess(["--model", "llama-8b", "--ttft-ms", "5", "--itl-ms", "25"]) as pod:
        config = {
            "server": {"host": "127.0.0.1"},
            "health": {"scrape": {"interval_s": 0.1}},
            "auth": auth_on(store),
            "tiers": {"free": {"degrade": {"inter_token_p95_ms": 15}}, "paid": {}},
            "pods": [{"name": "slow", "url": pod.url, "models": ["llama-8b"]}],
        }
        with GatewayProcess(config) as gw:
            yield gw


def stream(url: str, key: str, **extra: object) -> tuple[str, httpx.Headers, list[dict]]:
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json={**CHAT, "stream": True, **extra},
        headers={"authorization": f"Bearer {KEYS[key]}"}, timeout=30,
    ) as resp:
        assert resp.status_code == 200
        body = resp.read()
    chunks = events(body)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return text, resp.headers, chunks


def itl_p95_ms(admin_url: str) -> float | None:
    return pod_state(admin_url, "slow", KEYS["ops"])["load"]["itl_p95_ms"]


def test_a_degrading_tier_streams_until_the_pod_is_slow_then_gets_whole_answers(
    gateway: GatewayProcess,
) -> None:
    url = gateway.url
    # no pace measured yet: the free tier streams like everyone else
    streamed, headers, chunks = stream(url, "sk-free")
    assert "x-sluicegate-degraded" not in headers
    assert len(chunks) > 10  # token by token
    # the pod has now streamed 30 tokens at 25 ms: its p95 gap is over the free tier's 15 ms
    assert wait_for(lambda: (itl_p95_ms(gateway.admin_url) or 0) > 15)
    whole, headers, chunks = stream(url, "sk-free", stream_options={"include_usage": True})
    assert headers["x-sluicegate-degraded"] == "non-streaming"
    assert whole == streamed  # the same answer, in one piece
    assert len(chunks) == 3 and chunks[-1]["usage"]["completion_tokens"] == 30
    # the paid tier has no degrade setting: it keeps streaming
    paid, headers, chunks = stream(url, "sk-paid")
    assert "x-sluicegate-degraded" not in headers and len(chunks) > 10 and paid == streamed
    # and the OpenAI SDK reads a degraded answer like any stream
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEYS["sk-free"], max_retries=0)
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(**CHAT, stream=True)]
    assert "".join(pieces) == streamed
