"""A real Debian ``redis-server`` for tests and benchmarks: started on a free loopback port, nothing
persisted. It lives in ``loadtest`` because benchmarks must not import ``tests``;
``tests/redis_server.py`` adds pytest's skip when the binary is missing.

Usable as a context manager (``with RedisServer() as redis: ...``), from a pytest fixture, from a
system test that runs several gateways against one server, or from a benchmark. Faults are the real
thing: ``pause()`` is SIGSTOP (connections are accepted by the kernel, nothing answers: Redis
"slow"), ``stop()`` ends the process (connections refused: Redis "down"), ``start()`` brings it back
on the same port, empty, as a restarted Redis without persistence would be.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from types import TracebackType

READY = b"Ready to accept connections"
MISSING = "redis-server is not installed (apt-get install redis-server; make test does it as root)"


def redis_server_binary() -> str | None:
    return shutil.which("redis-server")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """One redis-server process on ``127.0.0.1:port`` (a free port unless given)."""

    def __init__(self, port: int | None = None, start_timeout_s: float = 10.0) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError(MISSING)
        self.binary = binary
        self.port = port if port is not None else _free_port()
        self.start_timeout_s = start_timeout_s
        self.process: subprocess.Popen[bytes] | None = None
        self.paused = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> RedisServer:
        """Start (or restart, on the same port) and return once it accepts connections: its own
        "Ready to accept connections" log line, not a polling loop."""
        if self.running:
            return self
        command = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--loglevel", "notice",
            "--logfile", "",
        ]  # fmt: skip
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert process.stdout is not None
        ready = threading.Event()
        lines: list[bytes] = []

        def drain() -> None:
            # Keeps reading after the ready line, so Redis never blocks on a full log pipe.
            assert process.stdout is not None
            for line in process.stdout:
                if len(lines) < 200:
                    lines.append(line)
                if READY in line:
                    ready.set()
            ready.set()  # exited

        threading.Thread(target=drain, name=f"redis-{self.port}-log", daemon=True).start()
        if not ready.wait(self.start_timeout_s) or process.poll() is not None:
            process.kill()
            process.wait()
            raise RuntimeError(
                f"redis-server on port {self.port} did not start:\n" + b"".join(lines).decode()
            )
        self.process = process
        self.paused = False
        return self

    def pause(self) -> None:
        """SIGSTOP: the port stays open, every command hangs (a Redis stuck or very slow)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        """SIGCONT: it answers again, with everything it held."""
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)
        self.paused = False

    def stop(self) -> None:
        """End the process (SIGKILL, as a crash would; nothing is persisted anyway)."""
        process, self.process = self.process, None
        if process is None:
            return
        if self.paused:
            os.kill(process.pid, signal.SIGCONT)
            self.paused = False
        process.kill()
        process.wait(timeout=10)

    def restart(self) -> RedisServer:
        self.stop()
        deadline = time.monotonic() + self.start_timeout_s
        while True:  # the port may linger for a moment after the kill
            try:
                return self.start()
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise

    def command(self, *args: str) -> object:
        """One command with the synchronous client (for assertions; not used while paused)."""
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)
        try:
            return client.execute_command(*args)
        finally:
            client.close()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
