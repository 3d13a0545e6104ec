"""The floor: the least a Python relay on uvloop can cost, measured beside nginx and the gateway.

Issue 14 asks whether Python itself is what keeps the gateway at ~2x nginx's CPU. This relay answers
it: one process on uvloop, one ``asyncio.Protocol`` per client and per pod connection, a keep-alive
pool of pod connections, the request forwarded as received and every pod read written to the client
as it is. No features, no parsing of the answer beyond finding its chunked end, no error handling
worth the name: it relays the pod simulator's streamed answers and nothing else, so it is a
measuring stick (one of ``make bench``'s targets), never a proxy to deploy.

Whatever the gateway costs beyond this floor is its own Python per request and per read, not the
interpreter's or uvloop's price for moving bytes.
"""

from __future__ import annotations

import argparse
import asyncio

import uvloop

from loadtest.announced import AnnouncedServer, StartError

READY_PREFIX = "floor listening on "
_CHUNKED_END = b"\r\n0\r\n\r\n"  # a chunked body's last chunk, after the data chunk's own CRLF
_CONNECTING: set[asyncio.Future[None]] = set()


class _PodSide(asyncio.Protocol):
    """One keep-alive connection to the pod; while serving a client, its bytes go straight there."""

    def __init__(self, pool: list[_PodSide]) -> None:
        self.pool = pool
        self.client: asyncio.Transport | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        client = self.client
        if client is None:
            return
        client.write(data)
        if data.endswith(_CHUNKED_END):
            self.client = None
            self.pool.append(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.pool:
            self.pool.remove(self)


class _ClientSide(asyncio.Protocol):
    """One client connection: whole requests (head and Content-Length body) go to a pooled pod connection."""

    def __init__(self, pod: tuple[str, int], pool: list[_PodSide]) -> None:
        self.pod = pod
        self.pool = pool
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) != -1:
            head = self.buffer[:end].lower()
            at = head.find(b"content-length:")
            length = int(head[at + 15 :].split(b"\r\n", 1)[0]) if at != -1 else 0
            if len(self.buffer) < end + 4 + length:
                return
            request, self.buffer = self.buffer[: end + 4 + length], self.buffer[end + 4 + length :]
            if self.pool:
                self._forward(self.pool.pop(), request)
            else:
                connecting = asyncio.ensure_future(self._connect_and_forward(request))
                _CONNECTING.add(connecting)  # held until done: the loop keeps only a weak reference
                connecting.add_done_callback(_CONNECTING.discard)

    async def _connect_and_forward(self, request: bytes) -> None:
        pool = self.pool
        _, pod = await asyncio.get_running_loop().create_connection(lambda: _PodSide(pool), *self.pod)
        self._forward(pod, request)

    def _forward(self, pod: _PodSide, request: bytes) -> None:
        assert pod.transport is not None
        pod.client = self.transport
        pod.transport.write(request)


async def serve(host: str, port: int, pod: tuple[str, int]) -> None:
    pool: list[_PodSide] = []
    server = await asyncio.get_running_loop().create_server(
        lambda: _ClientSide(pod, pool), host, port, backlog=4096
    )
    bound_host, bound_port = server.sockets[0].getsockname()[:2]
    print(f"{READY_PREFIX}http://{bound_host}:{bound_port}", flush=True)
    await server.serve_forever()


class FloorStartError(StartError):
    """The floor relay exited or stayed silent instead of announcing its address."""


class FloorProcess(AnnouncedServer):
    """``python -m loadtest.floor UPSTREAM`` (see :class:`AnnouncedServer`), e.g. pinned with
    ``command_prefix=["taskset", "-c", "1"]``."""

    module = "loadtest.floor"
    ready_prefix = READY_PREFIX
    start_error = FloorStartError


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.floor", description=__doc__.split("\n\n")[0])
    parser.add_argument("upstream", help="the pod, http://HOST:PORT")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: one the kernel picks (announced on stdout)")
    args = parser.parse_args()
    host, _, port = args.upstream.removeprefix("http://").rstrip("/").partition(":")
    uvloop.run(serve(args.host, args.port, (host, int(port))))


if __name__ == "__main__":
    main()
