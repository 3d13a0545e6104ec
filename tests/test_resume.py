"""Mid-stream resume: a broken stream continues on another pod and reads as one uninterrupted answer."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from gateway import resume
from gateway.resume import SentLog
from gateway.usage import UsageTap
from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from tests.exchanges import exchange

FAST = ["--model", "llama-8b", "--ttft-ms", "5", "--itl-ms", "2"]
CHAT = {
    "model": "llama-8b",
    "messages": [{"role": "user", "content": "Tell me about sluice gates."}],
    "max_tokens": 12,
    "stream": True,
    "stream_options": {"include_usage": True},
}


@dataclass
class Setup:
    good: PodsimProcess
    bad: PodsimProcess
    url: str
    admin_url: str


def resume_config(good: PodsimProcess, bad: PodsimProcess, **sections: Any) -> dict[str, Any]:
    """Two pods of llama-8b (``bad`` is the one given faults), a short stall timeout and resume on;
    ``sections`` replace (``server``) or add to the config's top-level sections."""
    return {
        "server": {"host": "127.0.0.1"},
        "timeouts": {"stall_s": 0.3},
        "resume": {"models": ["*"], "max_per_request": 2},
        "pods": [
            {"name": "good", "url": good.url, "models": ["llama-8b"]},
            {"name": "bad", "url": bad.url, "models": ["llama-8b"]},
        ],
        **sections,
    }


@contextmanager
def resume_setup() -> Iterator[Setup]:
    """Fresh pods and a gateway of ``resume_config`` in front of them."""
    with PodsimProcess(FAST) as good, PodsimProcess(FAST) as bad, \
            GatewayProcess(resume_config(good, bad)) as gw:  # fmt: skip
        yield Setup(good, bad, gw.url, gw.admin_url)


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    with resume_setup() as fresh:
        yield fresh


@pytest.fixture(autouse=True)
def _clear(setup: Setup) -> Iterator[None]:
    yield
    httpx.delete(setup.bad.url + "/admin/faults")


def _events(body: bytes) -> list[dict | str]:
    out: list[dict | str] = []
    for raw in body.split(b"\n\n"):
        if raw.startswith(b"data: "):
            data = raw[6:]
            out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


def _text(events: list) -> str:
    return "".join(
        (c.get("delta") or {}).get("content") or c.get("text") or ""
        for e in events
        if isinstance(e, dict)
        for c in e.get("choices", [])
    )


def _resumes(admin_url: str) -> float:
    text = httpx.get(admin_url + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith('sluicegate_stream_resumes_total{outcome="ok"}')
    )


@pytest.mark.parametrize("fault", [{"drop_after": 5}, {"stall_after": 5}, {"error_after": 5}])
def test_a_broken_stream_reads_as_one_uninterrupted_answer(fault: dict) -> None:
    # fresh pods and gateway: the module's bad pod, broken by the faults before, may be out of the
    # outlier breaker's rotation for a while, and then no stream would start on it
    with resume_setup() as setup:
        expected = _events(httpx.post(setup.good.url + "/v1/chat/completions", json=CHAT).content)
        httpx.post(setup.bad.url + "/admin/faults", json=fault).raise_for_status()
        started_on = []
        for _ in range(4):  # ties rotate between the pods, so some of these start on the bad one
            resp = httpx.post(setup.url + "/v1/chat/completions", json=CHAT, timeout=30)
            started_on.append(resp.headers["x-sluicegate-pod"])
            events = _events(resp.content)
            assert events[-1] == "[DONE]"
            assert not any("error" in e for e in events if isinstance(e, dict))
            assert _text(events) == _text(expected)
            chunks = [e for e in events if isinstance(e, dict)]
            assert len({e["id"] for e in chunks}) == 1 and len({e["created"] for e in chunks}) == 1
            roles = [c for e in chunks for c in e["choices"] if "role" in (c.get("delta") or {})]
            assert len(roles) == 1
            # the client's usage is for what it asked and got: its own prompt (not the continuation's,
            # which held the text so far), every token it received; as if one pod had answered
            assert chunks[-1]["usage"] == expected[-2]["usage"]
            assert chunks[-1]["usage"]["completion_tokens"] == 12
        assert "bad" in started_on, started_on
        assert _resumes(setup.admin_url) >= started_on.count("bad")


def test_resume_gives_up_cleanly_when_no_pod_can_continue(setup: Setup) -> None:
    resp = httpx.post(
        setup.url + "/v1/chat/completions", json=CHAT, headers={"x-podsim-fault": "drop_after=3"}, timeout=30
    )
    events = _events(resp.content)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["type"] == "upstream_error" and "No other pod could continue" in error["message"]
    assert len(_text(events).split()) == 6  # 3 tokens from each pod, then nothing left to try


def test_streams_that_cannot_be_resumed_end_with_a_clear_error(setup: Setup) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    # the fault rides on the request, so each one breaks whichever pod the picker chose (a pod-wide
    # fault on "bad" met none of four requests when earlier breaks had made the picker avoid it)
    for _ in range(4):
        resp = httpx.post(
            setup.url + "/v1/chat/completions", json={**CHAT, "tools": tools},
            headers={"x-podsim-fault": "drop_after=3"}, timeout=30,
        )
        events = _events(resp.content)
        assert events[-1] == "[DONE]" and len(_text(events).split()) == 3  # no other pod was asked
        assert "cannot be resumed on another pod (tool calls)" in events[-2]["error"]["message"]


def _sent(stream: bytes, log: SentLog) -> SentLog:
    """``stream`` appended to ``log`` in reads of every awkward size (one straddling a block
    boundary, empty ones, one huge one)."""
    rng = random.Random(7)
    at = 0
    while at < len(stream):
        size = rng.choice((0, 1, 17, 230, 4095, 4096, 9000))
        log.append(stream[at : at + size])
        at += size
    return log


_EVENT = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":"tok\\u00e9 "},"finish_reason":null}]}\n\n'
)


@pytest.mark.parametrize("budget", ["room", "spent"])
def test_sent_log_gives_back_every_byte_across_blocks(budget: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The resume log keeps full blocks as they are while the process's raw budget lasts and
    deflated past it; read back, it is exactly what was sent, however the reads fell."""
    stream = _EVENT * 300 + b"data: [DONE]\n\n"
    monkeypatch.setattr(resume.RAW_BUDGET, "free", 1 << 20 if budget == "room" else 100)
    log = _sent(stream, SentLog())
    assert log.getvalue() == stream
    assert len(log._blocks) > 5
    if budget == "room":
        assert not any(isinstance(block, resume._Deflated) for block in log._blocks)
    else:
        assert sum(map(len, log._blocks)) < len(stream) // 12  # it did compress, its first bytes preset
    assert SentLog().getvalue() == b""


def test_the_raw_budget_is_given_back_when_a_log_goes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A log that held blocks raw gives their bytes back to the process's budget when it is freed,
    so later streams keep theirs raw too; once the budget is spent, new blocks are deflated."""
    def one_event_a_read(events: int) -> SentLog:
        log = SentLog()
        for _ in range(events):
            log.append(_EVENT)
        return log

    monkeypatch.setattr(resume.RAW_BUDGET, "free", 3 * SentLog.BLOCK)  # two blocks' room, not three
    first = one_event_a_read(100)
    taken = 3 * SentLog.BLOCK - resume.RAW_BUDGET.free
    assert taken > 0 and any(isinstance(b, resume._Deflated) for b in first._blocks)  # spent: deflated
    second = one_event_a_read(100)
    assert all(isinstance(b, resume._Deflated) for b in second._blocks)
    del first
    assert resume.RAW_BUDGET.free == 3 * SentLog.BLOCK  # given back (second held none)
    third = one_event_a_read(30)
    assert not isinstance(third._blocks[0], resume._Deflated)
    assert second.getvalue() == _EVENT * 100


@pytest.mark.parametrize("seed", range(20))
def test_the_recorded_splice_passes_whole_events_and_stops_at_a_pod_error(seed: int) -> None:
    """However the pod's reads fall, the client gets whole events only, in order, each once; what
    it got is what the log reads back; at vLLM's mid-stream error event the events before it are
    passed on, nothing from it on, and the splice is told once."""
    rng = random.Random(seed)
    events = [_EVENT] * rng.randrange(1, 40)
    error = b'data: {"error": {"object": "error", "message": "engine died", "code": 500}}\n\n'
    broken = seed % 2 == 1
    stream = b"".join(events) + (error + _EVENT if broken else b"data: [DONE]\n\n")
    cuts = sorted(rng.sample(range(1, len(stream)), min(len(stream) - 1, rng.randrange(0, 30))))
    reads = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]

    recorder = resume.Recorder()
    written: list[bytes] = []
    breaks: list[None] = []
    sink = recorder.sink(written.append, lambda: breaks.append(None))
    for read in reads:
        sink(read)
    assert all(part.endswith(b"\n\n") for part in written)  # never a partial event
    assert b"".join(written) == (b"".join(events) if broken else stream)
    assert recorder.sent == b"".join(written)
    assert len(breaks) == (1 if broken else 0)


@pytest.mark.parametrize("seed", range(12))
def test_a_recorded_stream_under_a_quota_loses_only_the_usage_it_was_not_asked_for(seed: int) -> None:
    """A resumable stream under a quota, as the relay chains it (recorder, then usage tap): a token
    a read or reads cut anywhere, the client gets every event in order, less the usage event when
    the gateway asked for it on the client's behalf; the tap has the pod's usage either way, and the
    log reads back everything the pod sent before ``[DONE]``."""
    rng = random.Random(seed)
    events = [_EVENT] * rng.randrange(1, 40)
    usage = b'data: {"id":"chatcmpl-1","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3}}\n\n'
    done = b"data: [DONE]\n\n"
    stream = b"".join(events) + usage + done
    if seed % 3 == 0:  # a paced pod: one event a read, the way nearly every token goes
        reads = [*events, usage, done]
    else:
        cuts = sorted(rng.sample(range(1, len(stream)), min(len(stream) - 1, rng.randrange(1, 30))))
        reads = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    strip = seed % 2 == 0
    tap = UsageTap(exchange(usage_injected=strip, admission=object()))

    recorder = resume.Recorder()
    written: list[bytes] = []
    sink = recorder.sink(written.append, None, tap)
    for read in reads:
        sink(read)
    assert all(part.endswith(b"\n\n") for part in written)
    assert b"".join(written) == (b"".join(events) + done if strip else stream)
    assert tap.usage == {"prompt_tokens": 7, "completion_tokens": 3}
    assert recorder.sent == stream
