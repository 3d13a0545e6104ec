"""The relay without uvicorn's httptools shortcuts: ASGI sends instead of the splice (under h11),
and a task awaiting ``receive()`` instead of the disconnect tripwire (under any other server)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn

from gateway.app import Gateway
from gateway.config_load import parse_config
from gateway.server import Server
from tests.conftest import Fleet, pod_aborts, wait_for

CHAT = {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "stream": True}


async def _serve(app: Any, http: str) -> AsyncIterator[str]:
    uv = uvicorn.Config(app, host="127.0.0.1", port=0, http=http, log_config=None, lifespan="on")
    server = Server(uv)
    serving = asyncio.create_task(server.serve())
    await server.listening.wait()
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    yield f"http://{host}:{port}"
    server.should_exit = True
    await serving


@pytest.fixture
async def h11_gateway(fleet: Fleet) -> AsyncIterator[str]:
    config = parse_config({"pods": [{"name": "pod-a", "url": fleet.pod_a.url}], "auth": {"enabled": False}})
    async for url in _serve(Gateway(config), "h11"):
        yield url


class PlainReceive:
    """The gateway behind a wrapper whose ``receive`` and ``send`` are plain functions, as any
    server but uvicorn's HTTP/1.1 would hand them: the relay cannot reach the connection, and only
    ``receive()`` tells it that the client left."""

    def __init__(self, app: Gateway) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        async def plain_receive() -> dict[str, Any]:
            return await receive()

        async def plain_send(message: dict[str, Any]) -> None:
            await send(message)

        await self.app(scope, plain_receive, plain_send)


@pytest.fixture
async def plain_receive_gateway(fleet: Fleet) -> AsyncIterator[str]:
    config = parse_config({"pods": [{"name": "pod-a", "url": fleet.pod_a.url}], "auth": {"enabled": False}})
    async for url in _serve(PlainReceive(Gateway(config)), "httptools"):
        yield url


async def test_stream_bytes_are_identical_without_the_splice(fleet: Fleet, h11_gateway: str) -> None:
    headers = {"x-request-id": "fallback-1"}
    async with httpx.AsyncClient() as client:
        direct = await client.post(fleet.pod_a.url + "/v1/chat/completions", json=CHAT, headers=headers)
        via = await client.post(h11_gateway + "/v1/chat/completions", json=CHAT, headers=headers)
    assert via.status_code == 200
    same = re.sub(rb'"created":\d+', b"", via.content) == re.sub(rb'"created":\d+', b"", direct.content)
    assert same and via.content.count(b'"content":"') == 10


async def test_pod_dropping_mid_stream_still_ends_with_an_error_event(h11_gateway: str) -> None:
    async with httpx.AsyncClient() as client:
        resp = await client.post(
            h11_gateway + "/v1/chat/completions", json=CHAT, headers={"x-podsim-fault": "drop_after=2"}
        )
    events = [e for e in resp.content.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    assert json.loads(events[-2].removeprefix(b"data: "))["error"]["type"] == "upstream_error"


async def test_client_leaving_is_noticed_through_receive_alone(
    fleet: Fleet, plain_receive_gateway: str
) -> None:
    before = pod_aborts(fleet)
    long = {**CHAT, "max_tokens": 4000, "ignore_eos": True}
    async with (
        httpx.AsyncClient(timeout=30) as client,
        client.stream("POST", plain_receive_gateway + "/v1/chat/completions", json=long) as resp,
    ):
        assert resp.status_code == 200
        await anext(resp.aiter_bytes())  # tokens are flowing; now leave
    assert await asyncio.to_thread(wait_for, lambda: pod_aborts(fleet) >= before + 1)
