"""Start the gateway as a real child process and wait for it to listen (tests, bench, soak).

The gateway prints ``sluicegate listening on http://HOST:PORT`` on stdout once its socket is
bound and its first discovery round is done; waiting for that line is an event, not a poll. The
admin listener's line (``sluicegate admin listening on ...``) follows the public ones.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO, Any

import yaml

READY_PREFIX = "sluicegate listening on "
ADMIN_PREFIX = "sluicegate admin listening on "


class GatewayProcess:
    """``sluicegate serve`` on a free port with the given config (a dict, written to a temp file).

    ``url`` is the public listener's, ``admin_url`` the admin plane's (``/admin/*``, ``/metrics``),
    also on a free port unless the config names ``admin.port``."""

    def __init__(
        self,
        config: dict[str, Any],
        *,
        extra_args: list[str] | None = None,
        cpu: int | None = None,
        startup_timeout_s: float = 30.0,
        command_prefix: list[str] | None = None,
    ) -> None:
        self.config = config
        self.extra_args = extra_args or []
        self.cpu = cpu
        self.command_prefix = command_prefix or []  # a wrapper to run it under (valgrind, perf, ...)
        self.startup_timeout_s = startup_timeout_s
        self.url = ""
        self.admin_url = ""
        self.proc: subprocess.Popen[str] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="sluicegate-")
        self.log_path = Path(self._dir.name) / "gateway.log"
        self._log: IO[str] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> GatewayProcess:
        config_path = Path(self._dir.name) / "config.yaml"
        config = {**self.config, "server": {**self.config.get("server", {}), "port": 0}}
        # Tests and benchmarks of other features run without keys unless their config names auth.
        config.setdefault("auth", {"enabled": False})
        # Parallel gateways must not all want the admin port's default (9090).
        config["admin"] = {"port": 0, **config.get("admin", {})}
        config_path.write_text(yaml.safe_dump(config))
        argv = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config_path), *self.extra_args]
        if self.cpu is not None:
            argv = ["taskset", "-c", str(self.cpu), *argv]
        argv = [*self.command_prefix, *argv]
        self._log = self.log_path.open("w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)
        line = _read_line_within(self.proc.stdout, self.startup_timeout_s)
        if not line.startswith(READY_PREFIX):
            self.stop()
            raise RuntimeError(
                f"gateway did not start (exit {self.proc.returncode}); its log:\n{self.log_path.read_text()}"
            )
        self.url = line[len(READY_PREFIX) :].strip()
        if config["admin"].get("enabled", True):
            while line and not line.startswith(ADMIN_PREFIX):  # the public listeners' lines first
                line = _read_line_within(self.proc.stdout, self.startup_timeout_s)
            if not line:
                self.stop()
                log = self.log_path.read_text()
                raise RuntimeError(f"gateway announced no admin listener; its log:\n{log}")
            self.admin_url = line[len(ADMIN_PREFIX) :].strip()
        threading.Thread(target=_drain, args=(self.proc.stdout,), daemon=True).start()
        return self

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited in time; returns the exit code."""
        if self.proc is None:
            return None
        code = terminate(self.proc, timeout_s)
        if self._log is not None:
            self._log.close()
        return code

    def log(self) -> str:
        return self.log_path.read_text()

    def __enter__(self) -> GatewayProcess:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()
        self._dir.cleanup()


def terminate(proc: subprocess.Popen[Any], timeout_s: float = 10.0) -> int:
    """Stop a child politely (SIGTERM), forcefully (SIGKILL) after ``timeout_s``; its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def free_tcp_and_udp_port() -> int:
    """A port number free for both TCP and UDP on loopback (a TLS listener and its HTTP/3 twin), below
    the kernel's ephemeral range so that no listener on port 0 (the gateway's cleartext one, a pod) can
    be given it meanwhile."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as tcp, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            try:
                tcp.bind(("127.0.0.1", port))
                udp.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


def _read_line_within(stream: IO[str] | None, timeout_s: float) -> str:
    """One line from ``stream``, or "" if none arrives in time (or the process exits first)."""
    result: list[str] = []
    reader = threading.Thread(target=lambda: result.append(stream.readline() if stream else ""), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return result[0] if result else ""


def _drain(stream: IO[str] | None) -> None:
    if stream is not None:
        for _ in stream:
            pass
