"""The pod simulator: engine unit tests without sockets, then real processes over real sockets."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.podsim.engine import (
    ABORTED,
    FINISHED,
    WAITING,
    Engine,
    EngineConfig,
    ModelStats,
    Sequence,
    kv_blocks_for,
)
from loadtest.podsim.faults import Faults, faults_from_json, parse_faults
from loadtest.podsim.launch import PodsimProcess, PodsimStartError
from loadtest.podsim.words import WordSequence, stable_seed

GPU = "GPU-5e0f8a2c-1b7d-4c1e-9a55-0c3f2d7e8b11"
MIG = "MIG-2ce7a541-c516-5dbc-a76e-26cc100d9b55"
FAST = ["--ttft-ms", "5", "--itl-ms", "1", "--itl-per-seq-ms", "0"]
CHAT = {
    "model": "llama-8b",
    "messages": [{"role": "user", "content": "Tell me about MIG."}],
    "max_tokens": 12,
}

# shared/wire/vllm-chat-stream.txt and vllm-midstream-error.txt: what vLLM really sends.
SAMPLE_STREAM = [
    '{"id":"chatcmpl-9f1c","object":"chat.completion.chunk","created":1761566772,"model":"llama-8b","choices":'
    '[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
    '"prompt_token_ids":null,"prompt_text":null}',
    '{"id":"chatcmpl-9f1c","object":"chat.completion.chunk","created":1761566772,"model":"llama-8b","choices":'
    '[{"index":0,"delta":{"content":" Hello"},"logprobs":null,"finish_reason":null,"token_ids":null}]}',
    '{"id":"chatcmpl-9f1c","object":"chat.completion.chunk","created":1761566772,"model":"llama-8b","choices":'
    '[{"index":0,"delta":{"content":"."},"logprobs":null,"finish_reason":"stop","stop_reason":null,'
    '"token_ids":null}]}',
    '{"id":"chatcmpl-9f1c","object":"chat.completion.chunk","created":1761566772,"model":"llama-8b",'
    '"choices":[],"usage":{"prompt_tokens":21,"total_tokens":23,"completion_tokens":2}}',
]
SAMPLE_MIDSTREAM_ERROR = (
    b'data: {"error":{"message":"Internal server error","type":"InternalServerError",'
    b'"param":null,"code":500}}'
)


# --- helpers -------------------------------------------------------------------------------------


class _Handle:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """A deterministic stand-in for the event loop's time() and call_at()."""

    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[tuple[float, int, _Handle, Callable[..., Any], tuple[Any, ...]]] = []
        self._order = itertools.count()

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[..., Any], *args: Any) -> _Handle:
        handle = _Handle()
        heapq.heappush(self._queue, (when, next(self._order), handle, callback, args))
        return handle

    def advance(self, seconds: float) -> None:
        self.run_until(self.now + seconds)

    def run_until(self, deadline: float) -> None:
        while self._queue and self._queue[0][0] <= deadline + 1e-12:
            when, _, handle, callback, args = heapq.heappop(self._queue)
            if not handle.cancelled:
                self.now = max(self.now, when)
                callback(*args)
        self.now = max(self.now, deadline)

    def run_all(self, limit_s: float = 600.0) -> None:
        self.run_until(self.now + limit_s)


class Recorder:
    """Engine callbacks that record when each token of a sequence came out."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.times: list[float] = []
        self.finished_at: float | None = None

    def emit(self, seq: Sequence) -> None:
        assert seq.generated == len(self.times) + 1
        self.times.append(self.clock.now)

    def finish(self, seq: Sequence) -> None:
        self.emit(seq)
        self.finished_at = self.clock.now


def make_seq(stats: ModelStats, rec: Recorder, prompt: int, limit: int) -> Sequence:
    return Sequence(stats, prompt, limit, emit=rec.emit, finish=rec.finish)


def sse_events(body: bytes) -> list[bytes]:
    """SSE payloads (after ``data: ``), asserting the vLLM framing on the way."""
    assert body.endswith(b"\n\n")
    events = body[:-2].split(b"\n\n")
    assert all(e.startswith(b"data: ") for e in events), events
    return [e[len(b"data: ") :] for e in events]


def shape(value: Any) -> Any:
    """Key order of dicts, recursively (lists by their first element): the layout, not the values."""
    if isinstance(value, dict):
        return [(k, shape(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__ if value is not None else None


def tokens_of(events: list[bytes]) -> list[str]:
    out = []
    for payload in events:
        if payload == b"[DONE]" or payload == b'{"id":':  # the end, or the malformed_after event
            continue
        chunk = json.loads(payload)
        for choice in chunk.get("choices", []):
            text = choice["delta"].get("content") if "delta" in choice else choice.get("text")
            if text:
                out.append(text)
    return out


def metric_value(url: str, family: str, sample: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics").text
    for fam in text_string_to_metric_families(text):
        if fam.name == family:
            return sum(
                s.value
                for s in fam.samples
                if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
            )
    raise AssertionError(f"{family} not in /metrics")


async def eventually(check: Callable[[], bool], deadline_s: float = 5.0) -> None:
    """Poll ``check`` (e.g. a /metrics read) until it holds; fails after the deadline."""
    end = time.monotonic() + deadline_s
    while not await asyncio.to_thread(check):
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


def chat_text(url: str, **body: Any) -> str:
    resp = httpx.post(url + "/v1/chat/completions", json={**CHAT, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"]


# --- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sim() -> Iterator[PodsimProcess]:
    args = ["--model", "llama-8b", "--model", "qwen-0.5b", "--model", "abortable", *FAST]
    args += ["--gpu-uuid", GPU, "--mig-uuid", MIG, "--mig-profile", "1g.10gb"]
    with PodsimProcess(args) as pod:
        yield pod


@pytest.fixture(scope="module")
def tight() -> Iterator[PodsimProcess]:
    """Two running sequences at most and a KV cache of 8 blocks (128 tokens)."""
    args = ["--max-num-seqs", "2", "--kv-blocks", "8", "--ttft-ms", "5", "--itl-ms", "5"]
    with PodsimProcess(args) as pod:
        yield pod
        assert pod.stop() == 0  # SIGTERM is a clean exit


# --- engine, without sockets ---------------------------------------------------------------------


def test_kv_capacity_comes_from_the_mig_profile() -> None:
    assert kv_blocks_for("1g.10gb") == 10 * 256
    assert kv_blocks_for("3g.40gb") == 40 * 256
    assert kv_blocks_for(None) == 80 * 256
    with pytest.raises(ValueError, match="MIG profile"):
        kv_blocks_for("big")


def test_engine_ttft_includes_prefill_and_itl_grows_with_the_batch() -> None:
    clock = FakeClock()
    config = EngineConfig(kv_blocks=1000, ttft_ms=10, prefill_ms_per_token=1, itl_ms=5, itl_per_seq_ms=1)
    engine, stats = Engine(config, clock), ModelStats("m")
    one = Recorder(clock)
    engine.submit(make_seq(stats, one, prompt=20, limit=4))
    clock.run_all()
    assert one.times[0] == pytest.approx(0.030)  # 10 ms + 20 tokens x 1 ms
    assert [round(b - a, 6) for a, b in itertools.pairwise(one.times)] == [
        0.006
    ] * 3  # 5 ms + 1 running x 1 ms

    a, b = Recorder(clock), Recorder(clock)
    start = clock.now
    engine.submit(make_seq(stats, a, prompt=0, limit=4))
    engine.submit(make_seq(stats, b, prompt=0, limit=4))
    clock.run_all()
    assert a.times[0] - start == pytest.approx(0.010)
    assert [round(y - x, 6) for x, y in itertools.pairwise(a.times)] == [0.007] * 3  # two running
    assert stats.generation_tokens == 12 and stats.success["length"] == 3
    assert stats.ttft.count == 3 and stats.itl.count == 9


def test_engine_queues_fifo_beyond_max_num_seqs() -> None:
    clock = FakeClock()
    engine = Engine(
        EngineConfig(kv_blocks=1000, max_num_seqs=2, ttft_ms=10, itl_ms=5, itl_per_seq_ms=0), clock
    )
    stats = ModelStats("m")
    recs = [Recorder(clock) for _ in range(3)]
    seqs = [make_seq(stats, r, prompt=8, limit=3) for r in recs]
    for seq in seqs:
        engine.submit(seq)
    assert engine.running == seqs[:2] and engine.waiting == [seqs[2]]
    assert engine.counts_by_model() == {"m": (2, 1)}
    clock.run_all()
    assert all(s.state == FINISHED for s in seqs)
    assert recs[2].times[0] >= recs[0].finished_at  # admitted only when a slot freed
    assert engine.free_blocks == engine.total_blocks and engine.kv_usage() == 0.0


def test_engine_holds_blocks_per_16_tokens_and_frees_them() -> None:
    clock = FakeClock()
    engine = Engine(EngineConfig(kv_blocks=100, ttft_ms=1, itl_ms=1, itl_per_seq_ms=0), clock)
    seq = make_seq(ModelStats("m"), Recorder(clock), prompt=31, limit=3)
    engine.submit(seq)
    assert seq.blocks == 2  # the 31 prompt tokens and the first output token
    clock.advance(0.0015)
    assert seq.generated == 1 and seq.blocks == 2
    clock.advance(0.001)
    assert seq.generated == 2 and seq.blocks == 3 and engine.kv_usage() == pytest.approx(0.03)
    clock.run_all()
    assert engine.free_blocks == 100


def test_engine_preempts_the_newest_sequence_when_blocks_run_out() -> None:
    clock = FakeClock()
    engine = Engine(EngineConfig(kv_blocks=4, ttft_ms=1, itl_ms=1, itl_per_seq_ms=0), clock)
    stats = ModelStats("m")
    first, second = Recorder(clock), Recorder(clock)
    a, b = make_seq(stats, first, prompt=16, limit=40), make_seq(stats, second, prompt=16, limit=40)
    engine.submit(a)
    engine.submit(b)
    assert engine.running == [a, b] and engine.free_blocks == 0
    clock.advance(0.0175)  # a reaches 32 tokens and needs a third block: b must go
    assert b.state == WAITING and engine.waiting == [b] and stats.preemptions == 1
    assert a.blocks == 3
    clock.run_all()
    # both complete, every token exactly once, b resuming where it stopped
    assert len(first.times) == len(second.times) == 40
    assert a.state == b.state == FINISHED and engine.free_blocks == 4
    assert second.times[-1] > first.times[-1]


def test_engine_abort_frees_a_slot_for_the_queue() -> None:
    clock = FakeClock()
    engine = Engine(EngineConfig(kv_blocks=100, max_num_seqs=1, ttft_ms=5, itl_ms=5), clock)
    stats = ModelStats("m")
    running, queued = make_seq(stats, Recorder(clock), 4, 10), make_seq(stats, Recorder(clock), 4, 10)
    engine.submit(running)
    engine.submit(queued)
    assert engine.abort(queued) and queued.state == ABORTED and engine.waiting == []
    late = make_seq(stats, Recorder(clock), 4, 10)
    engine.submit(late)
    assert engine.abort(running) and engine.running == [late]
    assert not engine.abort(running)  # already gone
    clock.run_all()
    assert late.state == FINISHED and engine.free_blocks == 100
    with pytest.raises(ValueError, match="KV cache"):
        engine.submit(make_seq(stats, Recorder(clock), 1000, 1000))


def test_fault_syntax() -> None:
    faults = parse_faults("drop_after=3; first_token_delay_ms=250 ;status=503")
    assert faults == Faults(drop_after=3, first_token_delay_ms=250.0, status=503)
    assert parse_faults(faults.to_spec()) == faults
    assert faults.merged(parse_faults("drop_after=5")).drop_after == 5
    assert faults_from_json({"refuse": 1}) == Faults(refuse=True)
    assert faults_from_json({"spec": "stall_after=2"}) == Faults(stall_after=2)
    assert not parse_faults("") and not parse_faults("none")
    for bad, message in [
        ("explode=1", "unknown fault knob"),
        ("drop_after", "key=value"),
        ("drop_after=-1", ">= 0"),
        ("status=200", "400..599"),
        ("refuse=2", "0 or 1"),
        ("first_token_delay_ms=soon", "milliseconds"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_faults(bad)


def test_word_sequences_are_stable_across_processes_and_resumable() -> None:
    seq = WordSequence("llama-8b")
    answer = seq.slice_text(0, 20)
    code = "from loadtest.podsim.words import WordSequence; print(WordSequence('llama-8b').slice_text(0, 20))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert other.stdout.rstrip("\n") == answer
    assert WordSequence("llama-8b", seed=7).slice_text(0, 20) != answer
    assert WordSequence("qwen-0.5b").slice_text(0, 20) != answer
    assert stable_seed("m", 1) == stable_seed("m", 1) != stable_seed("m", 2)
    tokens = [seq.slice_text(i, i + 1) for i in range(20)]
    assert all(t.startswith(" ") and t[1:].isascii() and " " not in t[1:] for t in tokens)
    assert seq.continuation_point("") == 0
    assert seq.continuation_point("".join(tokens[:7])) == 7
    assert seq.continuation_point("Sure! Here goes:" + "".join(tokens[:7])) == 7
    assert seq.continuation_point("".join(tokens[:7]).lstrip()) == 7  # leading space stripped
    assert seq.continuation_point("".join(tokens[1:7])) == 0  # not a prefix of S


# --- wire format ---------------------------------------------------------------------------------


def test_streaming_chat_bytes_match_vllm(sim: PodsimProcess) -> None:
    body = {**CHAT, "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
    resp = httpx.post(sim.url + "/v1/chat/completions", json=body, headers={"x-request-id": "req-42"})
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "text/event-stream; charset=utf-8"
    events = sse_events(resp.content)
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for payload, chunk in zip(events, chunks, strict=False):  # compact, vLLM's field order, no re-escaping
        assert json.dumps(chunk, separators=(",", ":"), ensure_ascii=False).encode() == payload
    samples = [json.loads(s) for s in SAMPLE_STREAM]
    role, tokens, final, usage = chunks[0], chunks[1:-2], chunks[-2], chunks[-1]
    assert shape(role) == shape(samples[0]) and role["choices"][0]["delta"] == {
        "role": "assistant",
        "content": "",
    }
    assert len(tokens) == 4 and all(shape(t) == shape(samples[1]) for t in tokens)
    assert shape(final) == shape(samples[2]) and final["choices"][0]["finish_reason"] == "length"
    assert shape(usage) == shape(samples[3])
    assert usage["usage"]["completion_tokens"] == 5
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 5
    assert {c["id"] for c in chunks} == {"chatcmpl-req-42"}
    assert {c["model"] for c in chunks} == {"llama-8b"} and len({c["created"] for c in chunks}) == 1


def test_usage_chunk_only_when_asked_for(sim: PodsimProcess) -> None:
    resp = httpx.post(sim.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 3, "stream": True})
    chunks = [json.loads(e) for e in sse_events(resp.content)[:-1]]
    assert all(c["choices"] for c in chunks) and "usage" not in chunks[-1]


def test_streaming_completions_format(sim: PodsimProcess) -> None:
    body = {"model": "qwen-0.5b", "prompt": "Once upon a time", "max_tokens": 4, "stream": True}
    resp = httpx.post(sim.url + "/v1/completions", json={**body, "stream_options": {"include_usage": True}})
    events = sse_events(resp.content)
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    choice_keys = [
        "index",
        "text",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "prompt_token_ids",
        "token_ids",
    ]
    for chunk in chunks[:-1]:
        assert list(chunk) == ["id", "object", "created", "model", "choices"]
        assert chunk["object"] == "text_completion" and chunk["id"].startswith("cmpl-")
        assert list(chunk["choices"][0]) == choice_keys
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, None, "length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


def test_non_streaming_bodies(sim: PodsimProcess) -> None:
    chat = httpx.post(sim.url + "/v1/chat/completions", json=CHAT)
    assert chat.headers["content-type"] == "application/json"
    data = chat.json()
    assert list(data)[:6] == ["id", "object", "created", "model", "choices", "service_tier"]
    assert data["object"] == "chat.completion" and data["choices"][0]["finish_reason"] == "length"
    assert data["choices"][0]["message"]["role"] == "assistant"
    assert list(data["usage"])[:3] == ["prompt_tokens", "total_tokens", "completion_tokens"]
    assert len(data["choices"][0]["message"]["content"].split()) == 12

    client = openai.OpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0)
    completion = client.completions.create(model="qwen-0.5b", prompt="Hello", max_tokens=5)
    assert completion.object == "text_completion" and completion.usage.completion_tokens == 5
    assert completion.choices[0].finish_reason == "length" and len(completion.choices[0].text.split()) == 5
    streamed = client.chat.completions.create(**CHAT, stream=True)
    assert (
        "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        == data["choices"][0]["message"]["content"]
    )


def test_answers_are_deterministic_per_model_and_seed(sim: PodsimProcess) -> None:
    first = chat_text(sim.url)
    assert chat_text(sim.url) == first
    assert chat_text(sim.url, messages=[{"role": "user", "content": "something else"}]) == first
    assert chat_text(sim.url, seed=3) == chat_text(sim.url, seed=3) != first
    assert chat_text(sim.url, model="qwen-0.5b") != first


def test_continue_final_message_returns_the_rest_of_the_same_answer(sim: PodsimProcess) -> None:
    full = chat_text(sim.url, max_tokens=12)
    tokens = re.findall(r" \S+", full)
    assert "".join(tokens) == full and len(tokens) == 12
    resume = {
        "messages": [*CHAT["messages"], {"role": "assistant", "content": "".join(tokens[:5])}],
        "continue_final_message": True,
        "add_generation_prompt": False,
        "max_tokens": 7,
    }
    assert chat_text(sim.url, **resume) == "".join(tokens[5:])
    client = openai.OpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model="llama-8b",
        messages=resume["messages"],
        max_tokens=7,
        stream=True,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "".join(tokens[5:])

    both = {**CHAT, **resume, "add_generation_prompt": True}
    defaulted = {k: v for k, v in both.items() if k != "add_generation_prompt"}  # vLLM's default is true
    for body, message in [(both, "Cannot set both"), (defaulted, "not compatible")]:
        resp = httpx.post(sim.url + "/v1/chat/completions", json=body)
        assert resp.status_code == 400 and message in resp.json()["error"]["message"]


def test_completion_of_prompt_plus_text_so_far_continues_the_answer(sim: PodsimProcess) -> None:
    def complete(prompt: str, max_tokens: int) -> str:
        body = {"model": "qwen-0.5b", "prompt": prompt, "max_tokens": max_tokens}
        return httpx.post(sim.url + "/v1/completions", json=body).json()["choices"][0]["text"]

    full = complete("Tell me a story.", 10)
    tokens = re.findall(r" \S+", full)
    assert complete("Tell me a story." + "".join(tokens[:4]), 6) == "".join(tokens[4:])


# --- control plane -------------------------------------------------------------------------------


def test_models_health_load_version_identity(sim: PodsimProcess) -> None:
    models = httpx.get(sim.url + "/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["llama-8b", "qwen-0.5b", "abortable"]
    card = models["data"][0]
    assert list(card) == [
        "id",
        "object",
        "created",
        "owned_by",
        "root",
        "parent",
        "max_model_len",
        "permission",
    ]
    assert card["object"] == "model" and card["owned_by"] == "vllm" and card["parent"] is None
    assert card["permission"][0]["object"] == "model_permission"
    health = httpx.get(sim.url + "/health")
    assert health.status_code == 200 and health.content == b""
    assert httpx.get(sim.url + "/ping").status_code == 200
    assert httpx.get(sim.url + "/load").json() == {"server_load": 0}
    assert "version" in httpx.get(sim.url + "/version").json()
    identity = httpx.get(sim.url + "/podsim/identity").json()
    assert (
        identity["gpu_uuid"] == GPU and identity["mig_uuid"] == MIG and identity["mig_profile"] == "1g.10gb"
    )
    assert identity["kv_blocks"] == 2560 and identity["block_size"] == 16 and identity["pid"] == sim.pid
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", sim.url) and sim.port > 0


def test_metrics_have_vllm_names_types_and_labels(sim: PodsimProcess) -> None:
    httpx.post(sim.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 3})
    resp = httpx.get(sim.url + "/metrics")
    assert resp.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(resp.text)}
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:num_preemptions": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "podsim:aborts": "counter",
    }
    for name, kind in expected.items():
        assert families[name].type == kind, name
        for sample in families[name].samples:
            assert sample.labels["engine"] == "0" and sample.labels["model_name"] in {
                "llama-8b",
                "qwen-0.5b",
                "abortable",
            }
    assert "vllm:num_preemptions_total" in resp.text and "_created" not in resp.text
    assert (
        metric_value(sim.url, "vllm:request_success", "vllm:request_success_total", finished_reason="length")
        >= 1
    )
    ttft_count = metric_value(
        sim.url,
        "vllm:time_to_first_token_seconds",
        "vllm:time_to_first_token_seconds_count",
        model_name="llama-8b",
    )
    assert ttft_count >= 1
    assert "podsim:info" in families and "process_cpu_seconds" in families


# --- errors --------------------------------------------------------------------------------------


def test_unknown_model_is_vllms_404(sim: PodsimProcess) -> None:
    resp = httpx.post(sim.url + "/v1/chat/completions", json={**CHAT, "model": "gpt-9"})
    assert resp.status_code == 404
    assert resp.json() == {
        "error": {
            "message": "The model `gpt-9` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    client = openai.OpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x")


@pytest.mark.parametrize(
    ("path", "content", "needle"),
    [
        ("/v1/chat/completions", b"{not json", "JSON decode error"),
        ("/v1/chat/completions", b"", "JSON decode error"),
        ("/v1/chat/completions", b"[1, 2]", "valid dictionary"),
        ("/v1/chat/completions", b'{"model": "llama-8b"}', "Field required"),
        ("/v1/chat/completions", json.dumps({**CHAT, "stream": "yes"}).encode(), "valid boolean"),
        ("/v1/chat/completions", json.dumps({**CHAT, "max_tokens": 0}).encode(), "at least 1"),
        (
            "/v1/chat/completions",
            json.dumps({**CHAT, "max_tokens": 10**6}).encode(),
            "maximum context length",
        ),
        ("/v1/chat/completions", json.dumps({**CHAT, "stream_options": {}}).encode(), ""),
        (
            "/v1/chat/completions",
            json.dumps({**CHAT, "stream_options": {"include_usage": True}}).encode(),
            "stream",
        ),
        ("/v1/completions", b'{"model": "llama-8b"}', "prompt"),
    ],
)
def test_malformed_requests_are_400(sim: PodsimProcess, path: str, content: bytes, needle: str) -> None:
    resp = httpx.post(sim.url + path, content=content, headers={"content-type": "application/json"})
    if content.endswith(b'"stream_options": {}}'):  # an empty dict is falsy to vLLM too: accepted
        assert resp.status_code == 200
        return
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400 and needle in error["message"]


def test_unknown_route_and_method_answer_like_fastapi(sim: PodsimProcess) -> None:
    missing = httpx.get(sim.url + "/v2/nothing")
    assert missing.status_code == 404 and missing.json() == {"detail": "Not Found"}
    wrong = httpx.get(sim.url + "/v1/chat/completions")
    assert wrong.status_code == 405 and wrong.json() == {"detail": "Method Not Allowed"}


# --- faults --------------------------------------------------------------------------------------


def _faulty(sim: PodsimProcess, fault: str, **body: Any) -> httpx.Response:
    return httpx.post(
        sim.url + "/v1/chat/completions",
        json={**CHAT, "stream": True, **body},
        headers={"x-podsim-fault": fault},
    )


def test_status_faults(sim: PodsimProcess) -> None:
    resp = _faulty(sim, "status=500")
    assert resp.status_code == 500
    assert resp.json() == {
        "error": {
            "message": "Internal server error",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }
    busy = _faulty(sim, "status=503")
    assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
    assert busy.json()["error"]["code"] == 503
    bad = _faulty(sim, "status=99")
    assert bad.status_code == 400 and "x-podsim-fault" in bad.json()["error"]["message"]


def test_refuse_resets_the_connection(sim: PodsimProcess) -> None:
    with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
        _faulty(sim, "refuse=1")


def test_drop_after_aborts_mid_stream(sim: PodsimProcess) -> None:
    received = b""
    with (
        pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"),
        httpx.stream(
            "POST",
            sim.url + "/v1/chat/completions",
            json={**CHAT, "stream": True},
            headers={"x-podsim-fault": "drop_after=3"},
        ) as resp,
    ):
        for data in resp.iter_bytes():
            received += data
    assert b"[DONE]" not in received
    assert len(tokens_of(sse_events(received))) == 3


def test_malformed_after_sends_one_bad_event_then_carries_on(sim: PodsimProcess) -> None:
    events = sse_events(_faulty(sim, "malformed_after=2").content)
    assert events.count(b'{"id":') == 1 and events[-1] == b"[DONE]"
    bad = events.index(b'{"id":')
    assert len(tokens_of(events[:bad])) == 2 and len(tokens_of(events)) == 12


def test_error_after_sends_vllms_midstream_error_then_done(sim: PodsimProcess) -> None:
    resp = _faulty(sim, "error_after=2")
    assert resp.status_code == 200
    assert resp.content.endswith(SAMPLE_MIDSTREAM_ERROR + b"\n\ndata: [DONE]\n\n")
    assert len(tokens_of(sse_events(resp.content))) == 2
    plain = httpx.post(
        sim.url + "/v1/chat/completions", json=CHAT, headers={"x-podsim-fault": "error_after=2"}
    )
    assert plain.status_code == 500 and plain.json()["error"]["type"] == "InternalServerError"


def test_first_token_delay(sim: PodsimProcess) -> None:
    with httpx.Client(timeout=10) as client:
        started = time.monotonic()
        with client.stream(
            "POST",
            sim.url + "/v1/chat/completions",
            json={**CHAT, "stream": True},
            headers={"x-podsim-fault": "first_token_delay_ms=2000"},
        ) as resp:
            headers_at = time.monotonic() - started
            first = next(resp.iter_bytes())
            first_at = time.monotonic() - started
    assert headers_at < 1.5 <= 2.0 <= first_at  # headers at once, like uvicorn; the token later
    assert b'"role":"assistant"' in first


async def test_stall_after_goes_silent_and_the_abandoned_request_counts_as_an_abort(
    sim: PodsimProcess,
) -> None:
    aborts = metric_value(sim.url, "podsim:aborts", "podsim:aborts_total", model_name="abortable")
    body = {**CHAT, "model": "abortable", "stream": True}
    received = b""
    async with httpx.AsyncClient(timeout=httpx.Timeout(5.0, read=0.3)) as client:
        with pytest.raises(httpx.ReadTimeout):
            async with client.stream(
                "POST",
                sim.url + "/v1/chat/completions",
                json=body,
                headers={"x-podsim-fault": "stall_after=2"},
            ) as resp:
                async for data in resp.aiter_bytes():
                    received += data
    assert len(tokens_of(sse_events(received))) == 2 and b"[DONE]" not in received
    await eventually(
        lambda: (
            metric_value(sim.url, "podsim:aborts", "podsim:aborts_total", model_name="abortable")
            == aborts + 1
        )
    )


def test_process_faults_via_admin_api_spare_admin_and_metrics(sim: PodsimProcess) -> None:
    try:
        set_resp = httpx.post(sim.url + "/admin/faults", json={"status": 503, "first_token_delay_ms": 1})
        assert set_resp.status_code == 200
        assert httpx.get(sim.url + "/admin/faults").json() == {"first_token_delay_ms": 1.0, "status": 503}
        assert httpx.post(sim.url + "/v1/chat/completions", json=CHAT).status_code == 503
        assert httpx.get(sim.url + "/metrics").status_code == 200
        assert httpx.get(sim.url + "/v1/models").status_code == 200
        # a request's header overrides the process faults knob by knob
        assert _faulty(sim, "status=429").status_code == 429
        assert httpx.post(sim.url + "/admin/faults", json={"explode": 1}).status_code == 400
    finally:
        assert httpx.delete(sim.url + "/admin/faults").json() == {}
    assert httpx.post(sim.url + "/v1/chat/completions", json=CHAT).status_code == 200


def _events_any(body: bytes) -> list[bytes]:
    """Blank-line separated events, whatever their framing (fault shapes break vLLM's)."""
    return [e for e in body.split(b"\n\n") if e]


def _finished(body: bytes) -> bool:
    return re.search(rb'"finish_reason":"', body) is not None


@pytest.mark.parametrize(
    ("fault", "tokens", "last"),
    [
        ("end_after=2", 2, None),
        ("garbage_after=2", 2, b"<html><body><h1>502 Bad Gateway</h1></body></html>"),
        ("bad_utf8_after=2", 3, b"\xff\xfe"),
        ("no_finish=1", 12, None),
    ],
)
def test_clean_end_knobs_end_the_chunked_body_short_of_the_answer(
    sim: PodsimProcess, fault: str, tokens: int, last: bytes | None
) -> None:
    resp = _faulty(sim, fault)  # the chunked body ends well: httpx raises nothing
    assert resp.status_code == 200
    body = resp.content
    assert b"[DONE]" not in body and not _finished(body)
    events = _events_any(body)
    if last is not None:
        assert last in events[-1]
    content = [e for e in events if b'"content":"' in e and b'"content":""' not in e]
    assert len(content) == tokens
    if fault == "bad_utf8_after=2":
        with pytest.raises(UnicodeDecodeError):
            events[-1].decode()
    metric = metric_value(sim.url, "podsim:faults_injected", "podsim:faults_injected_total")
    assert metric >= 1


def test_close_after_ends_with_a_fin_and_no_terminating_chunk(sim: PodsimProcess) -> None:
    received = b""
    with (
        pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"),
        httpx.stream(
            "POST", sim.url + "/v1/chat/completions", json={**CHAT, "stream": True},
            headers={"x-podsim-fault": "close_after=3"},
        ) as resp,
    ):  # fmt: skip
        for data in resp.iter_bytes():
            received += data
    assert b"[DONE]" not in received and len(tokens_of(sse_events(received))) == 3


def test_huge_event_after_sends_one_multi_megabyte_event_then_carries_on(sim: PodsimProcess) -> None:
    body = _faulty(sim, "huge_event_after=1").content
    events = sse_events(body)
    sizes = sorted(len(e) for e in events)
    assert sizes[-1] > 4 * 1024 * 1024 > sizes[-2]
    assert events[-1] == b"[DONE]" and len(tokens_of(events)) == 13  # the huge one is a token too


@pytest.mark.parametrize("fault", ["endless_line_after=2", "keepalive_after=2"])
async def test_open_ended_knobs_send_forever_until_the_client_leaves(sim: PodsimProcess, fault: str) -> None:
    def aborts() -> float:
        return metric_value(sim.url, "podsim:aborts", "podsim:aborts_total", model_name="abortable")

    before = aborts()
    received = bytearray()
    async with (
        httpx.AsyncClient(timeout=5) as client,
        client.stream(
            "POST", sim.url + "/v1/chat/completions", json={**CHAT, "model": "abortable", "stream": True},
            headers={"x-podsim-fault": fault},
        ) as resp,
    ):  # fmt: skip
        async for data in resp.aiter_bytes():
            received += data
            if len(received) > 3 * 1024 * 1024 or received.count(b": keep-alive\n\n") >= 3:
                break
    head, _, rest = bytes(received).partition(b'data: {"id":"A' if "endless" in fault else b": keep-alive")
    assert len(tokens_of(sse_events(head))) == 2 and b"[DONE]" not in received
    if "endless" in fault:
        assert len(rest) > 2 * 1024 * 1024 and b"\n" not in rest  # megabytes, never a newline
    else:
        assert set(_events_any(b": keep-alive" + rest)) == {b": keep-alive"}
    await eventually(lambda: aborts() == before + 1)  # the pod saw the client go


@pytest.mark.parametrize("fault", ["end_after=2", "garbage_after=2", "bad_utf8_after=2"])
def test_clean_end_knobs_make_a_whole_answer_that_is_not_json(sim: PodsimProcess, fault: str) -> None:
    resp = httpx.post(sim.url + "/v1/chat/completions", json=CHAT, headers={"x-podsim-fault": fault})
    assert resp.status_code == 200 and int(resp.headers["content-length"]) == len(resp.content)
    with pytest.raises(ValueError):
        json.loads(resp.content)
    stream_only = httpx.post(
        sim.url + "/v1/chat/completions", json=CHAT, headers={"x-podsim-fault": "keepalive_after=2"}
    )
    assert stream_only.status_code == 200 and stream_only.json()["choices"][0]["finish_reason"] == "length"


def test_truncation_knobs_parse() -> None:
    faults = parse_faults("end_after=2;no_finish=1;endless_line_after=0")
    assert faults == Faults(end_after=2, no_finish=True, endless_line_after=0)
    assert faults.any_stream_fault() and parse_faults(faults.to_spec()) == faults
    for bad in ("no_finish=2", "garbage_after=-1", "huge_event_after=x"):
        with pytest.raises(ValueError):
            parse_faults(bad)


def test_kv_usage_and_waiting_change_at_runtime_via_admin_faults(sim: PodsimProcess) -> None:
    def gauge(name: str) -> float:
        return metric_value(sim.url, name, name, model_name="llama-8b")

    try:
        full = httpx.post(sim.url + "/admin/faults", json={"kv_usage": 0.97, "waiting": 40})
        assert full.status_code == 200
        assert gauge("vllm:kv_cache_usage_perc") == 0.97
        assert gauge("vllm:num_requests_waiting") == 40
    finally:
        httpx.delete(sim.url + "/admin/faults")
    assert gauge("vllm:kv_cache_usage_perc") < 0.5


def test_arrivals_log_each_generation_request_on_the_machine_wide_clock(sim: PodsimProcess) -> None:
    before = time.monotonic()
    for rid in ("arrive-1", "arrive-2"):
        resp = httpx.post(sim.url + "/v1/chat/completions", json=CHAT, headers={"X-Request-Id": rid})
        assert resp.status_code == 200
    after = time.monotonic()
    httpx.get(sim.url + "/v1/models")  # not a generation request: not logged
    arrivals = httpx.get(sim.url + "/podsim/arrivals", params={"since": before}).json()["arrivals"]
    assert [a["id"] for a in arrivals] == ["arrive-1", "arrive-2"]
    assert before <= arrivals[0]["at"] <= arrivals[1]["at"] <= after
    assert httpx.get(sim.url + "/podsim/arrivals", params={"since": after}).json() == {"arrivals": []}
    assert httpx.get(sim.url + "/podsim/arrivals", params={"since": "soon"}).status_code == 400


# --- aborts and the queue ------------------------------------------------------------------------


async def _disconnect_after(url: str, body: dict[str, Any], headers: dict[str, str], tokens: int) -> None:
    """Open a stream, read ``tokens`` content tokens (0: only the headers), then hang up."""
    async with (
        httpx.AsyncClient(timeout=10) as client,
        client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as resp,
    ):
        assert resp.status_code == 200
        seen = b""
        if tokens:
            async for data in resp.aiter_bytes():
                seen += data
                if seen.count(b'"delta":{"content":"') >= tokens:
                    break


async def test_client_disconnects_mid_stream_and_before_the_first_token_are_aborts(
    sim: PodsimProcess,
) -> None:
    def aborts() -> float:
        return metric_value(sim.url, "podsim:aborts", "podsim:aborts_total", model_name="abortable")

    def running() -> float:
        return metric_value(
            sim.url, "vllm:num_requests_running", "vllm:num_requests_running", model_name="abortable"
        )

    before = aborts()
    long_answer = {**CHAT, "model": "abortable", "stream": True, "max_tokens": 5000}
    await _disconnect_after(sim.url, long_answer, {}, tokens=3)
    await eventually(lambda: aborts() == before + 1 and running() == 0)
    await _disconnect_after(sim.url, long_answer, {"x-podsim-fault": "first_token_delay_ms=10000"}, tokens=0)
    await eventually(lambda: aborts() == before + 2 and running() == 0)


async def test_requests_beyond_max_num_seqs_wait_in_the_queue(tight: PodsimProcess) -> None:
    def gauges() -> tuple[float, float]:
        return (
            metric_value(tight.url, "vllm:num_requests_running", "vllm:num_requests_running"),
            metric_value(tight.url, "vllm:num_requests_waiting", "vllm:num_requests_waiting"),
        )

    async def one(client: httpx.AsyncClient) -> list[str]:
        body = {**CHAT, "stream": True, "max_tokens": 40}
        resp = await client.post(tight.url + "/v1/chat/completions", json=body)
        return tokens_of(sse_events(resp.content))

    async with httpx.AsyncClient(timeout=30) as client:
        tasks = [asyncio.create_task(one(client)) for _ in range(4)]
        await eventually(lambda: gauges() == (2, 2))
        assert (await client.get(tight.url + "/load")).json() == {"server_load": 4}
        # a client that gives up while queued is an abort, and leaves the queue
        aborts = metric_value(tight.url, "podsim:aborts", "podsim:aborts_total")
        await _disconnect_after(tight.url, {**CHAT, "stream": True}, {}, tokens=0)
        await eventually(
            lambda: metric_value(tight.url, "podsim:aborts", "podsim:aborts_total") == aborts + 1
        )
        results = await asyncio.gather(*tasks)
    reference = "".join(tokens_of(sse_events(_faulty(tight, "").content)))  # any free slot now
    assert all(len(r) == 40 for r in results) and len({"".join(r) for r in results}) == 1
    assert "".join(results[0]).startswith(reference)
    assert gauges() == (0, 0)


async def test_preempted_streams_resume_without_losing_or_repeating_tokens(tight: PodsimProcess) -> None:
    preemptions = metric_value(tight.url, "vllm:num_preemptions", "vllm:num_preemptions_total")
    body = {**CHAT, "stream": True, "max_tokens": 100}  # 2 x (7 + 100) tokens > 8 blocks of 16
    async with httpx.AsyncClient(timeout=30) as client:
        answers = await asyncio.gather(
            *(client.post(tight.url + "/v1/chat/completions", json=body) for _ in range(2))
        )
    texts = ["".join(tokens_of(sse_events(a.content))) for a in answers]
    assert texts[0] == texts[1] and len(texts[0].split()) == 100
    assert metric_value(tight.url, "vllm:num_preemptions", "vllm:num_preemptions_total") > preemptions


# --- command line ---------------------------------------------------------------------------------


def test_bad_flags_fail_clearly() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest.podsim", "--ttft-ms", "-1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2 and "argument --ttft-ms" in proc.stderr
    with pytest.raises(PodsimStartError, match="--mig-profile"):
        PodsimProcess(["--mig-profile", "huge"]).start()


def test_process_flags_faults_and_answer_length() -> None:
    flags = [
        "--fault",
        "unhealthy=1",
        "--fault",
        "drop_after=90;stall_after=40",
        "--answer-tokens",
        "5",
        *FAST,
    ]
    with PodsimProcess(flags) as pod:
        assert httpx.get(pod.url + "/admin/faults").json() == {
            "drop_after": 90,
            "stall_after": 40,
            "unhealthy": 1,
        }
        assert httpx.get(pod.url + "/health").status_code == 503
        assert httpx.get(pod.url + "/health", headers={"x-podsim-fault": "unhealthy=0"}).status_code == 200
        # the answer ends after 5 tokens: EOS (empty text, counted) and finish_reason "stop"
        whole = httpx.post(pod.url + "/v1/chat/completions", json=CHAT).json()
        assert whole["choices"][0]["finish_reason"] == "stop" and whole["usage"]["completion_tokens"] == 6
        words = re.findall(r" \S+", whole["choices"][0]["message"]["content"])
        assert len(words) == 5
        resume = {
            **CHAT,
            "messages": [*CHAT["messages"], {"role": "assistant", "content": "".join(words[:3])}],
            "continue_final_message": True,
            "add_generation_prompt": False,
            "stream": True,
        }
        chunks = [
            json.loads(e)
            for e in sse_events(httpx.post(pod.url + "/v1/chat/completions", json=resume).content)[:-1]
        ]
        assert "".join(tokens_of([json.dumps(c).encode() for c in chunks])) == "".join(words[3:])
        assert chunks[-1]["choices"][0]["delta"] == {"content": ""}
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        assert (
            httpx.post(pod.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 3}).json()["choices"][0][
                "finish_reason"
            ]
            == "length"
        )
