"""A private ``redis-server`` for the workers of one host, when the config shares state (quotas,
leases, canary rollouts) but names no Redis: started on a Unix socket in the supervisor's private
directory, nothing persisted, stopped with the supervisor. Workers are replicas on one host, and
this is how replicas agree (``gateway.quota.redis_store``, ``gateway.canary.shared``).

A supervisor killed outright (``SIGKILL``, the OOM killer) cannot stop it, so the kernel does: it
is started through util-linux's ``setpriv --pdeathsig``, and gets a SIGTERM when the supervisor
dies, however it dies. Without ``setpriv`` (not Debian's util-linux) it is started plainly."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from gateway.config import Config, ConfigError

MISSING = (
    "--workers N with quotas, API keys or canary rollouts shares their state through Redis, and neither "
    "quotas.redis_url is set nor redis-server installed: set quotas.redis_url, install redis-server "
    "(apt-get install redis-server), or run --workers 1"
)


def needs_shared_state(config: Config) -> bool:
    """Whether workers must agree on counters or a rollout: any quota (a tier's, the default, or a
    key's: with auth on, the key store may give any key one at a reload), or a rollout plan."""
    quotas = config.quotas.default is not None or any(t.quota is not None for t in config.tiers.values())
    rollouts = any(route.rollout is not None for route in config.routes.values())
    return quotas or config.auth.enabled or rollouts


class LocalRedis:
    """``redis-server --port 0 --unixsocket DIR/redis.sock``: no TCP port, no files."""

    def __init__(self, directory: str, start_timeout_s: float = 10.0) -> None:
        self.path = str(Path(directory) / "redis.sock")
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.path}"

    def start(self) -> str:
        """Start it and wait until it answers PING; its ``unix://`` URL. ``ConfigError`` (the fixes,
        in one line) when redis-server is not installed."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise ConfigError(MISSING)
        self.proc = subprocess.Popen(
            [*_dies_with_us(), binary, "--port", "0", "--unixsocket", self.path, "--unixsocketperm", "700",
             "--save", "", "--appendonly", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
        )
        import redis  # here, not at the top: a `serve` that never starts one does not load redis-py

        client = redis.Redis(unix_socket_path=self.path, socket_timeout=0.5)
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while True:
                if self.proc.poll() is not None:
                    raise ConfigError(
                        f"the workers' private redis-server exited at start ({self.proc.returncode})"
                    )
                try:
                    if client.ping():
                        return self.url
                except (redis.ConnectionError, redis.TimeoutError, OSError):
                    pass
                if time.monotonic() > deadline:
                    raise ConfigError(
                        f"the workers' private redis-server did not answer in {self.start_timeout_s:g} s"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def _dies_with_us() -> list[str]:
    """The command prefix that has the kernel send the server SIGTERM when this process dies (its
    parent-death signal, which ``exec`` keeps); none where ``setpriv`` is missing. A ``preexec_fn``
    calling ``prctl`` would do the same without it, but is unsafe in a process running threads."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "SIGTERM", "--"] if setpriv is not None else []
