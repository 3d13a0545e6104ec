"""Abusive HTTP/2 clients (h2c, raw frames) against a real gateway process with short limits.

Each attack comes from ``loadtest.attacks.h2``; each test checks what the server did (GOAWAY and its
code, RST_STREAM codes, statuses, a closed connection), that the pod saw no more requests than the
well-behaved traffic sent (podsim's arrival log), that the gateway's memory stayed bounded (VmRSS),
and, for the floods, that a well-behaved client on another connection kept completing streams.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from h2.errors import ErrorCodes

from loadtest.attacks import h2 as attacks
from loadtest.attacks.h2 import SteadyReport, steady_streams
from tests.test_h1_limits import Target, limited_gateway

LIMITS = {"head_timeout_s": 1.0, "h2_send_stall_s": 2.0, "body_timeout_s": 1.5}
CALM = ErrorCodes.ENHANCE_YOUR_CALM


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    # a pod slow enough (20 ms a token) that a long answer is still being generated at the stall deadline
    yield from limited_gateway(LIMITS, ["--ttft-ms", "5", "--itl-ms", "20"])


def aborts(target: Target) -> int:
    return len(httpx.get(target.pod.url + "/podsim/aborts").json()["aborts"])


async def beside_steady_client(target: Target, attack: Any) -> tuple[Any, SteadyReport]:
    """Run ``attack`` while a well-behaved HTTP/2 client streams on its own connection; the steady
    client must complete streams during the attack, and goes on until the attack is over."""
    stop = asyncio.Event()
    steady = asyncio.ensure_future(steady_streams(target.gateway.url, stop, max_tokens=2))
    try:
        report = await attack
    finally:
        stop.set()
    return report, await steady


def check_steady(target: Target, steady: SteadyReport, arrivals_before: int, extra: int = 0) -> None:
    assert steady.failed == 0 and steady.completed >= 5  # ~40 streams fit in the 2 s of attack
    # the pod saw the steady client's requests and at most ``extra`` of the attacker's
    assert steady.completed <= target.arrivals() - arrivals_before <= steady.completed + extra


def test_rapid_reset_gets_goaway_enhance_your_calm(target: Target) -> None:
    arrivals, rss, cpu = target.arrivals(), target.rss_mb(), target.cpu_s()
    # one connection after another for 2 s, each trying 20,000 streams
    reports, steady = asyncio.run(beside_steady_client(target, attacks.repeated(
        lambda: attacks.rapid_reset(target.host, target.port, streams=20_000, batch=50), 2.0)))
    assert all(r.goaway_code == CALM and r.closed for r in reports)
    assert all(r.sent < 20_000 for r in reports)  # each saw the GOAWAY long before its attack's end
    # the GOAWAY's last stream: what h2 had parsed by then (~100 streams, plus the rest of that read)
    assert all(r.goaway_last_stream is not None and r.goaway_last_stream < 2 * 1000 for r in reports)
    check_steady(target, steady, arrivals, extra=5 * len(reports))
    assert target.rss_mb() - rss < 40
    # each connection costs ~15-25 ms of CPU (~0.9 s for 20,000 streams on one, unchecked)
    assert (target.cpu_s() - cpu) / len(reports) < 0.15


@pytest.mark.parametrize("flood", ["ping", "settings"])
def test_control_frame_flood_from_a_client_that_never_reads(target: Target, flood: str) -> None:
    arrivals, rss, cpu = target.arrivals(), target.rss_mb(), target.cpu_s()
    attack = attacks.ping_flood if flood == "ping" else attacks.settings_flood
    reports, steady = asyncio.run(beside_steady_client(target, attacks.repeated(
        lambda: attack(target.host, target.port, count=500_000), 2.0)))
    for report in reports:
        assert report.closed
        assert report.goaway_code in (CALM, None)  # None: aborted with the GOAWAY unread in its buffer
        # the server answered the burst allowance and what came in the same reads, then stopped
        assert report.acked < 50_000
    check_steady(target, steady, arrivals)
    assert target.rss_mb() - rss < 40
    assert target.cpu_s() - cpu < 3


def test_priority_flood_gets_goaway(target: Target) -> None:
    cpu = target.cpu_s()
    report = asyncio.run(attacks.priority_flood(target.host, target.port, count=200_000))
    assert report.goaway_code == CALM and report.closed
    assert target.cpu_s() - cpu < 2


def test_empty_data_frames_get_goaway(target: Target) -> None:
    arrivals, cpu = target.arrivals(), target.cpu_s()
    report = asyncio.run(attacks.empty_data_flood(target.host, target.port, count=100_000))
    assert report.goaway_code == CALM and report.closed
    assert target.cpu_s() - cpu < 2
    assert target.arrivals() == arrivals  # the request never completed: the pod never heard of it


def test_window_update_flood_gets_goaway(target: Target) -> None:
    cpu = target.cpu_s()
    report = asyncio.run(attacks.window_update_flood(target.host, target.port, count=200_000))
    assert report.goaway_code == CALM and report.closed
    assert target.cpu_s() - cpu < 2


def test_a_long_download_may_grant_window_as_it_reads() -> None:
    """The window-update allowance grows with the DATA frames sent: a client that acknowledges every
    frame it reads, one WINDOW_UPDATE each for the stream and the connection, is never cut off."""
    from transports.h2_guard import FloodGuard, H2Limits

    guard = FloodGuard(H2Limits(), clock=lambda: 0.0)
    guard.opened(1)
    assert not any(guard.window_update(sent) for sent in range(1, 100_000) for _ in range(2))


def test_a_trickled_body_gets_408_at_the_body_deadline(target: Target) -> None:
    arrivals = target.arrivals()
    report = asyncio.run(attacks.slow_body(target.host, target.port, interval_s=0.2, wait_s=10))
    assert report.statuses == {408: 1}
    assert report.sent < 100  # answered while the body was still trickling in
    assert target.arrivals() == arrivals


def test_continuation_flood_is_cut_off(target: Target) -> None:
    rss = target.rss_mb()
    for payload in (b"", b"x" * 16_000):  # empty frames, and 16 KB ones (memory)
        report = asyncio.run(attacks.continuation_flood(target.host, target.port, frames=50_000,
                                                        payload=payload))
        assert report.goaway_code == ErrorCodes.PROTOCOL_ERROR and report.closed
    assert target.rss_mb() - rss < 40


def test_hpack_bomb_gets_goaway(target: Target) -> None:
    arrivals, rss = target.arrivals(), target.rss_mb()
    # ~14 KB on the wire, 40 MB once decoded
    report = asyncio.run(attacks.hpack_bomb(target.host, target.port, value_bytes=4000, references=10_000))
    assert report.goaway_code == CALM and report.closed
    assert target.arrivals() == arrivals
    assert target.rss_mb() - rss < 40


def test_too_many_headers_get_431(target: Target) -> None:
    arrivals = target.arrivals()
    report = asyncio.run(attacks.many_headers(target.host, target.port, count=150))
    assert report.statuses == {431: 1} and report.goaway_code is None
    ok = asyncio.run(attacks.many_headers(target.host, target.port, count=50))
    assert ok.statuses and 431 not in ok.statuses  # (400 from the app: it has no body)
    assert target.arrivals() == arrivals


def test_streams_past_the_limit_are_refused(target: Target) -> None:
    report = asyncio.run(attacks.excess_streams(target.host, target.port, streams=140, hold_s=1.0))
    # the default SETTINGS_MAX_CONCURRENT_STREAMS is 128: the 12 past it are refused, not the connection
    assert report.resets[ErrorCodes.REFUSED_STREAM] == 12
    assert report.goaway_code is None


def test_silent_connections_are_closed(target: Target) -> None:
    report = asyncio.run(attacks.silent(target.host, target.port, preface=True, wait_s=10))
    assert report.closed and report.goaway_code == ErrorCodes.NO_ERROR
    assert report.closed_after_s is not None and report.closed_after_s < 6  # 1 s head timeout
    nothing = asyncio.run(attacks.silent(target.host, target.port, preface=False, wait_s=10))
    assert nothing.closed and nothing.closed_after_s is not None and nothing.closed_after_s < 6


def test_a_closed_window_resets_the_stream_and_aborts_the_generation(target: Target) -> None:
    before = aborts(target)
    report = asyncio.run(attacks.closed_window(target.host, target.port, max_tokens=2000, wait_s=15))
    assert report.resets == {ErrorCodes.CANCEL: 1}, report
    assert report.statuses == {200: 1}  # the answer had begun: its first chunk is what waited
    assert report.closed_after_s is None  # the stream was reset, the connection lives on
    # 2000 tokens at 20 ms would take 40 s: the pod stopped at the 2 s stall deadline
    assert wait_until(lambda: aborts(target) == before + 1)


def wait_until(condition, timeout_s: float = 5.0) -> bool:
    from tests.conftest import wait_for

    return wait_for(condition, timeout_s)
