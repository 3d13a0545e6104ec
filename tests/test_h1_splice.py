"""The relay's HTTP/1.1 splice (``transports.client_socket.ClientSocket``): each pod read is framed as
a chunk and written to the client's transport from the pod connection's callback, except the read
that ends the stream (``data: [DONE]``), which waits for the response's final message so that it
and the terminating chunk leave in one write, as nginx sends them."""

from __future__ import annotations

import gc
import json
import socket
from urllib.parse import urlsplit

from gateway.completeness import FinishWatch
from gateway.resume import Recorder
from gateway.usage import UsageTap
from tests.conftest import Fleet
from tests.exchanges import exchange
from transports.client_socket import ClientSocket


class _Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return False


class _Flow:
    write_paused = False


class _Pod:
    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...
    def close(self) -> None: ...


def _splice() -> tuple[ClientSocket, _Transport]:
    transport = _Transport()
    return ClientSocket(transport, _Flow()), transport  # type: ignore[arg-type]


def test_the_last_read_is_held_for_the_final_message() -> None:
    target, transport = _splice()
    sink = target.writer(_Pod())
    sink(b"data: {\"a\": 1}\n\n")
    sink(b"data: {\"b\": 2}\n\ndata: [DONE]\n\n")
    assert transport.writes == [b"10\r\ndata: {\"a\": 1}\n\n\r\n"]  # 16 bytes, in chunked framing
    assert target.take_tail() == b"data: {\"b\": 2}\n\ndata: [DONE]\n\n"
    assert target.take_tail() == b""  # given once


def test_a_read_after_the_last_event_keeps_the_order() -> None:
    target, transport = _splice()
    sink = target.writer(_Pod())
    sink(b"data: [DONE]\n\n")
    sink(b"data: late\n\n")  # a pod that went on: the held read goes out first
    assert transport.writes == [b"e\r\ndata: [DONE]\n\n\r\n", b"c\r\ndata: late\n\n\r\n"]
    assert target.take_tail() == b""


def test_a_finished_stream_s_sinks_leave_nothing_for_the_garbage_collector() -> None:
    """Every read passes through a chain of sinks (the finish watch, the recorder, the usage tap, the
    client's socket). Once a stream lets go of them, reference counting frees them and what they hold:
    none is a cycle. The request path is compiled, and compiled, a closure sits in a cycle with its
    own variables; with the collector's young generation at 50,000 allocations, 2000 finished
    streams' objects (~20 MB) were still held when the next 2000 started."""
    ex = exchange(usage_injected=True)
    gc.collect()
    gc.disable()
    try:
        target, transport = _splice()
        sink = FinishWatch().wrap(Recorder().sink(target.writer(_Pod()), None, UsageTap(ex)))
        for word in ("a", "b"):
            sink(b'data: {"choices":[{"index":0,"delta":{"content":"%s"}}]}\n\n' % word.encode())
        sink(b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\ndata: [DONE]\n\n')
        assert len(transport.writes) == 2 and target.take_tail().endswith(b"data: [DONE]\n\n")
        del sink, target, transport
        assert gc.collect() == 0
    finally:
        gc.enable()


def test_the_stream_ends_with_its_last_event_and_the_terminating_chunk_together(fleet: Fleet) -> None:
    """On the wire, through uvicorn: the bytes after the head are the stream's chunks, and the one
    holding ``[DONE]`` is directly followed by the zero-length chunk, in the same read."""
    parts = urlsplit(fleet.url)
    body = json.dumps({"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 5, "stream": True}).encode()
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%b" % (len(body), body))
        reads = []
        while not reads or not reads[-1].endswith(b"0\r\n\r\n"):
            data = sock.recv(65536)
            assert data, b"".join(reads)
            reads.append(data)
    everything = b"".join(reads)
    assert everything.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in everything
    assert reads[-1].endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    assert everything.count(b"data: [DONE]") == 1
