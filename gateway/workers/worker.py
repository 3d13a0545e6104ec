"""A worker's side of ``serve --workers N``: what the supervisor told it (``WorkerSpec``, from the
environment), and its link to the supervisor (``WorkerLink``): pod snapshots in, request outcomes out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import select
import shutil
import signal
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gateway.config import Config
from gateway.pods.registry import PodRegistry
from gateway.workers.feed import PodConfigs, apply_snapshot, frame, read_frame

log = logging.getLogger("sluicegate.worker")

ENV = "SLUICEGATE_WORKER"  # a JSON WorkerSpec: set by the supervisor for each worker it starts
FLUSH_S = 0.05  # outcomes travel in batches at most this late
FIRST_SNAPSHOT_S = 30.0


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker is given: its number, the supervisor's private directory (the feed socket, the
    workers' admin sockets), the ports the supervisor checked (port 0 resolved), and the Redis that
    carries the state every worker must agree on."""

    index: int
    workers: int
    dir: str
    port: int
    tls_port: int | None = None
    h3_port: int | None = None
    redis_url: str | None = None
    supervisor_pid: int = 0  # watched for the supervisor's exit (a forked worker's parent is the template)

    @property
    def feed_path(self) -> str:
        return feed_path(self.dir)

    @property
    def admin_path(self) -> str:
        return admin_path(self.dir, self.index)

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> WorkerSpec | None:
        raw = os.environ.get(ENV)
        return None if not raw else cls(**json.loads(raw))

    def apply(self, config: Config) -> Config:
        """``config`` as this worker runs it: the checked ports, one process's listeners, the shared
        Redis, and quota fallbacks that divide limits by every worker of every replica."""
        data = config.model_dump()
        server = data["server"]
        server["port"], server["workers"] = self.port, 1
        if server.get("tls") is not None and self.tls_port is not None:
            server["tls"]["port"] = self.tls_port
            if self.h3_port is not None:
                server["tls"]["h3_port"] = self.h3_port
        if self.redis_url is not None and data["quotas"]["redis_url"] is None:
            data["quotas"]["redis_url"] = self.redis_url
        data["quotas"]["replicas"] = data["quotas"]["replicas"] * self.workers
        return Config.model_validate(data)


def feed_path(directory: str) -> str:
    return str(Path(directory) / "feed.sock")


ADMIN_SOCKET_PREFIX = "worker-"


def admin_path(directory: str, index: int) -> str:
    return str(Path(directory) / f"{ADMIN_SOCKET_PREFIX}{index}.sock")


def leave_the_directory(spec: WorkerSpec) -> None:
    """A worker leaving after its supervisor died: remove its admin socket and, the last worker out,
    the supervisor's directory (the feed socket, the private Redis's). A supervisor that was killed
    could not remove it. While the worker template lives it removes the directory itself; this is
    for when it does not (workers exec'd, or the template died)."""
    with contextlib.suppress(OSError):
        os.unlink(spec.admin_path)
    try:
        others = [name for name in os.listdir(spec.dir) if name.startswith(ADMIN_SOCKET_PREFIX)]
    except OSError:
        return  # gone already
    if not others:
        shutil.rmtree(spec.dir, ignore_errors=True)


def _pidfd(pid: int) -> int:
    """A pidfd for ``pid`` (-1 for none, or where it cannot be had)."""
    if pid <= 0:
        return -1
    try:
        return os.pidfd_open(pid)
    except OSError:
        return -1


class WorkerLink:
    """The worker's end of the feed: applies every snapshot to the registry, sends outcomes back.

    Fire and forget: an outcome that finds the link down is dropped (the breakers lose a sample, the
    request path never waits); the link reconnects while the supervisor lives."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.fed = False
        self._registry: PodRegistry | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._first = asyncio.Event()
        self._pending: list[list[Any]] = []
        self._flush: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None
        self._parent = os.getppid()
        self._supervisor = _pidfd(spec.supervisor_pid)
        self._configs = PodConfigs()

    async def start(self, registry: PodRegistry) -> None:
        """Connect and wait for the first snapshot (the worker listens only once it knows the pods)."""
        self._registry = registry
        registry.outcomes = self.outcome
        self._task = asyncio.create_task(self._run(), name="worker-feed")
        try:
            await asyncio.wait_for(self._first.wait(), FIRST_SNAPSHOT_S)
        except TimeoutError:
            raise RuntimeError(f"no pod snapshot from the supervisor within {FIRST_SNAPSHOT_S:g} s") from None

    async def close(self) -> None:
        orphaned = self._supervisor_gone()
        if self._flush is not None:
            self._flush.cancel()
        self._send_outcomes()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._writer is not None:
            self._writer.close()
        if self._supervisor >= 0:
            os.close(self._supervisor)
            self._supervisor = -1
        if orphaned:
            leave_the_directory(self.spec)

    def _supervisor_gone(self) -> bool:
        if self._supervisor < 0:  # no pidfd: the parent then is the supervisor, or is not any more
            return os.getppid() != self._parent
        return bool(select.select([self._supervisor], [], [], 0)[0])  # readable once it has exited

    async def _run(self) -> None:
        while True:
            try:
                reader, self._writer = await asyncio.open_unix_connection(self.spec.feed_path)
                while True:
                    message = await read_frame(reader)
                    pods = message.get("pods")
                    if pods is not None and self._registry is not None:
                        apply_snapshot(self._registry, pods, self._configs.of(pods))
                        self.fed = True
                        self._first.set()
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                if self._supervisor_gone():  # drain and leave, as on SIGTERM
                    log.warning("worker %d: the supervisor exited; draining", self.spec.index)
                    os.kill(os.getpid(), signal.SIGTERM)
                    return
                log.warning("worker %d: feed from the supervisor lost (%s); reconnecting",
                            self.spec.index, exc)
            self._writer = None
            await asyncio.sleep(0.5)

    def outcome(self, pod: str, what: str | None, at: float) -> None:
        self._pending.append([pod, what, at])
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(FLUSH_S, self._send_outcomes)

    def _send_outcomes(self) -> None:
        self._flush = None
        pending, self._pending = self._pending, []
        if pending and self._writer is not None and not self._writer.is_closing():
            self._writer.write(frame({"outcomes": pending}))
