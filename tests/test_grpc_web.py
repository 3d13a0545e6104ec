"""gRPC-Web through a real gateway and simulated pods, with a third-party client.

The client is Connect for Node.js (``@connectrpc/connect-node``'s ``createGrpcWebTransport``, in
tests/grpcweb_client, installed by ``make test`` with ``npm ci``), which builds the service from a
descriptor set that protoc makes of proto/ here. Those tests skip, saying why, without node or
without the installed packages. A raw HTTP client covers what Connect does not speak
(``application/grpc-web-text``) and the header-level details (grpc-timeout, CORS preflight).
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.config import ServerConfig
from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from tests.conftest import FAST, Fleet, counter_totals, gateway_in_flight, pod_aborts, pod_state, wait_for
from transports import grpc_web as codec
from transports.proto.sluicegate.v1 import inference_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
CLIENT_DIR = ROOT / "tests" / "grpcweb_client"
NODE = shutil.which("node")
CONNECT_INSTALLED = (CLIENT_DIR / "node_modules" / "@connectrpc" / "connect-node" / "package.json").is_file()


def _node_problem() -> str | None:
    if NODE is None:
        return "node is not on PATH"
    version = subprocess.run([NODE, "--version"], capture_output=True, text=True).stdout.strip()
    if int(version.lstrip("v").split(".")[0] or 0) < 20:
        return f"node {version} is older than 20"
    if not CONNECT_INSTALLED:
        return "tests/grpcweb_client/node_modules is missing"
    return None


NODE_PROBLEM = _node_problem()
needs_connect = pytest.mark.skipif(
    NODE_PROBLEM is not None,
    reason="the Connect gRPC-Web client needs node >= 20 and `npm ci --prefix tests/grpcweb_client` "
    f"(make test runs it): {NODE_PROBLEM}",
)
HTTP_VERSIONS = [
    "1.1",
    pytest.param(
        "2",
        marks=pytest.mark.skipif(
            "h2c" not in ServerConfig.model_fields, reason="this gateway has no h2c listener (server.h2c)"
        ),
    ),
]

SERVICE = "/sluicegate.v1.Inference/"
PROMPT = [{"role": "user", "content": "Tell me about sluice gates."}]
ASK = {"model": "llama-8b", "messages": PROMPT, "max_tokens": 12, "seed": 42}
LONG = {"model": "llama-8b", "messages": PROMPT, "max_tokens": 4000, "ignore_eos": True}  # ~8 s of tokens


@pytest.fixture(scope="module")
def descriptor_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """proto/ compiled to a FileDescriptorSet, from which the Node client builds the service."""
    out = tmp_path_factory.mktemp("proto") / "inference.binpb"
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}", f"--descriptor_set_out={out}",
         str(ROOT / "proto" / "sluicegate" / "v1" / "inference.proto")],
        check=True,
    )  # fmt: skip
    return out


def connect(descriptor_set: Path, *calls: dict[str, Any]) -> list[dict[str, Any]]:
    """Run the calls one after another in one Node process; one result per call."""
    proc = subprocess.run(
        [NODE or "node", str(CLIENT_DIR / "client.mjs"), str(descriptor_set), json.dumps(list(calls))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(results) == len(calls), proc.stdout + proc.stderr
    return results


def grpc_web(
    url: str,
    method: str,
    request: dict[str, Any],
    *,
    text: bool = False,
    headers: dict[str, str] | None = None,
) -> tuple[httpx.Response, list[bytes], dict[str, str]]:
    """A raw gRPC-Web call: the response, its message payloads, and its status (trailers, or the
    headers of a Trailers-Only answer)."""
    body = codec.encode_message(_request(request).SerializeToString())
    content_type = "application/grpc-web-text" if text else "application/grpc-web+proto"
    resp = httpx.post(
        url + SERVICE + method,
        content=base64.b64encode(body) if text else body,
        headers={"content-type": content_type, "x-grpc-web": "1", **(headers or {})},
        timeout=30,
    )
    raw = codec.decode_text(resp.content) if text else resp.content
    frames = codec.decode_frames(raw)
    if not frames:
        status = {k: v for k, v in resp.headers.items() if k.startswith("grpc-")}
        if "grpc-message" in status:
            status["grpc-message"] = codec.percent_decode(status["grpc-message"].encode())
        return resp, [], status
    assert frames[-1].is_trailers
    return resp, [f.payload for f in frames[:-1]], codec.parse_trailers(frames[-1].payload)


def _request(fields: dict[str, Any]) -> pb.ChatCompletionRequest:
    return pb.ChatCompletionRequest(
        **{**fields, "messages": [pb.ChatMessage(**m) for m in fields.get("messages", [])]}
    )


def sse_text(url: str, body: dict[str, Any]) -> str:
    """The same request through the OpenAI SDK's streaming path (HTTP/1.1 SSE)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="sk-none", max_retries=0)
    stream = client.chat.completions.create(**body, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def requests_total(admin_url: str, status: str, transport: str | None = None) -> float:
    """The relay's count of finished chat requests with this status (and transport label)."""
    where = {"route": "chat"} if transport is None else {"route": "chat", "transport": transport}
    return counter_totals(admin_url, "sluicegate_requests", "status", **where).get(status, 0.0)


# -- the same answer ---------------------------------------------------------------------------------


@needs_connect
@pytest.mark.parametrize("http_version", HTTP_VERSIONS)
def test_a_connect_client_streams_the_same_text_as_the_openai_sdk(
    fleet: Fleet, descriptor_set: Path, http_version: str
) -> None:
    expected = sse_text(fleet.url, ASK)
    assert len(expected.split()) == 12
    before = requests_total(fleet.admin_url, "200", "grpc-web")
    call = {"baseUrl": fleet.url, "httpVersion": http_version}
    stream, unary = connect(
        descriptor_set,
        {
            **call,
            "method": "StreamChatCompletion",
            "request": {**ASK, "stream_options": {"include_usage": True}},
        },
        {**call, "method": "ChatCompletion", "request": ASK},
    )
    assert stream["code"] == 0, stream
    assert stream["text"] == expected
    assert stream["role"] == "assistant" and stream["finishReason"] == "length"
    assert stream["chunks"] >= 12 and stream["usage"]["completion"] == 12
    assert stream["trailers"]["grpc-status"] == "0"
    assert stream["headers"]["content-type"] == "application/grpc-web+proto"
    assert stream["headers"]["x-request-id"] and stream["headers"]["x-sluicegate-pod"] in ("pod-a", "pod-b")
    assert unary["code"] == 0, unary
    assert unary["text"] == expected and unary["finishReason"] == "length"
    assert unary["usage"]["completion"] == 12
    # one request lifecycle: the relay counted both, under the gRPC-Web transport label
    assert requests_total(fleet.admin_url, "200", "grpc-web") == before + 2


def test_grpc_web_text_mode_carries_the_same_answer(fleet: Fleet) -> None:
    expected = sse_text(fleet.url, ASK)
    resp, payloads, status = grpc_web(fleet.url, "StreamChatCompletion", ASK, text=True)
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/grpc-web-text+proto"
    assert status == {"grpc-status": "0"}
    chunks = [pb.ChatCompletionChunk.FromString(p) for p in payloads]
    assert "".join(c.choices[0].delta.content for c in chunks if c.choices) == expected
    resp, payloads, status = grpc_web(fleet.url, "ChatCompletion", ASK, text=True)
    assert status == {"grpc-status": "0"} and len(payloads) == 1
    assert pb.ChatCompletion.FromString(payloads[0]).choices[0].message.content == expected


def test_a_new_gateway_answers_concurrent_first_calls_alike(fleet: Fleet) -> None:
    """The endpoint loads on a gateway's first gRPC-Web call; calls that arrive together while it
    loads all get the whole answer."""
    config = {"pods": [{"name": "pod-a", "url": fleet.pod_a.url, "models": ["llama-8b"]}]}
    with GatewayProcess(config) as gateway, ThreadPoolExecutor(6) as pool:
        calls = [pool.submit(grpc_web, gateway.url, "StreamChatCompletion", ASK) for _ in range(6)]
        answers = [call.result() for call in calls]
    texts = set()
    for resp, payloads, status in answers:
        assert resp.status_code == 200 and status == {"grpc-status": "0"}
        chunks = [pb.ChatCompletionChunk.FromString(p) for p in payloads]
        texts.add("".join(c.choices[0].delta.content for c in chunks if c.choices))
    assert len(texts) == 1 and len(texts.pop().split()) == 12


# -- errors as gRPC codes ------------------------------------------------------------------------------


@needs_connect
def test_gateway_errors_reach_a_connect_client_as_grpc_codes(fleet: Fleet, descriptor_set: Path) -> None:
    not_found_before = requests_total(fleet.admin_url, "404")
    call = {"baseUrl": fleet.url, "method": "StreamChatCompletion"}
    unknown, invalid, pod_429, deadline, client_deadline = connect(
        descriptor_set,
        {**call, "request": {**ASK, "model": "no-such-model"}},
        {**call, "request": {"model": "llama-8b"}},  # no messages
        {**call, "request": ASK, "headers": {"x-podsim-fault": "status=429"}},
        # the gateway's own deadline (X-Request-Timeout-Ms), with none on the client's side
        {**call, "request": ASK, "headers": {"x-podsim-fault": "first_token_delay_ms=3000",
                                             "x-request-timeout-ms": "300"}},
        # the client's deadline, sent as grpc-timeout
        {**call, "request": ASK, "headers": {"x-podsim-fault": "first_token_delay_ms=3000"},
         "timeoutMs": 300},
    )  # fmt: skip
    assert (unknown["codeName"], unknown["code"]) == ("NotFound", 5)
    assert "no-such-model" in unknown["message"]
    assert invalid["codeName"] == "InvalidArgument" and "'messages' is required" in invalid["message"]
    assert pod_429["codeName"] == "ResourceExhausted", pod_429
    assert deadline["codeName"] == "DeadlineExceeded" and deadline["message"].startswith("Timed out"), (
        deadline
    )
    assert client_deadline["codeName"] == "DeadlineExceeded"
    # the same lifecycle counted them, as it counts HTTP clients
    assert requests_total(fleet.admin_url, "404") == not_found_before + 1


def test_grpc_timeout_becomes_the_gateways_deadline_and_aborts_the_pod(fleet: Fleet) -> None:
    aborts = pod_aborts(fleet)
    started = time.perf_counter()
    resp, payloads, status = grpc_web(
        fleet.url,
        "StreamChatCompletion",
        ASK,
        headers={"grpc-timeout": "300m", "x-podsim-fault": "first_token_delay_ms=5000"},
    )
    elapsed = time.perf_counter() - started
    assert resp.status_code == 200 and payloads == []  # Trailers-Only
    assert status["grpc-status"] == "4" and status["grpc-message"].startswith("Timed out"), status
    assert 0.25 < elapsed < 4.0  # the 300 ms deadline, long before the pod's 5 s
    assert wait_for(lambda: pod_aborts(fleet) >= aborts + 1)


def test_bad_envelopes_are_answered_in_grpc_form(fleet: Fleet) -> None:
    url = fleet.url + SERVICE + "StreamChatCompletion"
    resp = httpx.post(url, content=b"{}", headers={"content-type": "application/json"})
    assert resp.status_code == 415 and resp.headers["grpc-status"] == "3"
    resp = httpx.post(
        fleet.url + SERVICE + "Embed", content=b"", headers={"content-type": "application/grpc-web"}
    )
    assert resp.status_code == 200 and resp.headers["grpc-status"] == "12"
    resp = httpx.post(
        url, content=b"\x00\x00\x00\x00\x09abc", headers={"content-type": "application/grpc-web"}
    )
    assert resp.status_code == 200 and resp.headers["grpc-status"] == "3" and resp.content == b""


# -- shedding -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def full_pod() -> Iterator[tuple[PodsimProcess, GatewayProcess]]:
    """One pod and a gateway that scrapes its KV-cache usage every 0.1 s."""
    with PodsimProcess(["--model", "llama-8b", *FAST]) as pod:
        config = {
            "server": {"host": "127.0.0.1", "access_log": False},
            "health": {"probe": {"interval_s": 0.1}, "scrape": {"interval_s": 0.1, "stale_after_s": 2}},
            "pods": [{"name": "pod-a", "url": pod.url, "models": ["llama-8b"]}],
        }
        with GatewayProcess(config) as gw:
            yield pod, gw


@needs_connect
def test_a_shed_request_is_resource_exhausted(
    full_pod: tuple[PodsimProcess, GatewayProcess], descriptor_set: Path
) -> None:
    pod, gw = full_pod
    url = gw.url

    assert httpx.post(pod.url + "/admin/faults", json={"kv_usage": 0.97}).status_code == 200
    try:
        assert wait_for(lambda: pod_state(gw.admin_url, "pod-a")["breaker"]["pressure"] == "open")
        (shed,) = connect(descriptor_set, {"baseUrl": url, "method": "StreamChatCompletion", "request": ASK})
    finally:
        httpx.delete(pod.url + "/admin/faults")
    assert shed["codeName"] == "ResourceExhausted", shed
    assert "at capacity" in shed["message"]
    assert int(shed["metadata"]["retry-after"]) >= 1


# -- browsers ----------------------------------------------------------------------------------------


def test_a_page_on_another_origin_may_call_it(fleet: Fleet) -> None:
    origin = "https://chat.example.com"
    url = fleet.url + SERVICE + "StreamChatCompletion"
    preflight = httpx.options(
        url,
        headers={
            "origin": origin,
            "access-control-request-method": "POST",
            "access-control-request-headers": "content-type,x-grpc-web,x-user-agent,grpc-timeout",
        },
    )
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == origin
    assert "POST" in preflight.headers["access-control-allow-methods"]
    allowed = preflight.headers["access-control-allow-headers"].split(",")
    assert {"content-type", "x-grpc-web", "x-user-agent", "grpc-timeout"} <= set(allowed)
    assert int(preflight.headers["access-control-max-age"]) > 0
    resp, _, status = grpc_web(fleet.url, "StreamChatCompletion", ASK, headers={"origin": origin})
    assert status["grpc-status"] == "0"
    assert resp.headers["access-control-allow-origin"] == origin
    exposed = resp.headers["access-control-expose-headers"].split(",")
    assert {"grpc-status", "grpc-message", "grpc-status-details-bin"} <= set(exposed)


# -- a client that leaves -------------------------------------------------------------------------------


@needs_connect
@pytest.mark.parametrize("http_version", HTTP_VERSIONS)
def test_a_client_that_cancels_mid_stream_aborts_the_pods_generation(
    fleet: Fleet, descriptor_set: Path, http_version: str
) -> None:
    aborts = pod_aborts(fleet)
    call = {"baseUrl": fleet.url, "httpVersion": http_version, "method": "StreamChatCompletion",
            "request": LONG, "abortAfterChunks": 3, "holdAfterAbort": True}  # fmt: skip
    node = subprocess.Popen(
        [NODE or "node", str(CLIENT_DIR / "client.mjs"), str(descriptor_set), json.dumps([call])],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert node.stdout is not None
        result = json.loads(node.stdout.readline())
        assert node.stdout.readline() == "held\n"
        assert result["aborted"] and result["codeName"] == "Canceled" and result["chunks"] >= 3
        # the Node process is still alive: the abort, not its exit, reached the pod
        assert wait_for(lambda: pod_aborts(fleet) >= aborts + 1)
        assert node.poll() is None
        assert wait_for(lambda: gateway_in_flight(fleet.admin_url) == 0)
    finally:
        node.communicate(timeout=10)
