"""Run a test server (the pod simulator, the fake dcgm-exporter) as a real child process.

Readiness is an event: a reader thread watches the child's stdout for its one
``NAME listening on http://HOST:PORT`` line and sets a flag the caller waits on (with a timeout
that raises, quoting the child's stderr). No sleeping, no polling of the port.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import threading
from types import TracebackType
from typing import IO, Self
from urllib.parse import urlsplit

from loadtest.procs import terminate


class StartError(RuntimeError):
    """The child exited or stayed silent instead of announcing its address."""


class AnnouncedServer:
    """``python -m MODULE ARGS`` on a kernel-chosen port unless ARGS name ``--port``.

    Subclasses name the ``module``, the ``ready_prefix`` it prints and their ``start_error``. Use as
    a context manager (``with Server([...]) as s: s.url``), from async code with ``async with``
    (start and stop run in a worker thread), or call :meth:`start`/:meth:`stop`. A stopped
    instance can be started again (on a new port when the port is chosen by the kernel).
    """

    module = ""
    ready_prefix = ""
    start_error: type[StartError] = StartError

    def __init__(
        self,
        args: list[str] | None = None,
        *,
        startup_timeout_s: float = 30.0,
        env: dict[str, str] | None = None,
        command_prefix: list[str] | None = None,
    ) -> None:
        self.args = list(args or [])
        self.startup_timeout_s = startup_timeout_s
        self.env = env
        self.command_prefix = list(command_prefix or [])  # e.g. ["taskset", "-c", "3"]
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None

    # --- properties ----------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The port the child listens on (after :meth:`start`)."""
        port = urlsplit(self.url).port
        if port is None:
            raise RuntimeError(f"{self.module} is not started")
        return port

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"{self.module} is not started")
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def argv(self) -> list[str]:
        """The command line that :meth:`start` runs."""
        args = list(self.args)
        if not any(a == "--port" or a.startswith("--port=") for a in args):
            args += ["--port", "0"]
        return [*self.command_prefix, sys.executable, "-m", self.module, *args]

    def stderr_text(self) -> str:
        """Everything the child wrote to stderr so far."""
        if self._stderr is None:
            return ""
        self._stderr.flush()
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> Self:
        """Start the child and return once it listens; raises ``start_error`` otherwise."""
        if self.running:
            raise RuntimeError(f"{self.module} is already running")
        if self._stderr is not None:  # from an earlier run
            self._stderr.close()
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 -- lives until close()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(self.env or {})}
        self.proc = subprocess.Popen(
            self.argv(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._stderr, env=env
        )
        ready = threading.Event()
        found: list[str] = []
        threading.Thread(
            target=_watch_stdout,
            args=(self.proc.stdout, self.ready_prefix, ready, found),
            name=f"{self.module}-stdout",
            daemon=True,
        ).start()
        if not ready.wait(self.startup_timeout_s) or not found:
            try:  # stdout ended without the line: the child is exiting; its code says why
                code = self.proc.wait(timeout=5.0) if ready.is_set() else self.proc.poll()
            except subprocess.TimeoutExpired:
                code = None
            self.stop(timeout_s=2.0)
            what = (
                f"exited with code {code}"
                if code is not None
                else f"did not listen in {self.startup_timeout_s}s"
            )
            name = self.module.rsplit(".", 1)[-1]
            raise self.start_error(
                f"{name} {what}: {' '.join(self.argv())}\n--- its stderr ---\n{self.stderr_text()}"
            )
        self.url = found[0]
        return self

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited in ``timeout_s``; returns the exit code."""
        proc = self.proc
        if proc is None:
            return None
        return terminate(proc, timeout_s)

    def close(self) -> None:
        """Stop and release the stderr capture."""
        self.stop()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    async def astart(self) -> Self:
        """:meth:`start` without blocking the event loop."""
        return await asyncio.to_thread(self.start)

    async def astop(self, timeout_s: float = 10.0) -> int | None:
        """:meth:`stop` without blocking the event loop."""
        return await asyncio.to_thread(self.stop, timeout_s)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return await self.astart()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await asyncio.to_thread(self.close)

    def __repr__(self) -> str:
        pid = self.proc.pid if self.proc else None
        return f"<{type(self).__name__} {self.url or 'not started'} pid={pid}>"


def _watch_stdout(stream: IO[bytes] | None, prefix: str, ready: threading.Event, found: list[str]) -> None:
    """Set ``ready`` at the listening line (or at EOF), then keep draining so the child never blocks."""
    if stream is None:
        ready.set()
        return
    try:
        for raw in stream:
            line = raw.decode(errors="replace").strip()
            if not ready.is_set() and line.startswith(prefix):
                found.append(line[len(prefix) :].strip())
                ready.set()
    finally:
        ready.set()
        stream.close()
