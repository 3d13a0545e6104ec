"""System tests: real clients, over real sockets, to a real gateway process in front of pod simulators."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from tests.conftest import MAX_BODY, MIG_A, Fleet, gateway_in_flight, pod_aborts, wait_for

CHAT = {
    "model": "llama-8b",
    "messages": [{"role": "user", "content": "Tell me about MIG."}],
    "max_tokens": 12,
}


def sdk(fleet: Fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet.url + "/v1", api_key="unused", max_retries=0)


def direct_text(fleet: Fleet, **kwargs: object) -> str:
    """What one pod answers directly, for comparison (the simulator's output is deterministic)."""
    client = openai.OpenAI(base_url=fleet.pod_a.url + "/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(**{**CHAT, **kwargs}).choices[0].message.content


# --- the openai SDK, sync and async, streaming and not -------------------------------------------


def test_sdk_streaming_chat_through_the_gateway_equals_the_pods_answer(fleet: Fleet) -> None:
    chunks = list(
        sdk(fleet).chat.completions.create(**CHAT, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and text == direct_text(fleet)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert len({c.id for c in chunks}) == 1


def test_sdk_non_streaming_chat_and_completions(fleet: Fleet) -> None:
    client = sdk(fleet)
    chat = client.chat.completions.create(**CHAT)
    assert chat.choices[0].message.content == direct_text(fleet)
    assert chat.usage.completion_tokens == 12
    completion = client.completions.create(model="qwen-0.5b", prompt="Once upon a time", max_tokens=5)
    assert completion.choices[0].text and completion.usage.completion_tokens == 5


async def test_async_sdk_streams_concurrently(fleet: Fleet) -> None:
    client = openai.AsyncOpenAI(base_url=fleet.url + "/v1", api_key="unused", max_retries=0)
    import asyncio

    async def one() -> str:
        stream = await client.chat.completions.create(**CHAT, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    texts = await asyncio.gather(*(one() for _ in range(20)))
    assert set(texts) == {direct_text(fleet)}
    await client.close()


async def test_async_sdk_streaming_completions(fleet: Fleet) -> None:
    client = openai.AsyncOpenAI(base_url=fleet.url + "/v1", api_key="unused", max_retries=0)
    stream = await client.completions.create(model="qwen-0.5b", prompt="Hello", max_tokens=7, stream=True)
    parts = [c.choices[0].text async for c in stream if c.choices]
    assert len("".join(parts).split()) == 7
    await client.close()


# --- bytes on the wire -----------------------------------------------------------------------------


def _normalise_created(body: bytes) -> bytes:
    # The only field that may differ between two requests a moment apart is the clock.
    return re.sub(rb'"created":\d+', b'"created":0', body)


def test_sse_bytes_through_the_gateway_are_identical_to_direct(fleet: Fleet) -> None:
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"x-request-id": "same-id-both-ways"}
    direct = httpx.post(fleet.pod_a.url + "/v1/chat/completions", json=body, headers=headers)
    via = httpx.post(fleet.url + "/v1/chat/completions", json=body, headers=headers)
    assert via.status_code == direct.status_code == 200
    assert via.headers["content-type"] == direct.headers["content-type"]
    assert via.headers["x-request-id"] == "same-id-both-ways"
    assert via.content.endswith(b"data: [DONE]\n\n")
    assert _normalise_created(via.content) == _normalise_created(direct.content)


def test_request_id_is_generated_when_absent(fleet: Fleet) -> None:
    resp = httpx.post(fleet.url + "/v1/chat/completions", json=CHAT)
    assert resp.status_code == 200
    assert re.fullmatch(r"[0-9a-f]{32}", resp.headers["x-request-id"])


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "text/plain",
                                          "multipart/form-data; boundary=x", "application/jsonx"])
def test_a_body_not_labelled_json_is_refused_before_any_pod(fleet: Fleet, content_type: str | None) -> None:
    # What a browser may send cross-origin without a preflight (and curl -d without -H) cannot
    # start a generation: 415, in the OpenAI form.
    headers = {"x-request-id": f"not-json-{content_type}"}
    if content_type is not None:
        headers["content-type"] = content_type
    resp = httpx.post(fleet.url + "/v1/chat/completions", content=json.dumps(CHAT), headers=headers)
    assert resp.status_code == 415
    assert resp.json()["error"]["code"] == "unsupported_media_type"
    arrivals = httpx.get(fleet.pod_a.url + "/podsim/arrivals").json()["arrivals"]
    assert headers["x-request-id"] not in {a["id"] for a in arrivals}
    labelled = {"content-type": "application/json; charset=utf-8"}
    resp = httpx.post(fleet.url + "/v1/chat/completions", content=json.dumps(CHAT), headers=labelled)
    assert resp.status_code == 200


# --- bad input gets a clear OpenAI-format error --------------------------------------------------


def _assert_openai_error(resp: httpx.Response, status: int, code: str) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    error = resp.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["message"]
    assert error["code"] == code
    return error


JSON = {"content-type": "application/json"}


@pytest.mark.parametrize(
    ("content", "code"),
    [
        (b"{not json", "invalid_json"),
        (b"[1, 2]", "invalid_json"),
        (b"", "invalid_request"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), "missing_model"),
        (json.dumps({"model": "llama-8b"}).encode(), "missing_messages"),
        (json.dumps({**CHAT, "stream": "yes"}).encode(), "invalid_type"),
    ],
)
def test_malformed_requests_get_400(fleet: Fleet, content: bytes, code: str) -> None:
    resp = httpx.post(fleet.url + "/v1/chat/completions", content=content, headers=JSON)
    _assert_openai_error(resp, 400, code)


def test_completions_without_prompt_is_400(fleet: Fleet) -> None:
    resp = httpx.post(fleet.url + "/v1/completions", json={"model": "llama-8b"})
    _assert_openai_error(resp, 400, "missing_prompt")


def test_unknown_model_is_404_and_the_sdk_raises_not_found(fleet: Fleet) -> None:
    resp = httpx.post(fleet.url + "/v1/chat/completions", json={**CHAT, "model": "gpt-9"})
    error = _assert_openai_error(resp, 404, "model_not_found")
    assert "gpt-9" in error["message"] and error["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        sdk(fleet).chat.completions.create(**{**CHAT, "model": "gpt-9"})


def test_oversized_body_is_413_with_and_without_content_length(fleet: Fleet) -> None:
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * (MAX_BODY + 1)}]}
    _assert_openai_error(httpx.post(fleet.url + "/v1/chat/completions", json=big), 413, "request_too_large")

    def chunks():  # no Content-Length: the limit is enforced while reading
        data = json.dumps(big).encode()
        for i in range(0, len(data), 8192):
            yield data[i : i + 8192]

    resp = httpx.post(fleet.url + "/v1/chat/completions", content=chunks(), headers=JSON)
    _assert_openai_error(resp, 413, "request_too_large")


def test_wrong_method_and_unknown_route(fleet: Fleet) -> None:
    resp = httpx.get(fleet.url + "/v1/chat/completions")
    _assert_openai_error(resp, 405, "method_not_allowed")
    assert resp.headers["allow"] == "POST, OPTIONS"  # OPTIONS: CORS preflights
    _assert_openai_error(httpx.get(fleet.url + "/v2/nothing"), 404, "not_found")
    _assert_openai_error(httpx.post(fleet.url + "/v1/models"), 405, "method_not_allowed")


# --- misbehaving pods ------------------------------------------------------------------------------


def _with_fault(fleet: Fleet, fault: str, **body: object) -> httpx.Response:
    # Only pod-a and pod-b serve llama-8b; the fault header is forwarded to whichever is picked.
    return httpx.post(
        fleet.url + "/v1/chat/completions", json={**CHAT, **body}, headers={"x-podsim-fault": fault}
    )


def test_pod_5xx_error_body_and_status_are_preserved(fleet: Fleet) -> None:
    resp = _with_fault(fleet, "status=500")
    assert resp.status_code == 500
    assert resp.json()["error"]["message"]
    resp = _with_fault(fleet, "status=503", stream=True)
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    with pytest.raises(openai.InternalServerError):
        sdk(fleet).chat.completions.create(**CHAT, extra_headers={"x-podsim-fault": "status=500"})


def test_pod_that_resets_the_connection_gives_a_clean_502(fleet: Fleet) -> None:
    resp = _with_fault(fleet, "refuse=1", stream=True)
    error = _assert_openai_error(resp, 502, "bad_gateway")
    assert "pod-" in error["message"]


def test_malformed_chunk_before_the_first_token_is_a_502(fleet: Fleet) -> None:
    resp = _with_fault(fleet, "malformed_after=0", stream=True)
    _assert_openai_error(resp, 502, "bad_gateway")


def test_pod_dropping_mid_stream_ends_the_stream_with_an_sse_error_event(fleet: Fleet) -> None:
    resp = _with_fault(fleet, "drop_after=3", stream=True)
    assert resp.status_code == 200
    events = [e for e in resp.content.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2].removeprefix(b"data: "))["error"]
    assert error["type"] == "upstream_error" and "mid-answer" in error["message"]
    tokens = [e for e in events if b'"content":"' in e and b'"content":""' not in e]
    assert len(tokens) == 3


def test_mid_stream_error_event_from_the_pod_is_passed_through(fleet: Fleet) -> None:
    resp = _with_fault(fleet, "error_after=2", stream=True)
    assert resp.status_code == 200
    assert b'"type":"InternalServerError"' in resp.content and resp.content.endswith(b"data: [DONE]\n\n")
    with pytest.raises(openai.APIError):
        for _ in sdk(fleet).chat.completions.create(
            **CHAT, stream=True, extra_headers={"x-podsim-fault": "error_after=2"}
        ):
            pass


def test_a_pod_that_is_down_gives_502_then_503_never_a_hang(fleet: Fleet) -> None:
    body = {**CHAT, "model": "ghost"}
    first = httpx.post(fleet.url + "/v1/chat/completions", json=body, timeout=10)
    assert first.status_code in (502, 503)
    second = httpx.post(fleet.url + "/v1/chat/completions", json=body, timeout=10)
    error = _assert_openai_error(second, 503, "no_healthy_upstream")
    assert "ghost" in error["message"] and second.headers["retry-after"]


# --- control plane ---------------------------------------------------------------------------------


def test_models_are_the_union_of_what_pods_serve(fleet: Fleet) -> None:
    models = sdk(fleet).models.list()
    assert {m.id for m in models.data} == {"llama-8b", "qwen-0.5b", "ghost"}


def test_health_readiness_and_admin_pods(fleet: Fleet) -> None:
    assert httpx.get(fleet.url + "/healthz").json() == {"status": "ok"}
    ready = httpx.get(fleet.url + "/readyz")
    assert ready.status_code == 200 and "llama-8b" in ready.json()["models"]
    pods = {p["name"]: p for p in httpx.get(fleet.admin_url + "/admin/pods").json()["pods"]}
    assert pods["pod-a"]["mig"] == {
        "gpu_uuid": pods["pod-a"]["mig"]["gpu_uuid"],
        "mig_uuid": MIG_A,
        "profile": "1g.10gb",
        "gpu_instance_id": None,
    }
    assert pods["pod-a"]["labels"] == {"variant": "stable"}
    assert pods["pod-a"]["state"]["health"] in ("healthy", "degraded")
    assert pods["pod-a"]["state"]["breaker"]["outlier"] in ("closed", "open", "half_open")
    assert pods["pod-b"]["models_source"] == "discovered"
    assert set(pods["pod-b"]["models"]) == {"llama-8b", "qwen-0.5b"}
    assert pods["pod-dead"]["state"]["reachable"] is False


def test_metrics_parse_and_count_requests(fleet: Fleet) -> None:
    httpx.post(fleet.url + "/v1/chat/completions", json={**CHAT, "stream": True})
    resp = httpx.get(fleet.admin_url + "/metrics")
    assert resp.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(resp.text)}
    requests = families["sluicegate_requests"]
    ok = [
        s for s in requests.samples if s.labels.get("status") == "200" and s.labels.get("model") == "llama-8b"
    ]
    assert ok and sum(s.value for s in ok) >= 1
    assert "sluicegate_time_to_first_token_seconds" in families
    assert {"pod-a", "pod-b"} <= {s.labels["pod"] for s in families["sluicegate_pod_up"].samples}
    assert "process_cpu_seconds" in families


# --- a client that leaves ------------------------------------------------------------------------


LONG = {**CHAT, "stream": True, "max_tokens": 4000, "ignore_eos": True}


def test_client_leaving_mid_stream_aborts_the_pods_generation(fleet: Fleet) -> None:
    before = pod_aborts(fleet)
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", fleet.url + "/v1/chat/completions", json=LONG) as resp,
    ):
        assert resp.status_code == 200
        next(resp.iter_bytes())  # tokens are flowing; now leave
    assert wait_for(lambda: pod_aborts(fleet) >= before + 1)
    assert wait_for(lambda: gateway_in_flight(fleet.admin_url) == 0)


def test_client_leaving_while_waiting_for_the_first_token_aborts_too(fleet: Fleet) -> None:
    before = pod_aborts(fleet)
    slow = {"x-podsim-fault": "first_token_delay_ms=20000"}
    with pytest.raises(httpx.ReadTimeout):  # gives up on the held status line and closes
        httpx.post(
            fleet.url + "/v1/chat/completions", json=LONG, headers=slow, timeout=httpx.Timeout(30, read=0.5)
        )
    assert wait_for(lambda: pod_aborts(fleet) >= before + 1)
    assert wait_for(lambda: gateway_in_flight(fleet.admin_url) == 0)


def test_access_log_lines_look_like_every_log_line_and_follow_the_log_level(fleet: Fleet) -> None:
    config = {"server": {"host": "127.0.0.1"},
              "pods": [{"name": "pod-a", "url": fleet.pod_a.url, "models": ["llama-8b"]}]}  # fmt: skip
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
    with GatewayProcess(config) as gw:
        with httpx.Client(timeout=30) as client:  # one line per request, in order, each whole
            for i in range(20):
                assert client.post(gw.url + "/v1/chat/completions", json=CHAT,
                                   headers={"x-request-id": f"line-{i}"}).status_code == 200  # fmt: skip
        gw.stop()
        lines = [line for line in gw.log().splitlines() if "sluicegate.access: " in line]
    assert len(lines) == 20
    for i, line in enumerate(lines):
        shape = stamp + f" INFO sluicegate.access: rid=line-{i} .* status=200 outcome=ok .*"
        assert re.fullmatch(shape, line)
    with GatewayProcess(config, extra_args=["--log-level", "warning"]) as quiet:
        assert httpx.post(quiet.url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
        quiet.stop()
        assert "sluicegate.access" not in quiet.log()


def test_the_access_log_can_be_json_lines() -> None:
    # A pod paced as a real one is (25 ms a token). Without usage asked for and no quota, the
    # gateway counts a stream's tokens by the pod's reads, one token each at that pace; the fleet's
    # 2 ms tokens can come two to a read when the machine is busy, and count once.
    with PodsimProcess(["--model", "llama-8b", "--ttft-ms", "5", "--itl-ms", "25"]) as pod:
        config = {"server": {"host": "127.0.0.1", "access_log_format": "json"},
                  "pods": [{"name": "pod-a", "url": pod.url, "models": ["llama-8b"]}]}  # fmt: skip
        with GatewayProcess(config) as gw:
            ok = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                            headers={"x-request-id": "json-1"}, timeout=30)  # fmt: skip
            assert ok.status_code == 200
            unknown = {"model": "nope", "messages": [{"role": "user"}]}
            httpx.post(gw.url + "/v1/chat/completions", json=unknown, headers={"x-request-id": "json-2"},
                       timeout=30)  # fmt: skip
            fault = {"x-request-id": "json-3", "x-podsim-fault": "error_after=2"}
            broken = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30,
                                headers=fault)  # fmt: skip
            assert broken.status_code == 200 and '"error"' in broken.text  # the pod's own event, passed on
            gw.stop()
            lines = [line.split("sluicegate.access: ", 1)[1] for line in gw.log().splitlines()
                     if "sluicegate.access: " in line]  # fmt: skip
    records = {r["request_id"]: r for r in map(json.loads, lines)}
    good, missing = records["json-1"], records["json-2"]
    assert (good["status"], good["pod"], good["transport"], good["stream"]) == (200, "pod-a", "h1", True)
    assert good["ttft_ms"] > 0 and good["chunks"] > 0
    # usage not asked for: the completion tokens are the content events relayed (one per token),
    # which are those with text (the role-only opening chunk has '"content":""')
    assert good["completion_tokens"] == ok.text.count('"content":"') - 1 == CHAT["max_tokens"]
    assert good["mig_slice"] is None  # this pod was configured without one
    assert (missing["status"], missing["outcome"], missing["pod"]) == (404, "model_not_found", None)
    # whole by its framing, but ended by the pod's error event: not an "ok"
    assert (records["json-3"]["status"], records["json-3"]["outcome"]) == (200, "upstream_error_event")
