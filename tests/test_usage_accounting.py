"""Usage accounting for token quotas: the gateway asks pods for usage the client did not ask for,
strips it so the client's bytes are vLLM's without the option, records what the pods did, and
counts the events a client got (its charge when it leaves early)."""

from __future__ import annotations

import itertools
import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import h2.connection
import h2.events
import httpx
import pytest

from gateway.admit import InferenceRequest, encode_body
from gateway.degrade import as_sse
from gateway.resume import Splicer, token_count, tokenize_body
from gateway.usage import UsageTap, ask_for_usage, tokens_of, wants_usage
from loadtest.podsim import wire
from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from tests.conftest import counter_totals, pod_state, wait_for
from tests.exchanges import exchange
from tests.test_resume import resume_config

# -- asking for usage ------------------------------------------------------------------------------


def _request(payload: dict[str, Any]) -> InferenceRequest:
    return InferenceRequest("chat", "m", bool(payload.get("stream")), encode_body(payload), payload)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def test_a_streaming_request_that_did_not_ask_is_asked_and_marked_for_stripping() -> None:
    req, strip = ask_for_usage(_request(CHAT))
    assert strip is True
    assert json.loads(req.body) == {**CHAT, "stream_options": {"include_usage": True}}
    assert req.payload == json.loads(req.body)  # a continuation built from the payload asks too
    assert wants_usage(req.payload)


@pytest.mark.parametrize(
    "body",
    [
        json.dumps(CHAT, indent=2).encode(),  # as a person types it
        json.dumps({**CHAT, "messages": [{"role": "user", "content": "café ☕"}]}, ensure_ascii=False)
        .encode(),
        b"  " + json.dumps(CHAT).encode(),  # leading whitespace: encoded again instead
        json.dumps(CHAT).encode("utf-16"),  # JSON in UTF-16 (json.loads reads it): encoded again
    ],
)
def test_the_usage_request_reads_as_the_clients_body_plus_the_option(body: bytes) -> None:
    payload = json.loads(body)
    req, strip = ask_for_usage(InferenceRequest("chat", "m", True, body, payload))
    assert strip is True
    assert json.loads(req.body) == {**payload, "stream_options": {"include_usage": True}} == req.payload


def test_other_stream_options_stay_and_continuous_usage_goes() -> None:
    # continuous_usage_stats means nothing without include_usage; with it, every chunk would grow usage
    asked = {**CHAT, "stream_options": {"include_usage": False, "continuous_usage_stats": True, "x": 1}}
    req, strip = ask_for_usage(_request(asked))
    assert strip is True
    assert json.loads(req.body)["stream_options"] == {"include_usage": True, "x": 1}


@pytest.mark.parametrize(
    "payload",
    [
        {**CHAT, "stream_options": {"include_usage": True}},  # the client asked: nothing to strip
        {**CHAT, "stream": False},  # a whole answer always has usage
        {**CHAT, "stream_options": "yes"},  # not an object: the pod's 400, as without the gateway
        {**CHAT, "stream_options": {"include_usage": "true"}},  # the pod's coercion, not ours
    ],
)
def test_requests_left_as_they_are(payload: dict[str, Any]) -> None:
    req = _request(payload)
    assert ask_for_usage(req) == (req, False)


# -- stripping: vLLM's stream, in every split -------------------------------------------------------

FMT = wire.StreamFormat(chat=True, request_id="chatcmpl-1", created=1761566772, model="llama-8b")
TOKENS = [FMT.token(b" Hello"), FMT.token(b" there"), FMT.final(b".", "stop")]
WITHOUT = FMT.first + b"".join(TOKENS) + wire.DONE
WITH = FMT.first + b"".join(TOKENS) + FMT.usage(21, 3) + wire.DONE


def _tap(injected: bool) -> tuple[UsageTap, Any]:
    ex = exchange(usage_injected=injected)
    return UsageTap(ex), ex


HEAD = len(FMT.first) + len(TOKENS[0])  # what first_token hands over: up to the first token


def _through(tap: UsageTap, stream: bytes, *cuts: int) -> bytes:
    """``stream`` as the relay passes it: the head, then the pod's reads split at ``cuts``."""
    at = [HEAD, *cuts, len(stream)]
    out = [tap.head(stream[:HEAD])]
    out += [tap.feed(stream[a:b]) for a, b in itertools.pairwise(at)]
    tap.end(stream[-100:])
    return b"".join(out) + tap.flush()


def test_the_stream_vllm_sends_with_usage_differs_only_by_the_usage_event() -> None:
    assert WITH.replace(FMT.usage(21, 3), b"") == WITHOUT
    assert b'"choices":[],"usage":{"prompt_tokens":21,"total_tokens":24,"completion_tokens":3}}' in WITH


def test_injected_usage_is_stripped_byte_exactly_at_every_split() -> None:
    for cut in range(HEAD + 1, len(WITH)):
        tap, ex = _tap(injected=True)
        assert _through(tap, WITH, cut) == WITHOUT, cut
        assert tap.usage == {"prompt_tokens": 21, "total_tokens": 24, "completion_tokens": 3}, cut
        assert ex.tokens_relayed == 3, cut


def test_injected_usage_is_stripped_when_the_event_comes_in_three_reads() -> None:
    start = WITH.index(FMT.usage(21, 3))
    end = start + len(FMT.usage(21, 3))
    for a in range(start - 3, end + 2):
        for b in range(a + 1, end + 4):
            tap, ex = _tap(injected=True)
            assert _through(tap, WITH, a, b) == WITHOUT, (a, b)
            assert tap.usage is not None and ex.tokens_relayed == 3


def test_usage_the_client_asked_for_passes_untouched_and_is_recorded() -> None:
    # (passed on as it comes, a "data: " split across reads is not counted: an estimate's edge)
    for cut in (HEAD + 7, HEAD + len(TOKENS[1]), len(WITH) - 20, len(WITH) - 1):
        tap, ex = _tap(injected=False)
        assert _through(tap, WITH, cut) == WITH
        assert ex.tokens_relayed == 3
    tap, _ = _tap(injected=False)
    tap.feed(WITH)
    assert tokens_of(tap.usage) == (21, 3)


def test_only_what_may_be_the_usage_event_is_held_back() -> None:
    tap, _ = _tap(injected=True)
    token = FMT.token(b" Hello")
    partial = token[: token.index(b'"choices":[{') + 13]  # a token's event, cut after its choice began
    assert tap.feed(partial) == partial  # no waiting for the next read: it cannot be the usage event
    assert tap.feed(token[len(partial) :]) == token[len(partial) :]
    cut = FMT.usage(21, 3)[:40]  # could be the start of either: kept until it is known
    assert tap.feed(token + cut) == token
    assert tap.feed(FMT.usage(21, 3)[40:] + wire.DONE) == wire.DONE


def test_a_stream_cut_inside_a_held_event_gets_its_bytes_as_the_pod_sent_them() -> None:
    tap, _ = _tap(injected=True)
    cut = FMT.token(b" Hello")[:30]
    assert tap.feed(FMT.first + cut) == FMT.first
    assert tap.flush() == cut


def test_usage_in_a_whole_answer_re_sent_as_a_stream_stays_out_when_injected() -> None:
    answer = wire.chat_response("chatcmpl-1", 1, "m", "Hello.", "stop", 21, 2)
    assert b'"usage"' in as_sse(answer, True)
    assert b'"usage"' not in as_sse(answer, False)  # whole_answer: degraded and not usage_injected


# -- resume: the client's usage and the pods' ----------------------------------------------------------


def _usage_event(prompt: int, completion: int) -> bytes:
    return FMT.usage(prompt, completion)


def test_a_resumed_streams_usage_is_the_clients_and_the_pods_work_is_kept_apart() -> None:
    # the client's prompt: 11 tokens; 5 tokens came from the first pod; the continuation read
    # 11 + 5 + 4 template tokens = 20 and generated 7
    splicer = Splicer(created=1761566772, tokens_before=5, prompt_tokens=11)
    out = splicer.chunk(_usage_event(20, 7))
    usage = json.loads(out[6:])["usage"]
    assert usage == {"prompt_tokens": 11, "total_tokens": 23, "completion_tokens": 12}
    assert splicer.client == (11, 12)
    assert splicer.pods == (11 + 20, 12)  # the first pod read the prompt too


def test_after_two_breaks_each_continuation_s_prompt_is_charged() -> None:
    # breaks after 3 and after 5 tokens; the last continuation read 20 (prompt 11 + 5 + 4 template)
    splicer = Splicer(created=1, tokens_before=5, prompt_tokens=11, earlier=(3,))
    splicer.chunk(_usage_event(20, 7))
    assert splicer.client == (11, 12)
    assert splicer.pods == (11 + 18 + 20, 12)


def test_without_a_token_count_the_client_s_prompt_is_the_best_estimate_left() -> None:
    splicer = Splicer(created=1, tokens_before=5)
    splicer.chunk(_usage_event(20, 7))
    assert splicer.client == (15, 12)


def test_tokenize_asks_for_the_original_prompt_as_the_first_pod_templated_it() -> None:
    payload = {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"a": 1},
        "max_tokens": 5, "stream": True,
    }
    assert json.loads(tokenize_body("chat", payload)) == {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"a": 1}
    }
    assert json.loads(tokenize_body("completions", {"model": "m", "prompt": "a b"})) == {
        "model": "m", "prompt": "a b"
    }
    assert token_count(b'{"count":11,"max_model_len":8192,"tokens":[1]}') == 11
    assert token_count(b'{"count":"11"}') is None and token_count(b"<html>") is None


# -- system: a gateway with a token quota, podsim behind it ----------------------------------------------

FAST = ["--model", "llama-8b", "--ttft-ms", "5", "--itl-ms", "2"]
BODY = {
    "model": "llama-8b", "messages": [{"role": "user", "content": "Tell me about sluice gates."}],
    "max_tokens": 8, "stream": True, "seed": 7,
}


@dataclass
class Quota:
    pod: PodsimProcess
    gateway: GatewayProcess


@pytest.fixture(scope="module")
def quota() -> Iterator[Quota]:
    with PodsimProcess(FAST) as pod:
        config = {
            "server": {"host": "127.0.0.1", "max_tokens": 64},
            "quotas": {"default": {"tokens_per_minute": 1_000_000}},
            "pods": [{"name": "pod", "url": pod.url, "models": ["llama-8b"]}],
        }
        with GatewayProcess(config) as gw:
            yield Quota(pod, gw)


def _normalized(stream: bytes) -> bytes:
    """The stream with its id and created (which differ per request) made equal."""
    out = []
    for event in stream.split(b"\n\n"):
        if event.startswith(b"data: {"):
            payload = json.loads(event[6:])
            payload["id"], payload["created"] = "ID", 0
            event = b"data: " + json.dumps(payload, separators=(",", ":")).encode()
        out.append(event)
    return b"\n\n".join(out)


def _raw_h1(url: str, body: dict[str, Any], *, metered: bool = True) -> bytes:
    """The response body as sent, chunk framing removed, over a plain socket (no client parsing);
    ``metered``: the answer must show that a token quota applied to it."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%b" % (len(data), data)
        )
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert (b"\r\nx-ratelimit-limit-tokens:" in head.lower()) is metered, head
    body_out = b""
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return body_out
        body_out += rest[:size]
        rest = rest[size + 2 :]


def test_h1_a_client_that_did_not_ask_gets_vllm_s_bytes_without_usage(quota: Quota) -> None:
    direct = _raw_h1(quota.pod.url, BODY, metered=False)
    assert b'"usage"' not in direct
    through = _raw_h1(quota.gateway.url, BODY)
    assert _normalized(through) == _normalized(direct)


def test_httpx_a_client_that_asked_for_usage_gets_it_unchanged(quota: Quota) -> None:
    asked = {**BODY, "stream_options": {"include_usage": True}}
    direct = httpx.post(quota.pod.url + "/v1/chat/completions", json=asked).content
    resp = httpx.post(quota.gateway.url + "/v1/chat/completions", json=asked, timeout=30)
    assert "x-ratelimit-limit-tokens" in resp.headers
    through = resp.content
    assert b'"choices":[],"usage":' in through
    assert _normalized(through) == _normalized(direct)


def test_h2_a_client_that_did_not_ask_gets_vllm_s_bytes_without_usage(quota: Quota) -> None:
    direct = httpx.post(quota.pod.url + "/v1/chat/completions", json=BODY).content
    through = _h2_cleartext(quota.gateway.url, BODY)
    assert b'"usage"' not in through
    assert _normalized(through) == _normalized(direct)


def _h2_cleartext(url: str, body: dict[str, Any]) -> bytes:
    """One request over HTTP/2 with prior knowledge (h2c), the DATA frames joined as they came."""
    host, port = url.removeprefix("http://").split(":")
    conn = h2.connection.H2Connection()
    data = json.dumps(body).encode()
    out = b""
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        conn.initiate_connection()
        conn.send_headers(1, [
            (":method", "POST"), (":path", "/v1/chat/completions"), (":scheme", "http"),
            (":authority", f"{host}:{port}"), ("content-type", "application/json"),
            ("content-length", str(len(data))),
        ])
        conn.send_data(1, data, end_stream=True)
        sock.sendall(conn.data_to_send())
        while True:
            chunk = sock.recv(65536)
            assert chunk, "the gateway closed the connection before the stream ended"
            for event in conn.receive_data(chunk):
                if isinstance(event, h2.events.ResponseReceived):
                    headers = dict(event.headers)
                    assert headers[b":status"] == b"200" and b"x-ratelimit-limit-tokens" in headers
                elif isinstance(event, h2.events.DataReceived):
                    out += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, 1)
                elif isinstance(event, h2.events.StreamEnded):
                    return out
            sock.sendall(conn.data_to_send())


def test_the_pods_usage_reaches_the_token_metrics(quota: Quota) -> None:
    before = {kind: _tokens(quota, kind) for kind in ("prompt", "completion")}
    _raw_h1(quota.gateway.url, BODY)  # usage stripped, still counted
    direct = httpx.post(
        quota.pod.url + "/v1/chat/completions", json={**BODY, "stream_options": {"include_usage": True}}
    ).content
    usage = json.loads(direct.split(b"\n\n")[-3][6:])["usage"]
    assert _tokens(quota, "prompt") == before["prompt"] + usage["prompt_tokens"]
    assert _tokens(quota, "completion") == before["completion"] + usage["completion_tokens"]


def _tokens(quota: Quota, kind: str) -> float:
    totals = counter_totals(quota.gateway.admin_url, "sluicegate_tokens", "kind", model="llama-8b")
    return totals.get(kind, 0.0)


# -- system: a resumed stream under a quota ----------------------------------------------------------------


@dataclass
class Resumable:
    good: PodsimProcess
    bad: PodsimProcess
    gateway: GatewayProcess


@pytest.fixture(scope="module")
def resumable() -> Iterator[Resumable]:
    with PodsimProcess(FAST) as good, PodsimProcess(FAST) as bad:
        config = resume_config(
            good, bad, server={"host": "127.0.0.1", "max_tokens": 64},
            quotas={"default": {"tokens_per_minute": 1_000_000}},
        )
        with GatewayProcess(config) as gw:
            httpx.post(bad.url + "/admin/faults", json={"drop_after": 3}).raise_for_status()
            yield Resumable(good, bad, gw)


def test_a_resumed_stream_charges_every_pod_and_shows_the_client_no_usage(resumable: Resumable) -> None:
    gw = Quota(resumable.good, resumable.gateway)
    direct = httpx.post(
        resumable.good.url + "/v1/chat/completions", json={**BODY, "stream_options": {"include_usage": True}}
    ).content
    usage = json.loads(direct.split(b"\n\n")[-3][6:])["usage"]
    expected_text = _normalized(direct.replace(direct.split(b"\n\n")[-3] + b"\n\n", b""))
    resumed = 0
    for _ in range(4):  # ties rotate between the pods, so some of these start on the bad one
        before = {kind: _tokens(gw, kind) for kind in ("prompt", "completion")}
        through = _raw_h1(resumable.gateway.url, BODY)
        assert _normalized(through) == expected_text  # no usage, and the whole answer
        prompt = _tokens(gw, "prompt") - before["prompt"]
        assert _tokens(gw, "completion") - before["completion"] == usage["completion_tokens"]
        if prompt != usage["prompt_tokens"]:  # resumed: both pods read a prompt, the second a longer one
            assert prompt > 2 * usage["prompt_tokens"]
            resumed += 1
    assert resumed >= 1


@pytest.mark.parametrize("resume", [True, False])
def test_a_client_that_leaves_a_metered_stream_is_charged_what_it_got(resume: bool) -> None:
    """No usage comes from a pod whose generation was aborted, so the charge (and the token metrics)
    are the tokens the client was sent: per read by the usage tap, or, when the stream may be
    resumed, from the recorder's record of what was sent, counted once at the end."""
    with PodsimProcess(["--model", "llama-8b", "--ttft-ms", "5", "--itl-ms", "20"]) as pod:
        config: dict[str, Any] = {
            "server": {"host": "127.0.0.1", "max_tokens": 256},
            "quotas": {"default": {"tokens_per_minute": 1_000_000}},
            "pods": [{"name": "pod", "url": pod.url, "models": ["llama-8b"]}],
        }
        if resume:
            config["resume"] = {"models": ["*"], "max_per_request": 1}
        with GatewayProcess(config) as gw:
            quota = Quota(pod, gw)
            before = _tokens(quota, "completion")
            body = {**BODY, "max_tokens": 200}
            with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=30) as resp:
                events = 0
                for line in resp.iter_lines():
                    events += line.startswith("data: ")
                    if events == 10:
                        break  # the client leaves: the first event was chat's role-only chunk
            assert wait_for(lambda: _tokens(quota, "completion") > before)
            charged = _tokens(quota, "completion") - before
            assert 9 <= charged < 200, charged


# -- system: a degraded answer under a quota -------------------------------------------------------------


@pytest.fixture(scope="module")
def degrading() -> Iterator[Quota]:
    with PodsimProcess(["--model", "llama-8b", "--ttft-ms", "5", "--itl-ms", "25"]) as pod:
        config = {
            "server": {"host": "127.0.0.1", "max_tokens": 64},
            "health": {"scrape": {"interval_s": 0.1}},
            "tiers": {
                "free": {"degrade": {"inter_token_p95_ms": 15}, "quota": {"tokens_per_minute": 1_000_000}},
            },
            "pods": [{"name": "slow", "url": pod.url, "models": ["llama-8b"]}],
        }
        with GatewayProcess(config) as gw:
            yield Quota(pod, gw)


def test_a_degraded_answer_shows_no_usage_the_client_did_not_ask_for(degrading: Quota) -> None:
    url, free = degrading.gateway.url, {"x-sluicegate-tier": "free"}
    chat = {**BODY, "max_tokens": 30}
    streamed = httpx.post(url + "/v1/chat/completions", json=chat, headers=free, timeout=30)
    assert "x-sluicegate-degraded" not in streamed.headers and b'"usage"' not in streamed.content
    # the pod has now streamed 30 tokens at 25 ms: its p95 gap is over the free tier's 15 ms
    admin = degrading.gateway.admin_url
    assert wait_for(lambda: (pod_state(admin, "slow")["load"]["itl_p95_ms"] or 0) > 15)
    before = _tokens(degrading, "completion")
    whole = httpx.post(url + "/v1/chat/completions", json=chat, headers=free, timeout=30)
    assert whole.headers["x-sluicegate-degraded"] == "non-streaming"
    assert "x-ratelimit-limit-tokens" in whole.headers
    assert b'"usage"' not in whole.content and whole.content.endswith(b"data: [DONE]\n\n")
    assert _tokens(degrading, "completion") == before + 30  # the whole answer's usage, recorded
    asked = httpx.post(
        url + "/v1/chat/completions", json={**chat, "stream_options": {"include_usage": True}},
        headers=free, timeout=30,
    )
    assert asked.headers["x-sluicegate-degraded"] == "non-streaming"
    assert b'"choices":[],"usage":' in asked.content
