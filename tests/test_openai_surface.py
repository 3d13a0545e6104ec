"""The rest of the OpenAI surface through a real gateway: embeddings, the Responses API (streaming
and not), tokenize/detokenize and ``GET /v1/models/{id}``, with the openai SDK and httpx over real
sockets, routed by model to simulated vLLM pods that answer in vLLM's shapes."""

from __future__ import annotations

import json
import math
import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from gateway.admit import InferenceRequest, parse_request
from gateway.errors import GatewayError
from gateway.request_limits import RequestLimits, enforce
from loadtest.podsim.tokens import EMBEDDING_DIM
from loadtest.procs import GatewayProcess
from tests.conftest import Fleet, pod_aborts, wait_for
from transports import sse

MODEL = "llama-8b"


@pytest.fixture(scope="module")
def gateway(fleet: Fleet) -> Iterator[str]:
    config = {
        "server": {"host": "127.0.0.1", "access_log": False},
        "pods": [
            {"name": "pod-a", "url": fleet.pod_a.url, "models": [MODEL]},
            {"name": "pod-b", "url": fleet.pod_b.url, "models": [MODEL, "qwen-0.5b"]},
        ],
    }
    with GatewayProcess(config) as gw:
        yield gw.url


@pytest.fixture(scope="module")
def client(gateway: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0, timeout=30) as sdk:
        yield sdk


# -- embeddings ----------------------------------------------------------------------------------


def test_embeddings_come_back_as_unit_vectors_the_same_from_every_pod(client: openai.OpenAI) -> None:
    # The SDK asks for base64 unless told otherwise and decodes it; ask for floats too.
    packed = client.embeddings.create(model=MODEL, input=["the model", "a pod sends"])
    texts = ["the model", "a pod sends"]
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    for answer in (packed, floats):
        assert answer.model == MODEL and [d.index for d in answer.data] == [0, 1]
        assert answer.usage.prompt_tokens == 5 and answer.usage.total_tokens == 5
        for item in answer.data:
            assert len(item.embedding) == EMBEDDING_DIM
            assert math.isclose(math.sqrt(sum(v * v for v in item.embedding)), 1.0, abs_tol=1e-4)
    for a, b in zip(packed.data, floats.data, strict=True):
        assert all(math.isclose(x, y, abs_tol=1e-6) for x, y in zip(a.embedding, b.embedding, strict=True))
    assert packed.data[0].embedding != packed.data[1].embedding
    # both pods serve the model: whichever answers, the same text embeds the same way
    again = [
        client.embeddings.create(model=MODEL, input="the model", encoding_format="float") for _ in range(4)
    ]
    assert all(e.data[0].embedding == floats.data[0].embedding for e in again)


def test_embeddings_of_token_ids(client: openai.OpenAI) -> None:
    answer = client.embeddings.create(model=MODEL, input=[[0, 2, 12], [5]], encoding_format="float")
    assert len(answer.data) == 2 and answer.usage.prompt_tokens == 4


# -- the Responses API ---------------------------------------------------------------------------


def test_a_streamed_response_arrives_event_by_event_and_completes(client: openai.OpenAI) -> None:
    stream = client.responses.create(model=MODEL, input="Say something.", max_output_tokens=8, stream=True)
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == 8
    assert [e.sequence_number for e in events] == list(range(len(events)))
    completed = events[-1].response
    assert completed.output_text == "".join(deltas)
    assert completed.usage is not None and completed.usage.output_tokens == 8
    assert completed.status == "incomplete"  # max_output_tokens ended it
    assert completed.incomplete_details is not None
    assert completed.incomplete_details.reason == "max_output_tokens"


def test_a_whole_response_with_input_items(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL,
        instructions="Be brief.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "two words please"}]}],
        max_output_tokens=5,
    )
    assert response.object == "response" and response.model == MODEL
    assert len(response.output_text.split()) == 5
    assert response.usage is not None and response.usage.output_tokens == 5
    assert response.instructions == "Be brief." and response.max_output_tokens == 5


def test_a_responses_stream_cut_before_completed_ends_in_an_error(client: openai.OpenAI) -> None:
    """The pod ends its body cleanly after 3 deltas, with no response.completed: the client must
    hear that the answer is short, not see a clean end."""
    stream = client.responses.create(
        model=MODEL, input="hi", max_output_tokens=20, stream=True,
        extra_headers={"x-podsim-fault": "end_after=3"},
    )
    seen: list[str] = []
    with pytest.raises(openai.APIError) as caught:
        for event in stream:
            seen.append(event.type)
    assert seen.count("response.output_text.delta") == 3
    assert "response.completed" not in seen
    assert "upstream_truncated" in str(caught.value.body) or "truncated" in caught.value.message


def test_a_responses_stream_the_pod_ends_cleanly_is_passed_on_whole(gateway: str) -> None:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 3, "stream": True}
    with httpx.stream("POST", gateway + "/v1/responses", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read()
    assert raw.endswith(b"\n\n") and b"[DONE]" not in raw and b'"error"' not in raw
    last = raw.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    assert last.startswith(b"event: response.completed\ndata: ")


def _open_responses_stream(url: str, rid: str) -> socket.socket:
    parts = urlsplit(url)
    body = json.dumps(
        {"model": MODEL, "input": "hi", "max_output_tokens": 4000, "ignore_eos": True, "stream": True}
    ).encode()
    sock = socket.create_connection((parts.hostname, parts.port))
    sock.sendall(
        b"POST /v1/responses HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + b"x-request-id: " + rid.encode() + b"\r\ncontent-length: %d\r\n\r\n" % len(body) + body
    )  # fmt: skip
    return sock


def test_a_client_leaving_a_responses_stream_aborts_the_generation(gateway: str, fleet: Fleet) -> None:
    aborts = pod_aborts(fleet)
    rid = "leaving-responses-stream"
    sock = _open_responses_stream(gateway, rid)
    assert sock.recv(65536).startswith(b"HTTP/1.1 200")  # held until the first delta: tokens flow
    sock.close()
    assert wait_for(lambda: pod_aborts(fleet) >= aborts + 1)
    logged = [
        a["id"]
        for pod in (fleet.pod_a, fleet.pod_b)
        for a in httpx.get(pod.url + "/podsim/aborts").json()["aborts"]
    ]
    assert rid in logged


# -- tokenize / detokenize -------------------------------------------------------------------------


def test_tokenize_and_detokenize_round_trip(gateway: str) -> None:
    got = httpx.post(gateway + "/tokenize", json={"model": MODEL, "prompt": "the model pod"})
    assert got.status_code == 200, got.text
    answer = got.json()
    assert answer["count"] == 3 and answer["tokens"] == [0, 2, 12] and answer["token_strs"] is None
    assert list(answer) == ["count", "max_model_len", "tokens", "token_strs"]  # vLLM's TokenizeResponse
    back = httpx.post(gateway + "/detokenize", json={"model": MODEL, "tokens": answer["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "the model pod"}


def test_tokenizing_a_chat_counts_what_the_chat_reports_as_prompt_tokens(
    gateway: str, client: openai.OpenAI
) -> None:
    messages = [{"role": "system", "content": "be kind"}, {"role": "user", "content": "what is a pod"}]
    counted = httpx.post(gateway + "/tokenize", json={"model": MODEL, "messages": messages}).json()["count"]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)  # type: ignore[arg-type]
    assert chat.usage is not None and counted == chat.usage.prompt_tokens


# -- models --------------------------------------------------------------------------------------


def test_a_served_model_is_retrieved_and_an_unknown_one_is_404(client: openai.OpenAI) -> None:
    model = client.models.retrieve("qwen-0.5b")
    assert model.id == "qwen-0.5b" and model.object == "model"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert caught.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("org/with/slashes")


# -- refused before any pod: OpenAI's error form --------------------------------------------------

REFUSED = [
    ("/v1/embeddings", {"model": MODEL}, "input"),
    ("/v1/embeddings", {"model": MODEL, "input": []}, "input"),
    ("/v1/embeddings", {"model": MODEL, "input": [1, "a"]}, "input"),
    ("/v1/embeddings", {"input": "hi"}, "model"),
    ("/v1/embeddings", {"model": MODEL, "input": "hi", "encoding_format": "hex"}, "encoding_format"),
    ("/v1/responses", {"model": MODEL}, "input"),
    ("/v1/responses", {"model": MODEL, "input": ""}, "input"),
    ("/v1/responses", {"model": MODEL, "input": "hi", "stream": "yes"}, "stream"),
    ("/tokenize", {"model": MODEL}, "prompt"),
    ("/tokenize", {"model": MODEL, "prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("/tokenize", {"model": MODEL, "messages": []}, "messages"),
    ("/detokenize", {"model": MODEL}, "tokens"),
    ("/detokenize", {"model": MODEL, "tokens": [1, "two"]}, "tokens"),
    ("/detokenize", {"tokens": [1]}, "model"),
]


@pytest.mark.parametrize(("path", "body", "param"), REFUSED)
def test_a_request_missing_its_input_is_a_400_in_openai_form(
    gateway: str, path: str, body: dict[str, Any], param: str
) -> None:
    resp = httpx.post(gateway + path, json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_an_unknown_model_on_a_new_route_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.embeddings.create(model="ghost-model", input="hi")
    assert caught.value.code == "model_not_found"


# -- admission, the cap, and the stream grammar, without sockets -----------------------------------


def test_stream_is_read_only_where_the_endpoint_streams() -> None:
    assert parse_request("responses", b'{"model":"m","input":"x","stream":true}').stream
    assert not parse_request("embeddings", b'{"model":"m","input":"x","stream":true}').stream
    assert not parse_request("tokenize", b'{"model":"m","prompt":"x","stream":"junk"}').stream


def _capped(route: str, payload: dict[str, Any]) -> InferenceRequest:
    req = parse_request(route, json.dumps(payload).encode())
    return enforce(req, RequestLimits(max_messages=8, max_tokens=100, max_choices=1))


def test_the_token_cap_uses_max_output_tokens_for_responses_and_spares_embeddings() -> None:
    assert _capped("responses", {"model": "m", "input": "x"}).payload["max_output_tokens"] == 100
    assert "max_tokens" not in _capped("responses", {"model": "m", "input": "x"}).payload
    with pytest.raises(GatewayError) as caught:
        _capped("responses", {"model": "m", "input": "x", "max_output_tokens": 101})
    assert caught.value.param == "max_output_tokens"
    for route, payload in (
        ("embeddings", {"model": "m", "input": "x"}),
        ("tokenize", {"model": "m", "prompt": "x"}),
        ("detokenize", {"model": "m", "tokens": [1]}),
    ):
        req = _capped(route, payload)
        assert req.payload == payload  # nothing written into a request that generates nothing


_CREATED = (
    b'event: response.created\ndata: {"response":{"id":"r"},"sequence_number":0,'
    b'"type":"response.created"}\n\n'
)
_DELTA = (
    b'event: response.output_text.delta\ndata: {"content_index":0,"delta":" the","item_id":"m",'
    b'"logprobs":[],"output_index":0,"sequence_number":1,"type":"response.output_text.delta"}\n\n'
)
_COMPLETED = (
    b'event: response.completed\ndata: {"response":{"id":"r","output":[],"usage":{"input_tokens":3,'
    b'"output_tokens":1,"total_tokens":4}},"sequence_number":2,"type":"response.completed"}\n\n'
)


def test_the_first_token_of_a_responses_stream_is_its_first_text_delta() -> None:
    assert sse.scan_first_token(_CREATED) == (False, len(_CREATED))
    assert sse.scan_first_token(_CREATED + _DELTA)[0]
    empty = _DELTA.replace(b'"delta":" the"', b'"delta":""')
    assert not sse.scan_first_token(_CREATED + empty)[0]
    assert sse.scan_first_token(_CREATED + _COMPLETED)[0]  # an answer without text still ends


def test_a_responses_stream_is_whole_only_at_a_terminal_event() -> None:
    assert sse.responses_incomplete(_CREATED + _DELTA + _COMPLETED) is None
    assert sse.responses_incomplete(_CREATED + _DELTA) is not None
    assert sse.responses_incomplete(_CREATED + _DELTA + _COMPLETED[:-1]) is not None
    failed = _COMPLETED.replace(b"response.completed", b"response.failed")
    assert sse.responses_incomplete(_DELTA + failed) is None
    # a completed event larger than the tail kept: its data's last field still names it
    assert sse.responses_incomplete(_COMPLETED[40:]) is None
    assert sse.responses_incomplete(_DELTA + b": keep-alive\n\n") is not None
    assert sse.responses_incomplete(_DELTA + _COMPLETED + b": keep-alive\n\n") is None
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    assert sse.find_usage(_DELTA + _COMPLETED) == usage
