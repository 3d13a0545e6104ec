"""DNS discovery: a real lookup of localhost, and reports only when the address set changes."""

from __future__ import annotations

import asyncio
import socket

import pytest

from gateway.pods.dns import DnsDiscovery
from gateway.pods.kubernetes import KubePod


async def test_localhost_resolves_to_a_pod() -> None:
    discovery = DnsDiscovery("localhost", 8000, models=("llama-8b",), labels={"variant": "stable"})
    reported: asyncio.Queue[list[KubePod]] = asyncio.Queue()
    task = asyncio.create_task(discovery.run(reported.put_nowait))
    try:
        pods = await asyncio.wait_for(reported.get(), 5.0)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    by_name = {p.name: p for p in pods}
    assert by_name["127.0.0.1"] == KubePod(
        name="127.0.0.1", url="http://127.0.0.1:8000", models=("llama-8b",), labels={"variant": "stable"}
    )
    if "::1" in by_name:
        assert by_name["::1"].url == "http://[::1]:8000"
    assert by_name["127.0.0.1"].to_pod_config().models == ("llama-8b",)


class Scripted(DnsDiscovery):
    """Answers from a script instead of DNS; ``None`` stands for a lookup that failed."""

    def __init__(self, answers: list[list[str] | None]) -> None:
        super().__init__("vllm.llm.svc.cluster.local", 8000, interval_s=0)
        self.answers = answers
        self.done = asyncio.Event()

    async def resolve(self) -> list[str] | None:
        if not self.answers:
            self.done.set()
            await asyncio.Event().wait()  # stays here until cancelled
        return self.answers.pop(0)


async def test_only_changes_are_reported() -> None:
    a, b = "10.0.0.1", "10.0.0.2"
    discovery = Scripted([[a], [a], [a, b], None, [a, b], [b], []])
    reported: list[list[str]] = []
    task = asyncio.create_task(discovery.run(lambda pods: reported.append([p.name for p in pods])))
    try:
        await asyncio.wait_for(discovery.done.wait(), 5.0)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    # a failed lookup keeps the last list rather than emptying the fleet
    assert reported == [[a], [a, b], [b], []]


@pytest.mark.parametrize(
    ("errno", "expected"),
    [(socket.EAI_NONAME, []), (socket.EAI_AGAIN, None)],
    ids=["no-such-name-is-no-pods", "dns-down-is-no-answer"],
)
async def test_lookup_errors(monkeypatch: pytest.MonkeyPatch, errno: int, expected: list | None) -> None:
    async def failing(*_args: object, **_kwargs: object) -> list:
        raise socket.gaierror(errno, "lookup failed")

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", failing)
    assert await DnsDiscovery("vllm", 8000).resolve() == expected
