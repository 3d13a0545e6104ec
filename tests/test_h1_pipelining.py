"""HTTP/1.1 pipelining through the gateway: requests sent back to back on one connection, before any
answer, are answered whole and in order (uvicorn queues them; the gateway's protocol keeps that
queue in a list, ``transports/h1_disconnect._Pipeline``)."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

from tests.conftest import Fleet


def _request(max_tokens: int, stream: bool) -> bytes:
    body = json.dumps({"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": max_tokens, "stream": stream}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%b" % (len(body), body))


def _read_answers(sock: socket.socket, count: int) -> list[bytes]:
    """``count`` whole HTTP/1.1 answers (chunked or with a length), as they came."""
    data = b""
    answers: list[bytes] = []
    while len(answers) < count:
        while b"\r\n\r\n" not in data:
            more = sock.recv(65536)
            assert more, (answers, data)
            data += more
        head, _, rest = data.partition(b"\r\n\r\n")
        if b"transfer-encoding: chunked" in head.lower():
            while b"\r\n0\r\n\r\n" not in rest and not rest.startswith(b"0\r\n\r\n"):
                more = sock.recv(65536)
                assert more, (answers, data)
                rest += more
            end = rest.index(b"0\r\n\r\n") + 5
        else:
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            while len(rest) < length:
                more = sock.recv(65536)
                assert more, (answers, data)
                rest += more
            end = length
        answers.append(head + b"\r\n\r\n" + rest[:end])
        data = rest[end:]
    return answers


def test_pipelined_requests_are_answered_whole_and_in_order(fleet: Fleet) -> None:
    parts = urlsplit(fleet.url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(_request(3, stream=True) + _request(2, stream=False) + _request(5, stream=True))
        first, second, third = _read_answers(sock, 3)
    for answer in (first, second, third):
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert first.count(b'"content":') == 3 + 1 and b"data: [DONE]" in first  # role chunk + 3 tokens
    assert json.loads(second.partition(b"\r\n\r\n")[2])["usage"]["completion_tokens"] == 2
    assert third.count(b'"content":') == 5 + 1 and b"data: [DONE]" in third
