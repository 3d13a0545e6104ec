"""Attack benchmark: what each abusive client costs the gateway, and whether others still get served.

One gateway with its default limits (only TLS added, for HTTP/3) before one simulated pod. For each
attack in ``loadtest.attacks`` (HTTP/1.1, HTTP/2, HTTP/3), a well-behaved client streams short
answers over its own HTTP/1.1 connection the whole time (from a process of its own). An attack that
is over quickly is repeated, as an attacker reconnects, to fill a 10 s window. The table gives, per
attack: what the gateway did to the attacker, the gateway CPU the attack cost (utime + stime from
``/proc``, the well-behaved client's share included, as in the quiet baseline row), the requests
that reached the pod beyond the well-behaved client's, and that client's streams and p99 time to
first token.

The gateway runs alone on core 1; pod, attackers and the well-behaved client on core 0.

    python -m loadtest.bench_attacks [--only NAME ...] [--write-md FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from gateway.rlimits import raise_open_file_limit
from loadtest.attacks import h1, h2, h3
from loadtest.attacks.h2 import steady_streams
from loadtest.bench import LOAD_CORE, PROXY_CORE, can_pin, cpu_delta_s, cpu_ticks, pin_prefix
from loadtest.loadgen import percentile
from loadtest.nginx import free_port
from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from loadtest.report import command_line, publish
from transports.tls import self_signed

HOST = "127.0.0.1"
WINDOW_S = 10.0  # each row lasts at least this long


@dataclass(frozen=True)
class Ports:
    h1: int  # cleartext: HTTP/1.1 and h2c
    quic: int  # UDP, HTTP/3


Attack = Callable[[Ports], Awaitable[str]]  # runs the attack, says what the gateway did


def _codes(counter: Any) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(counter.items(), key=str)) or "none"


def _slow(report: h1.SlowReport) -> str:
    return (f"{report.closed} of {report.connections} closed (last at {report.max_closed_after_s:.1f} s), "
            f"statuses {_codes(report.statuses)}, {report.still_open} still open")


def _h2(report: h2.H2Report) -> str:
    parts = [f"sent {report.sent}"]
    if report.goaway_code is not None:
        parts.append(f"GOAWAY {report.goaway_code} after {report.goaway_after_s or 0:.2f} s")
    if report.resets:
        parts.append(f"RST_STREAM {_codes(report.resets)}")
    if report.statuses:
        parts.append(f"statuses {_codes(report.statuses)}")
    parts.append("closed" if report.closed else "left open")
    return ", ".join(parts)


async def _oneshots(ports: Ports) -> str:
    shots = {
        "16 KiB request line": lambda: h1.long_request_line(HOST, ports.h1),
        "200 headers": lambda: h1.many_headers(HOST, ports.h1),
        "128 KiB header": lambda: h1.huge_header(HOST, ports.h1),
        **{f"smuggling {v}": (lambda v=v: h1.smuggle(HOST, ports.h1, v)) for v in h1.SMUGGLING},
    }
    out = []
    for name, shot in shots.items():
        result = await asyncio.to_thread(shot)
        out.append(f"{name}: {result.status}{' + close' if result.closed else ''}")
    return "; ".join(out)


async def _stream_flood(ports: Ports) -> str:
    r = await h3.stream_flood(HOST, ports.quic, streams=2000)
    return (f"{r.opened} opened and cancelled, {r.answered} answered, {r.rejected} rejected "
            f"(H3_REQUEST_REJECTED), resets {_codes(r.resets)}")


async def _initials(ports: Ports) -> str:
    r = await h3.initial_flood(HOST, ports.quic, count=3000, wait_s=2.0)
    return f"{r.sent} Initials: {r.answered} handshakes begun, {r.retried} Retry, {r.unanswered} dropped"


async def _never_reading(ports: Ports) -> str:
    r = await h3.never_reading(HOST, ports.quic, timeout_s=40.0)
    if r.view.reset_code is not None:
        return f"stream reset {r.view.reset_code} after {r.received} bytes"
    if r.closed_code is not None:
        return f"connection closed ({r.closed_code}) after {r.received} bytes"
    return f"neither reset nor closed ({r.received} bytes)"


ATTACKS: dict[str, tuple[str, Attack]] = {
    "h1 slowloris": ("1000 connections add a header line a second, never end the head",
                     lambda p: _wrap(h1.slow_headers(HOST, p.h1, connections=1000, duration_s=15), _slow)),
    "h1 slow body": ("500 connections send a body byte a second",
                     lambda p: _wrap(h1.slow_body(HOST, p.h1, connections=500, duration_s=35), _slow)),
    "h1 idle": ("1000 connections send nothing",
                lambda p: _wrap(h1.idle_connections(HOST, p.h1, connections=1000, duration_s=15), _slow)),
    "h1 malformed heads": ("oversized or ambiguous heads, one request each", _oneshots),
    "h2 rapid reset": ("20,000 streams opened and reset at once (CVE-2023-44487)",
                       lambda p: _wrap(h2.rapid_reset(HOST, p.h1, streams=20_000), _h2)),
    "h2 ping flood": ("500,000 PINGs, never reading",
                      lambda p: _wrap(h2.ping_flood(HOST, p.h1, count=500_000), _h2)),
    "h2 settings flood": ("100,000 SETTINGS, never reading",
                          lambda p: _wrap(h2.settings_flood(HOST, p.h1, count=100_000), _h2)),
    "h2 empty data": ("200,000 empty DATA frames",
                      lambda p: _wrap(h2.empty_data_flood(HOST, p.h1, count=200_000), _h2)),
    "h2 continuation flood": ("100,000 CONTINUATION frames, no END_HEADERS",
                              lambda p: _wrap(h2.continuation_flood(HOST, p.h1, frames=100_000), _h2)),
    "h2 hpack bomb": ("4 KB value referenced 10,000 times (~40 MB decoded)",
                      lambda p: _wrap(h2.hpack_bomb(HOST, p.h1), _h2)),
    "h2 excess streams": ("300 streams at once, bodies never ended",
                          lambda p: _wrap(h2.excess_streams(HOST, p.h1, streams=300), _h2)),
    "h2 silent": ("preface, then nothing", lambda p: _wrap(h2.silent(HOST, p.h1, wait_s=15), _h2)),
    "h2 closed window": ("a stream whose window is never opened",
                         lambda p: _wrap(h2.closed_window(HOST, p.h1, wait_s=40), _h2)),
    "h3 stream flood": ("2000 request streams opened and cancelled", _stream_flood),
    "h3 initial flood": ("3000 Initials from as many ports", _initials),
    "h3 never reading": ("a stream whose credit is never granted", _never_reading),
}


async def _wrap(coro: Awaitable[Any], describe: Callable[[Any], str]) -> str:
    return describe(await coro)


def _arrivals(pod: PodsimProcess) -> int:
    with urllib.request.urlopen(pod.url + "/podsim/arrivals", timeout=10) as resp:
        return len(json.loads(resp.read())["arrivals"])


class SteadyClient:
    """The well-behaved client in a process of its own, so an attacker's busy event loop on this
    side does not show up as the gateway's latency: streams until its stdin closes, then reports."""

    def __init__(self, url: str, pin: bool) -> None:
        argv = [*pin_prefix(LOAD_CORE, pin), sys.executable, "-m", "loadtest.bench_attacks", "--steady", url]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def stop(self) -> dict[str, Any]:
        out, _ = self.proc.communicate("", timeout=60)
        return json.loads(out)


async def _steady(url: str) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_reader(sys.stdin.fileno(), lambda: sys.stdin.read() == "" and stop.set())
    report = await steady_streams(url, stop, max_tokens=4, http2=False)
    print(json.dumps({"completed": report.completed, "failed": report.failed, "ttft_s": report.ttft_s}))


def run(names: list[str], pin: bool) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="sluicegate-attacks-") as tmp:
        cert, key = self_signed(tmp)
        tls_port = free_port(HOST)
        pod_args = ["--model", "llama-8b", "--ttft-ms", "5", "--itl-ms", "20", "--host", HOST,
                    "--log-level", "warning"]
        with PodsimProcess(pod_args, command_prefix=pin_prefix(LOAD_CORE, pin)) as pod:
            config = {
                "server": {"host": HOST, "access_log": False,
                           "tls": {"cert": str(cert), "key": str(key), "port": tls_port}},
                "pods": [{"name": "pod", "url": pod.url, "models": ["llama-8b"]}],
            }
            with GatewayProcess(config, cpu=PROXY_CORE if pin else None) as gw:
                ports = Ports(int(gw.url.rsplit(":", 1)[1]), tls_port)
                for name in ["quiet (no attack)", *names]:
                    before_cpu, before_pod = cpu_ticks([gw.pid]), _arrivals(pod)
                    began = time.perf_counter()
                    steady_client = SteadyClient(gw.url, pin)
                    if name.startswith("quiet"):
                        time.sleep(WINDOW_S)
                        what = "-"
                    else:  # a quick attack is repeated (the attacker reconnects) to fill the window
                        rounds = 0
                        while rounds == 0 or time.perf_counter() - began < WINDOW_S:
                            what = asyncio.run(ATTACKS[name][1](ports))
                            rounds += 1
                        if rounds > 1:
                            what = f"{rounds} rounds, the last: {what}"
                    steady = steady_client.stop()
                    seconds = time.perf_counter() - began
                    user, system = cpu_delta_s(before_cpu, cpu_ticks([gw.pid]))
                    reached = _arrivals(pod) - before_pod
                    p99 = percentile(steady["ttft_s"], 99)
                    row = {
                        "attack": name, "how": ATTACKS[name][0] if name in ATTACKS else "-", "result": what,
                        "seconds": seconds, "gateway_cpu_s": user + system,
                        "pod_requests_beyond_steady": reached - steady["completed"] - steady["failed"],
                        "steady_completed": steady["completed"], "steady_failed": steady["failed"],
                        "steady_per_s": steady["completed"] / seconds,
                        "steady_ttft_p99_ms": None if p99 is None else p99 * 1000,
                    }
                    rows.append(row)
                    print(f"  {name}: {what} | cpu {row['gateway_cpu_s']:.2f} s | steady "
                          f"{row['steady_completed']} ok / {row['steady_failed']} failed", file=sys.stderr,
                          flush=True)
    return rows


def render(rows: list[dict[str, Any]], command: str) -> str:
    lines = [
        f"Command: `{command}`",
        "",
        "| attack | what it does | what the gateway did | seconds | gateway CPU s "
        "| requests that reached the pod (beyond the well-behaved client's) "
        "| well-behaved streams ok / failed (per s) | their p99 TTFT ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        p99 = "-" if r["steady_ttft_p99_ms"] is None else f"{r['steady_ttft_p99_ms']:.1f}"
        lines.append(
            f"| {r['attack']} | {r['how']} | {r['result']} | {r['seconds']:.1f} | {r['gateway_cpu_s']:.2f} | "
            f"{r['pod_requests_beyond_steady']} | {r['steady_completed']} / {r['steady_failed']} "
            f"({r['steady_per_s']:.1f}) | {p99} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_attacks",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(ATTACKS), metavar="NAME",
                        help=f"run only these attacks: {', '.join(ATTACKS)}")
    parser.add_argument("--write-md", metavar="FILE")
    parser.add_argument("--steady", metavar="URL", help=argparse.SUPPRESS)  # the well-behaved client
    args = parser.parse_args(argv)
    if args.steady:
        asyncio.run(_steady(args.steady))
        return 0
    raise_open_file_limit()
    pin = can_pin()
    if pin:  # attackers, the well-behaved client and the pod stay off the gateway's core
        os.sched_setaffinity(0, {LOAD_CORE})
    rows = run(args.only or list(ATTACKS), pin)
    command = command_line("loadtest.bench_attacks", argv)
    publish(render(rows, command), args.write_md, "attacks")
    failed = [r for r in rows if r["steady_failed"] or not r["steady_completed"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
