"""Run the gateway under uvicorn (uvloop + httptools: the cheapest HTTP/1.1 path measured here)."""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn

from gateway.app import Gateway
from gateway.config import Config
from gateway.rlimits import raise_open_file_limit

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str = "info") -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)


class Server(uvicorn.Server):
    """uvicorn's server plus an event set once its sockets are bound (no polling for readiness)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.listening = asyncio.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
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
        http="httptools",
        lifespan="on",
        access_log=False,
        log_config=None,
        log_level=log_level,
        timeout_keep_alive=30,
        backlog=4096,
        server_header=False,
    )
    return Server(uv_config)


def serve(config: Config, log_level: str = "info") -> None:
    raise_open_file_limit()
    build_server(config, log_level).run()
