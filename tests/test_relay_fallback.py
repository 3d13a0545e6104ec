"""The relay without the socket splice: under uvicorn's h11 protocol it falls back to ASGI sends."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator

import httpx
import pytest
import uvicorn

from gateway.app import Gateway
from gateway.config import parse_config
from gateway.server import Server
from tests.conftest import Fleet

CHAT = {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "stream": True}


@pytest.fixture
async def h11_gateway(fleet: Fleet) -> AsyncIterator[str]:
    config = parse_config({"pods": [{"name": "pod-a", "url": fleet.pod_a.url}]})
    uv = uvicorn.Config(Gateway(config), host="127.0.0.1", port=0, http="h11", log_config=None, lifespan="on")
    server = Server(uv)
    serving = asyncio.create_task(server.serve())
    await server.listening.wait()
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    yield f"http://{host}:{port}"
    server.should_exit = True
    await serving


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
