"""Instructions one token read costs on the gateway's spliced HTTP/1.1 path, counted exactly.

``bench_instructions``' per-token figure comes from whole loads through a gateway process, and it
moves by 3-5 % between runs of the same code (the request-level work and the event loop around
it): a change worth 2 % does not show there. This drives the per-read path alone, in one process,
through the real classes, chained as ``gateway.stream_relay.read_sink`` chains them for a resumable
stream under a quota: a pod connection parsing a chunked SSE answer (``transports.pod_client``),
the resume recorder, the usage tap and the HTTP/1.1 client sink. Only the two sockets are
stand-ins, which count the bytes written. Under callgrind, the run of ``LONG`` reads less the run
of ``SHORT`` reads, over their difference, is the path's cost a read: the same within ~0.3 % from
run to run. It leaves out uvloop's own read and write and the kernel, which every proxy pays.

    python -m loadtest.bench_readpath           # both runs under valgrind; prints instructions a read
    python -m loadtest.bench_readpath --drive N # the driven process itself: N reads, no valgrind
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import uvloop

from gateway.exchange import Exchange
from gateway.resume import Recorder
from gateway.stream_relay import read_sink
from gateway.usage import UsageTap
from loadtest.bench_instructions import callgrind_total
from transports.client_socket import ClientSocket
from transports.pod_client import PodClient, PodConnection

SHORT, LONG = 1000, 6000
# a vLLM chat chunk of one token, as the pod simulator frames it (``loadtest/podsim/wire.py``)
EVENT = (
    b'data: {"id":"chatcmpl-0123456789abcdef","object":"chat.completion.chunk","created":1732800000,'
    b'"model":"llama-3-8b","choices":[{"index":0,"delta":{"content":" token"},"logprobs":null,'
    b'"finish_reason":null}]}\n\n'
)
CHUNK = b"%x\r\n%b\r\n" % (len(EVENT), EVENT)  # as the pod sends it, and as the client gets it
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


class _Socket:
    """A transport that counts what it is given."""

    def __init__(self) -> None:
        self.written = 0

    def write(self, data: bytes) -> None:
        self.written += len(data)

    def is_closing(self) -> bool:
        return False


async def _unused_send(message: dict[str, Any]) -> None:
    raise AssertionError("the spliced path sends nothing through ASGI")


class _Flow:
    write_paused = False


async def drive(reads: int) -> int:
    """Feed ``reads`` one-token chunks through the spliced path; the bytes the client was sent."""
    # Real objects where the path keeps them (compiled, its calls check their arguments' types).
    conn = PodConnection(PodClient(1.0, 60.0), ("127.0.0.1", 1, None, None))
    conn.connection_made(_Socket())  # type: ignore[arg-type]
    resp = conn.send_request(b"", b"")
    conn.data_received(HEAD)
    exchange = Exchange("chat", "bench", _unused_send)
    exchange.admission = object()  # a quota admitted it: the tap settles usage
    client = _Socket()
    socket = ClientSocket(client, _Flow())  # type: ignore[arg-type]
    resp.splice(read_sink(socket.writer(resp), resp, Recorder(), None, UsageTap(exchange)))  # type: ignore[arg-type]
    feed = conn.data_received
    for _ in range(reads):
        feed(CHUNK)
    if resp.chunks != reads:
        raise RuntimeError(f"{resp.chunks} of {reads} reads reached the response")
    return client.written


def _count(reads: int, scratch: Path) -> int:
    """Instructions of one driven process of ``reads`` reads, under callgrind."""
    out = scratch / f"callgrind.{reads}"
    argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
            sys.executable, "-m", "loadtest.bench_readpath", "--drive", str(reads)]
    subprocess.run(argv, check=True, capture_output=True, env={**os.environ, "PYTHONHASHSEED": "0"})
    return callgrind_total(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_readpath", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--drive", type=int, metavar="N", help="run the path for N reads, no valgrind")
    args = parser.parse_args(argv)
    if args.drive is not None:
        uvloop.run(drive(args.drive))  # the gateway's loop: its clock is what ``_feed`` reads
        return 0
    if shutil.which("valgrind") is None:
        print("bench_readpath: valgrind is not installed (Debian: valgrind); skipped", file=sys.stderr)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        short, long = (_count(reads, Path(tmp)) for reads in (SHORT, LONG))
    print(f"spliced HTTP/1.1 read path: {(long - short) / (LONG - SHORT):,.0f} instructions a read "
          f"(callgrind, {SHORT} and {LONG} reads)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
