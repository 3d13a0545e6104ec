"""Disconnect benchmark: clients that leave, and how soon the pod learns it should stop.

A burst of clients that each read a few tokens and then close, and as many that close while
still waiting for their first token (the pod holds it back with a fault). Each request carries
its own ``X-Request-Id``; the pod simulator logs, per aborted request id, the moment it saw the
disconnect (``GET /podsim/aborts``, ``time.monotonic()``, which is one clock for the whole machine),
and this client logs the moment it closed. The difference is the client-close to upstream-close
latency. Also: one client at a time (the single-disconnect latency), and the proxy's open fds
(and, for the gateway, its asyncio tasks) before and after.

    python -m loadtest.bench_disconnects [--clients 500] [--target gateway,nginx] [--write-md FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gateway.rlimits import raise_open_file_limit
from loadtest.bench import (
    MODEL,
    PROXY_CORE,
    Scenario,
    machine_summary,
    pin_prefix,
    process_tree,
    start_gateway,
    start_pod,
)
from loadtest.fincap import FinCapture
from loadtest.loadgen import percentile
from loadtest.nginx import NginxProcess, nginx_binary
from loadtest.report import command_line, publish

POD = Scenario("disconnects", "disconnects", streams=2000, requests=1, max_tokens=4000, itl_ms=20.0)
HOLD_FIRST_TOKEN = "x-podsim-fault: first_token_delay_ms=60000\r\n"


def _request(rid: str, extra: str) -> bytes:
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "leave early"}],
            "max_tokens": 4000,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        f"x-request-id: {rid}\r\n{extra}content-length: {len(body)}\r\n\r\n"
    ).encode() + body


async def _leave(host: str, port: int, rid: str, mid_stream: bool, ready: asyncio.Event) -> tuple[float, int]:
    """Send one request; close after 3 tokens (mid-stream) or once everyone has sent (waiting).

    Returns when it closed (monotonic) and its own port (to find its FIN in a capture)."""
    reader, writer = await asyncio.open_connection(host, port)
    own_port = writer.get_extra_info("sockname")[1]
    writer.write(_request(rid, "" if mid_stream else HOLD_FIRST_TOKEN))
    await writer.drain()
    if mid_stream:
        seen = b""
        while seen.count(b'"content":"') < 4:  # the role chunk plus three tokens
            chunk = await reader.read(65536)
            if not chunk:
                break
            seen += chunk
    else:
        await ready.wait()
    # Shut the socket down here and now: writer.close() alone sends the FIN only when this busy
    # event loop next gets round to it, which would count the harness's own delay against the proxy.
    closed_at = time.monotonic()
    writer.get_extra_info("socket").shutdown(socket.SHUT_RDWR)
    writer.close()
    return closed_at, own_port


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def _aborts(pod_url: str) -> dict[str, tuple[float, int]]:
    """Per aborted request id: when the pod simulator noticed (monotonic) and the proxy's port."""
    return {a["id"]: (a["at"], a["peer_port"]) for a in _get_json(pod_url + "/podsim/aborts")["aborts"]}


def _open_fds(pid: int) -> int:
    """Open fds of the proxy and its children (nginx: master and workers)."""
    return sum(len(os.listdir(f"/proc/{p}/fd")) for p in process_tree(pid))


def _gateway_tasks(admin_url: str) -> int | None:
    with urllib.request.urlopen(admin_url + "/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("sluicegate_asyncio_tasks "):
                return int(float(line.split()[1]))
    return None


Departures = dict[str, tuple[float, bool, int]]  # request id: (closed at, mid-stream, client port)


async def _burst(base: str, clients: int) -> Departures:
    parts = urlsplit(base)
    ready = asyncio.Event()
    rids = [(f"{'mid' if i % 2 else 'wait'}-{uuid.uuid4().hex}", bool(i % 2)) for i in range(2 * clients)]
    tasks = [asyncio.create_task(_leave(parts.hostname, parts.port, rid, mid, ready)) for rid, mid in rids]
    mids = [t for t, (_, mid) in zip(tasks, rids, strict=True) if mid]
    await asyncio.gather(*mids)  # every mid-stream client has left; let the waiting ones go at once
    await asyncio.sleep(0.5)  # their requests have long reached the pod (benchmark pacing, not a sync)
    ready.set()
    closed = await asyncio.gather(*tasks)
    return {rid: (at, mid, port) for (rid, mid), (at, port) in zip(rids, closed, strict=True)}


async def _singles(base: str, count: int) -> Departures:
    parts = urlsplit(base)
    out = {}
    ready = asyncio.Event()
    for _ in range(count):
        rid = f"single-{uuid.uuid4().hex}"
        at, port = await _leave(parts.hostname, parts.port, rid, True, ready)
        out[rid] = (at, True, port)
        await asyncio.sleep(0.05)
    return out


def _latencies(
    left: Departures, pod_url: str, proxy_port: int, pod_port: int, capture: FinCapture | None
) -> tuple[list[float], list[float], int]:
    """Close→abort latencies (ms): on the wire (kernel stamps of the two FINs; empty without a
    capture) and as the pod simulator noticed it; and how many departures the pod saw at all."""
    deadline = time.monotonic() + 15
    seen = _aborts(pod_url)
    while sum(rid in seen for rid in left) < len(left) and time.monotonic() < deadline:
        time.sleep(0.1)
        seen = _aborts(pod_url)
    noticed = [(seen[rid][0] - at) * 1000 for rid, (at, _, _) in left.items() if rid in seen]
    wire = []
    if capture is not None:
        # (client's FIN to the proxy, proxy's FIN to the pod) of each departure the pod saw; the
        # capture thread may still be reading the last of them
        fins = [((port, proxy_port), (seen[rid][1], pod_port)) for rid, (_, _, port) in left.items()
                if rid in seen]
        got = capture.first
        until = time.monotonic() + 2
        while time.monotonic() < until and not all(a in got and b in got for a, b in fins):
            time.sleep(0.01)
        for client, proxy in fins:
            client_fin, proxy_fin = got.get(client), got.get(proxy)
            if client_fin is not None and proxy_fin is not None:
                wire.append((proxy_fin - client_fin) * 1000)
    return wire, noticed, sum(rid in seen for rid in left)


@contextlib.contextmanager
def _capturing() -> Iterator[FinCapture | None]:
    """FINs on ``lo`` captured while the block runs (None where the capture cannot be had).

    The departures and their latencies both go in the block: a proxy's FIN to the pod comes after
    its client's, so a capture stopped once the clients have left would miss the slowest ones."""
    capture = FinCapture()
    started = capture.start()
    try:
        yield capture if started else None
    finally:
        capture.stop()


def run_target(target: str, clients: int, singles: int, pin: bool) -> dict[str, Any]:
    pod = start_pod(POD, pin)
    try:
        with tempfile.TemporaryDirectory(prefix="sluicegate-disc-") as tmp:
            if target == "gateway":
                proxy: Any = start_gateway(pod.url, pin)
            else:
                proxy = NginxProcess(pod.url, Path(tmp) / "nginx", command_prefix=pin_prefix(PROXY_CORE, pin))
                proxy.start()
            try:
                pid = proxy.pid
                urllib.request.urlopen(
                    proxy.url + ("/readyz" if target == "gateway" else "/v1/models")
                ).read()
                admin = proxy.admin_url if target == "gateway" else None
                fds0, tasks0 = _open_fds(pid), _gateway_tasks(admin) if admin else None
                proxy_port, pod_port = urlsplit(proxy.url).port, urlsplit(pod.url).port
                with _capturing() as capture:
                    burst = asyncio.run(_burst(proxy.url, clients))
                    wire, noticed, seen = _latencies(burst, pod.url, proxy_port, pod_port, capture)
                with _capturing() as capture:
                    single = asyncio.run(_singles(proxy.url, singles))
                    single_wire, single_noticed, _ = _latencies(
                        single, pod.url, proxy_port, pod_port, capture
                    )
                time.sleep(1.0)
                fds1, tasks1 = _open_fds(pid), _gateway_tasks(admin) if admin else None
            finally:
                proxy.stop() if target != "gateway" else proxy.__exit__(None, None, None)
    finally:
        pod.stop()
    return {
        "target": target,
        "clients": 2 * clients,
        "aborts_seen": seen,
        "wire_measured": len(wire),
        "burst_p50_ms": percentile(wire, 50) if wire else None,
        "burst_p99_ms": percentile(wire, 99) if wire else None,
        "burst_noticed_p50_ms": percentile(noticed, 50),
        "burst_noticed_p99_ms": percentile(noticed, 99),
        "single_p50_ms": percentile(single_wire, 50) if single_wire else None,
        "single_p99_ms": percentile(single_wire, 99) if single_wire else None,
        "single_noticed_p50_ms": percentile(single_noticed, 50),
        "single_noticed_p99_ms": percentile(single_noticed, 99),
        "fds_before": fds0,
        "fds_after": fds1,
        "tasks_before": tasks0,
        "tasks_after": tasks1,
    }


def render(results: list[dict[str, Any]], command: str, pin: bool) -> str:
    fmt = lambda v: "—" if v is None else f"{v:.2f}"  # noqa: E731
    lines = [
        f"Command: `{command}`  ",
        f"Machine: {machine_summary(pin)}",
        "",
        "| target | clients that left | pod saw abort | burst close→abort p50 ms | p99 ms "
        "| single p50 ms | single p99 ms | pod noticed: burst p50 / p99 ms | single p50 / p99 ms "
        "| fds before → after | tasks before → after |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        tasks = "—" if r["tasks_before"] is None else f"{r['tasks_before']} → {r['tasks_after']}"
        lines.append(
            f"| {r['target']} | {r['clients']} | {r['aborts_seen']} | {fmt(r['burst_p50_ms'])} | "
            f"{fmt(r['burst_p99_ms'])} | {fmt(r['single_p50_ms'])} | {fmt(r['single_p99_ms'])} | "
            f"{fmt(r['burst_noticed_p50_ms'])} / {fmt(r['burst_noticed_p99_ms'])} | "
            f"{fmt(r['single_noticed_p50_ms'])} / {fmt(r['single_noticed_p99_ms'])} | "
            f"{r['fds_before']} → {r['fds_after']} | {tasks} |"
        )
    if any(r["burst_p50_ms"] is None for r in results):
        lines += ["", "No packet capture here (it needs CAP_NET_RAW): only the pod's own view is shown."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_disconnects", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--clients", type=int, default=500, help="clients per kind (mid-stream, waiting)")
    parser.add_argument("--singles", type=int, default=20, help="one-at-a-time disconnects")
    parser.add_argument("--target", default="gateway,nginx")
    parser.add_argument("--no-pin", action="store_true")
    parser.add_argument("--write-md", metavar="FILE")
    args = parser.parse_args(argv)
    raise_open_file_limit()
    pin = not args.no_pin and len(os.sched_getaffinity(0)) >= 2
    if pin:
        os.sched_setaffinity(0, {0})
    targets = [t for t in args.target.split(",") if t != "nginx" or nginx_binary()]
    results = []
    for target in targets:
        result = run_target(target, args.clients, args.singles, pin)
        print(f"bench_disconnects: {json.dumps(result)}", file=sys.stderr, flush=True)
        results.append(result)
    command = command_line("loadtest.bench_disconnects", argv)
    publish(render(results, command, pin), args.write_md, "disconnects")
    ok = all(r["aborts_seen"] == r["clients"] for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
