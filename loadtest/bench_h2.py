"""HTTP/2 against nginx's own HTTP/2: CPU per token and burst time to first byte, in one run.

One pod simulator (256 tokens at 5 ms a token by default), the gateway (every feature on, as
``make bench``'s ``gateway`` target) and nginx (``http2``, ``proxy_buffering off``, keep-alive
upstream), each listening for cleartext h2c (prior knowledge) and for HTTP/2 over TLS. As in
``loadtest/bench.py``, the proxies are pinned to core 1 and the pod and the load to core 0, and a
proxy's cost is its processes' utime + stime from ``/proc`` around the load (nginx's master and
worker summed), per 1000 tokens relayed.

Two loads per target, one after the other:

- **h2load** (nghttp2's independent load tool, ``/usr/bin/h2load``): ``-c CLIENTS -m STREAMS`` and a
  POST body file. Its time to first byte (per connection: from connecting to the first byte of the
  connection's first response, i.e. the burst's first token, since the gateway holds the status line
  until then) and req/s are its own figures. h2load does not show bodies, so its tokens are counted
  as succeeded requests x ``max_tokens``; our own client checks that bodies are whole.
- **our client** (``H2Client`` from ``loadtest/bench_transports.py``, the h2 state machine on an
  asyncio protocol): the same load shape; every stream's body must carry ``max_tokens`` content
  tokens and ``[DONE]`` (else it counts as an error), and tokens are counted from those bytes.

    python -m loadtest.bench_h2 [--clients 4] [--streams 25] [--requests 300] [--tokens 256]
                                [--repeats 2] [--write-md FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import h2.events

from loadtest.bench import (
    LOAD_CORE,
    MODEL,
    PROXY_CORE,
    Scenario,
    auth_headers,
    can_pin,
    cpu_delta_s,
    cpu_ticks,
    gateway_config,
    pin_prefix,
    process_tree,
    start_gateway,
    start_pod,
)
from loadtest.bench_scale import _TIME, _ms
from loadtest.bench_transports import H2Client, _insecure_context
from loadtest.loadgen import DONE_MARKER, count_tokens
from loadtest.nginx import NginxProcess
from loadtest.procs import GatewayProcess, free_tcp_and_udp_port
from loadtest.report import command_line, publish
from transports.tls import self_signed

PATH = "/v1/chat/completions"
H2LOAD = shutil.which("h2load") or "/usr/bin/h2load"
TARGETS = ("gateway h2c", "gateway h2 (TLS)", "nginx h2c", "nginx h2 (TLS)")


def chat_body(tokens: int) -> bytes:
    return json.dumps({
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": tokens, "ignore_eos": True, "stream": True,
    }).encode()


# --------------------------------------------------------------------------- h2load


def parse_h2load(text: str) -> dict[str, Any]:
    """h2load's summary: succeeded and failed requests, req/s, mean time to first byte (ms)."""
    finished = re.search(r"finished in [\d.]+\w+, ([\d.]+) req/s", text)
    requests = re.search(r"requests: \d+ total, \d+ started, (\d+) done", text)
    codes = re.search(r"status codes: (\d+) 2xx", text)
    ttfb = re.search(r"time to 1st byte:" + _TIME * 3, text)
    if not (finished and requests and codes and ttfb):
        raise RuntimeError(f"h2load printed no summary: {text[-1500:]}")
    done = int(requests.group(1))
    # a timed run (-D) counts the status of a request still streaming at its end, not yet done
    ok = min(int(codes.group(1)), done)
    return {  # h2load counts a reset stream as failed, errored and done alike: not added up
        "ok": ok, "errors": done - ok,
        "req_s": float(finished.group(1)), "ttfb_ms": _ms(*ttfb.groups()[4:6]),
    }


def run_h2load(url: str, body_file: Path, headers: dict[str, str], args: argparse.Namespace,
               pin: bool, requests: int | None = None) -> dict[str, Any]:
    argv = [*pin_prefix(LOAD_CORE, pin), H2LOAD, "-c", str(args.clients), "-m", str(args.streams),
            "-n", str(requests or args.requests), "-d", str(body_file),
            "-H", "content-type: application/json",
            *(item for name, value in headers.items() for item in ("-H", f"{name}: {value}")), url]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    return parse_h2load(done.stdout + done.stderr)


# --------------------------------------------------------------------------- our client


class CheckingClient(H2Client):
    """``H2Client``, keeping every stream's body (to check it is whole) and sending ``extra`` headers
    (the API key) with each request; both by wrapping its h2 connection, so the client is not copied."""

    extra: list[tuple[bytes, bytes]] = []

    def __init__(self) -> None:
        super().__init__()
        self.bodies: dict[int, bytearray] = {}
        conn = self.conn
        receive, send_headers = conn.receive_data, conn.send_headers

        def receive_data(data: bytes) -> list[h2.events.Event]:
            events = receive(data)
            for event in events:
                if isinstance(event, h2.events.DataReceived) and event.data:
                    self.bodies.setdefault(event.stream_id, bytearray()).extend(event.data)
            return events

        def with_extra(stream_id: int, headers: list[tuple[bytes, bytes]], **kw: Any) -> None:
            send_headers(stream_id, [*headers, *self.extra], **kw)

        conn.receive_data = receive_data  # type: ignore[method-assign]
        conn.send_headers = with_extra  # type: ignore[method-assign]


async def run_ours(host: str, port: int, tls: bool, headers: dict[str, str],
                   args: argparse.Namespace) -> dict[str, Any]:
    """``clients`` connections x ``streams`` concurrent streams, ``requests`` in all; tokens counted
    from the bodies, a body without ``max_tokens`` tokens and ``[DONE]`` counted as an error."""
    CheckingClient.extra = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    context = _insecure_context(["h2"]) if tls else None
    clients = [await CheckingClient.connect(host, port, context) for _ in range(args.clients)]
    body = chat_body(args.tokens)
    authority = f"{host}:{port}"
    left = [args.requests]
    firsts: list[float] = []
    errors: list[str] = []

    async def lane(client: CheckingClient) -> None:
        while left[0] > 0:
            left[0] -= 1
            started = time.perf_counter()
            try:
                status = await client.post(authority, PATH, body,
                                           lambda t=started: firsts.append(time.perf_counter() - t))
                if status != 200:
                    errors.append(f"HTTP {status}")
            except ConnectionError as exc:
                errors.append(str(exc))

    began = time.perf_counter()
    await asyncio.gather(*(lane(c) for c in clients for _ in range(args.streams)))
    wall = time.perf_counter() - began
    tokens = ok = 0
    for client in clients:
        for data in client.bodies.values():
            found = count_tokens(bytes(data))
            if found == args.tokens and DONE_MARKER in data:
                ok += 1
                tokens += found
            else:
                errors.append(f"{found} tokens{'' if DONE_MARKER in data else ', no [DONE]'}")
        client.close()
    # a refused or broken request is in both lists (its status, then its body): count requests
    return {"ok": ok, "errors": args.requests - ok, "error_samples": errors[:3], "tokens": tokens,
            "req_s": ok / wall if wall else 0.0,
            "ttfb_ms": 1000 * statistics.mean(firsts) if firsts else None}


# --------------------------------------------------------------------------- one run


def measure(target: str, tool: str, url: str, pids_of: Any, body_file: Path, headers: dict[str, str],
            args: argparse.Namespace, pin: bool) -> dict[str, Any]:
    """One load through one target: the tool's figures and the proxy's CPU-ms per 1000 tokens."""
    pids = pids_of()
    before = cpu_ticks(pids)
    if tool == "h2load":
        result = run_h2load(url, body_file, headers, args, pin)
        result["tokens"] = result["ok"] * args.tokens
    else:
        host_port = url.split("//", 1)[1].split("/", 1)[0]
        host, _, port = host_port.rpartition(":")
        result = asyncio.run(run_ours(host, int(port), url.startswith("https"), headers, args))
    user, system = cpu_delta_s(before, cpu_ticks(pids_of()))
    result.update(target=target, tool=tool, cpu_s=user + system,
                  cpu_ms_per_1k=(user + system) * 1e6 / result["tokens"] if result["tokens"] else None)
    return result


def run(args: argparse.Namespace, pin: bool) -> list[dict[str, Any]]:
    scenario = Scenario("h2", "HTTP/2", args.clients * args.streams, 1, args.tokens, itl_ms=args.itl_ms)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-h2-") as tmp:
        work = Path(tmp)
        cert, key = self_signed(tmp)
        body_file = work / "body.json"
        body_file.write_bytes(chat_body(args.tokens))
        warm_file = work / "warm.json"
        warm_file.write_bytes(chat_body(2))
        pod = start_pod(scenario, pin)
        gateway: GatewayProcess | None = None
        nginx: NginxProcess | None = None
        try:
            config, api_key = gateway_config(pod.url, work / "keys.yaml", features=True)
            tls_port = free_tcp_and_udp_port()
            config["server"] = {"host": "127.0.0.1",
                                "tls": {"cert": str(cert), "key": str(key), "port": tls_port, "h3": False}}
            gateway = start_gateway(pod.url, pin, config)
            nginx = NginxProcess(pod.url, work / "nginx", command_prefix=pin_prefix(PROXY_CORE, pin),
                                 http2=True, tls_files=(cert, key)).start()
            gw_headers = auth_headers(api_key)
            urls = {
                "gateway h2c": (gateway.url + PATH, gateway.pid, gw_headers),
                "gateway h2 (TLS)": (f"https://127.0.0.1:{tls_port}{PATH}", gateway.pid, gw_headers),
                "nginx h2c": (f"http://127.0.0.1:{nginx.h2c_port}{PATH}", nginx.pid, {}),
                "nginx h2 (TLS)": (f"https://127.0.0.1:{nginx.tls_port}{PATH}", nginx.pid, {}),
            }
            for repeat in range(args.repeats):
                for target in args.targets:
                    url, pid, headers = urls[target]
                    # warm: the proxy's upstream pool holds as many connections as the load needs
                    warm = run_h2load(url, warm_file, headers, args, pin,
                                      requests=args.clients * args.streams)
                    if warm["errors"]:
                        raise RuntimeError(f"{target}: warm-up requests failed: {warm}")
                    for tool in ("h2load", "ours"):
                        row = measure(target, tool, url, lambda pid=pid: process_tree(pid), body_file,
                                      headers, args, pin)
                        row["repeat"] = repeat
                        results.append(row)
                        print(_progress(row), file=sys.stderr)
        finally:
            if nginx is not None:
                nginx.stop()
            if gateway is not None:
                gateway.__exit__(None, None, None)
            pod.stop()
            pod.close()
    return results


def _progress(row: dict[str, Any]) -> str:
    cpu = row["cpu_ms_per_1k"]
    return (f"bench_h2: {row['target']} / {row['tool']} #{row['repeat']}: "
            f"{'-' if cpu is None else f'{cpu:.1f}'} CPU-ms/1k tokens, TTFB {row['ttfb_ms'] or 0:.1f} ms, "
            f"{row['req_s']:.1f} req/s, {row['errors']} errors")


# --------------------------------------------------------------------------- report


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def render(results: list[dict[str, Any]], command: str, args: argparse.Namespace) -> str:
    lines = [
        f"Command: `{command}`  ",
        f"One pod ({args.tokens} tokens at {args.itl_ms:g} ms a token); {args.clients} connections x "
        f"{args.streams} concurrent streams, {args.requests} requests per load; medians of "
        f"{args.repeats} repeats. CPU: the proxy's utime + stime (nginx: master + worker) per 1000 "
        "tokens; TTFB: h2load's mean time to 1st byte (per connection), own client's mean per request.",
        "",
        "| target | load | CPU-ms / 1000 tokens | mean TTFB ms | req/s | errors | / nginx (CPU, TTFB) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["target"], r["tool"]), []).append(r)
    medians = {
        key: (_median(rows, "cpu_ms_per_1k"), _median(rows, "ttfb_ms"), _median(rows, "req_s"),
              sum(r["errors"] for r in rows))
        for key, rows in groups.items()
    }
    for target in args.targets:
        for tool in ("h2load", "ours"):
            if (target, tool) not in medians:
                continue
            cpu, ttfb, req_s, errors = medians[target, tool]
            ratio = "-"
            base = medians.get((target.replace("gateway", "nginx"), tool))
            if target.startswith("gateway") and base and base[0] and base[1] and cpu and ttfb:
                ratio = f"{cpu / base[0]:.2f}x, {ttfb / base[1]:.2f}x"
            lines.append(f"| {target} | {'h2load' if tool == 'h2load' else 'own client'} | {_f(cpu)} | "
                         f"{_f(ttfb)} | {_f(req_s)} | {errors} | {ratio} |")
    return "\n".join(lines)


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_h2", description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=4, help="HTTP/2 connections (default 4)")
    parser.add_argument("--streams", type=int, default=25, help="concurrent streams per connection (25)")
    parser.add_argument("--requests", type=int, default=300, help="requests per load (default 300)")
    parser.add_argument("--tokens", type=int, default=256, help="max_tokens of each request (256)")
    parser.add_argument("--itl-ms", type=float, default=5.0, help="the pod's time per token (5 ms)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--targets", default=",".join(TARGETS),
                        help=f"comma-separated, of: {', '.join(TARGETS)}")
    parser.add_argument("--json", metavar="FILE", help="also write every run's figures here")
    parser.add_argument("--write-md", metavar="FILE")
    args = parser.parse_args(argv)
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = [t for t in args.targets if t not in TARGETS]
    if unknown:
        parser.error(f"unknown target {unknown[0]!r}; choose from: {', '.join(TARGETS)}")
    if shutil.which(H2LOAD) is None:
        print(f"bench_h2: {H2LOAD} is missing (Debian: apt-get install nghttp2-client)", file=sys.stderr)
        return 2
    pin = can_pin()
    if pin:  # the load (h2load, our client) and the pod stay off the proxies' core
        os.sched_setaffinity(0, {LOAD_CORE})
    results = run(args, pin)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    publish(render(results, command_line("loadtest.bench_h2", argv), args), args.write_md, "h2")
    return 0


if __name__ == "__main__":
    sys.exit(main())
