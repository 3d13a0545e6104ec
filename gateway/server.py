"""Run the gateway under uvicorn (uvloop + httptools: the cheapest HTTP/1.1 path measured here)."""

from __future__ import annotations

import asyncio
import logging
import socket
from types import FrameType

import uvicorn

from gateway.app import Gateway
from gateway.config import Config
from gateway.rlimits import raise_open_file_limit
from transports.h1_disconnect import PromptH1Protocol

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str = "info") -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)


class Server(uvicorn.Server):
    """uvicorn's server plus readiness as an event and a graceful drain on SIGTERM/SIGINT.

    uvicorn on its own stops listening at the first signal (new clients are refused, not told to
    retry) and re-raises the signal after shutdown (exit status -15, not 0). Here the first signal
    starts the gateway's drain with the listener still open (``/readyz`` 503, new requests 503 with
    Retry-After, streams in flight run on until the drain deadline); then uvicorn shuts down as
    usual and the process exits 0. A second signal exits at once.
    """

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.listening = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        app = self.config.app
        if self._draining or self._loop is None or not isinstance(app, Gateway):
            if self.should_exit:
                self.force_exit = True
            self.should_exit = True
            return
        self._draining = True
        self._loop.call_soon_threadsafe(self._start_drain, app)

    def _start_drain(self, app: Gateway) -> None:
        async def drain_then_exit() -> None:
            await app.drain()
            self.should_exit = True

        self._drain_task = asyncio.ensure_future(drain_then_exit())

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            # One machine-readable line on stdout: launchers wait for it instead of polling.
            print(f"sluicegate listening on http://{host}:{port}", flush=True)
            self.listening.set()


def build_server(config: Config, log_level: str = "info") -> Server:
    """A uvicorn server for ``config``; uvicorn's own access log is off (the gateway writes its own)."""
    app = Gateway(config)
    uv_config = uvicorn.Config(
        app,
        host=config.server.host,
        port=config.server.port,
        loop="uvloop",
        http=PromptH1Protocol,
        lifespan="on",
        access_log=False,
        log_config=None,
        log_level=log_level,
        timeout_keep_alive=30,
        backlog=4096,
        server_header=False,
        timeout_graceful_shutdown=5,
    )
    return Server(uv_config)


def serve(config: Config, log_level: str = "info") -> None:
    raise_open_file_limit()
    build_server(config, log_level).run()
