"""Workers forked from a template process that has imported the gateway already, so they share it.

A worker started with ``exec`` imports the whole gateway afresh and holds ~50 MB of its own once it
has served; forked from a process that has imported it, it starts with those pages shared
(copy-on-write) and holds ~25 MB of its own (``docs/operations.md``). The supervisor cannot fork its
workers itself: it runs an event loop and threads, and a threaded process must not fork. So, before
any thread starts, it imports what a worker needs, moves it out of the collector's sight
(``gc.freeze``: a collection writes to every object it walks, and so to every shared page), and
forks a **template**: single-threaded, it forks a worker whenever the supervisor asks and reports
each one's exit. Each worker then runs ``gateway.cli.main`` with the arguments and environment an
exec'd one would get, in a session of its own, its output on a pipe the supervisor reads. Where there
is no template (threads were already running, or it died), the supervisor starts workers with
``exec`` as before.

The two talk over a ``SOCK_SEQPACKET`` socket pair, one JSON message a packet: ``{"argv", "env"}``
with the worker's stdout as an attached descriptor; ``{"pid"}`` in reply, in order; ``{"exit",
"status"}`` when a worker ends (the status as ``asyncio``'s ``returncode``: negative for a signal).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import json
import logging
import os
import select
import shutil
import signal
import socket
import sys
import threading
import traceback
from collections import deque

log = logging.getLogger("sluicegate.supervisor")

# What a worker imports beyond what the supervisor has: its server and the modules it loads late.
PRELOAD = (
    "gateway.cli", "gateway.server", "gateway.workers.worker", "uvloop", "uvicorn.loops.uvloop",
    "uvicorn.lifespan.on", "encodings.idna",
)
SHARED_STATE = ("gateway.quota.redis_store",)  # redis-py and what it brings: workers that share state
_MAX_MESSAGE = 1 << 20  # an environment is a few KB
SPAWN_TIMEOUT_S = 10.0  # a template that does not answer by then is taken for dead
# Signals the template holds back (blocked, not ignored: a forked worker must not lose a SIGTERM sent
# before it is ready for it; the supervisor tells the workers, the template has nothing to do on them)
_HELD = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
NAME = "sluicegate-tmpl"  # the template's process name (ps -o comm, top); its workers keep python's


def _set_name(name: str) -> None:
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as comm:
        comm.write(name)


class ForkedWorker:
    """A worker the template forked: what the supervisor uses of ``asyncio.subprocess.Process``."""

    def __init__(self, stdout: asyncio.StreamReader) -> None:
        self.pid = 0  # until the template says
        self.stdout = stdout
        self.returncode: int | None = None
        self.pidfd = -1  # once the template is gone: signals go through it (the pid may be reused)
        loop = asyncio.get_running_loop()
        self.started: asyncio.Future[int] = loop.create_future()
        self._exited: asyncio.Future[int] = loop.create_future()

    def exited(self, status: int) -> None:
        if self.returncode is None:
            self.returncode = status
            self._exited.set_result(status)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None and self.pid:
            with contextlib.suppress(ProcessLookupError):  # exited; its report is on its way
                if self.pidfd >= 0:
                    signal.pidfd_send_signal(self.pidfd, sig)
                else:
                    os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WorkerTemplate:
    """The supervisor's side of the template: start it, ask it for workers, hear of their exits."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self._sock = sock
        self._pending: deque[ForkedWorker] = deque()  # asked for, in order, their pids not yet known
        self._workers: dict[int, ForkedWorker] = {}
        self._attached = False
        self._one_at_a_time = asyncio.Lock()  # one message in flight: N environments may not fit the buffer
        self.alive = True

    @classmethod
    def start(cls, preload: tuple[str, ...] = PRELOAD, leftovers: str | None = None) -> WorkerTemplate | None:
        """Import ``preload`` and fork the template; None (workers are exec'd) where this process
        must not fork. ``leftovers``: a directory the template removes when the supervisor is gone
        (its sockets: a supervisor killed outright cannot remove them itself)."""
        for module in preload:  # here, so that the supervisor shares these pages too
            __import__(module)
        gc.collect()
        gc.freeze()  # out of every later collection's walk, which would write to each shared page
        if threading.active_count() > 1:
            log.info("workers are started with exec: this process already runs threads")
            return None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        try:
            pid = os.fork()
        except OSError as exc:  # out of processes or memory: exec'd workers may still start later
            log.warning("workers are started with exec: cannot fork a template (%s)", exc)
            ours.close()
            theirs.close()
            return None
        if pid == 0:
            ours.close()
            _template_main(theirs, leftovers)  # never returns
        theirs.close()
        ours.setblocking(False)
        return cls(pid, ours)

    async def spawn(self, argv: list[str], env: dict[str, str]) -> ForkedWorker:
        """A worker running ``gateway.cli.main(argv)`` under ``env``; OSError if the template is gone
        or does not answer within ``SPAWN_TIMEOUT_S``."""
        async with self._one_at_a_time:
            return await self._spawn(argv, env)

    async def _spawn(self, argv: list[str], env: dict[str, str]) -> ForkedWorker:
        loop = asyncio.get_running_loop()
        if not self.alive:
            raise OSError("the worker template has exited")
        if not self._attached:
            loop.add_reader(self._sock.fileno(), self._on_message)
            self._attached = True
        out_r, out_w = os.pipe()
        try:
            socket.send_fds(self._sock, [json.dumps({"argv": argv, "env": env}).encode()], [out_w])
        except OSError:
            os.close(out_r)
            raise
        finally:
            os.close(out_w)
        worker = ForkedWorker(asyncio.StreamReader())
        self._pending.append(worker)
        pipe, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(worker.stdout), os.fdopen(out_r, "rb", 0)
        )
        try:
            async with asyncio.timeout(SPAWN_TIMEOUT_S):
                await worker.started
        except TimeoutError:
            pipe.close()
            log.error("the worker template (pid %d) did not answer in %g s; stopping it", self.pid,
                      SPAWN_TIMEOUT_S)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)  # its socket's end tells _on_message, which cleans up
            raise OSError("the worker template did not answer") from None
        except BaseException:  # the template is gone, or the supervisor stops meanwhile
            pipe.close()
            raise
        return worker

    def _on_message(self) -> None:
        try:
            data = self._sock.recv(_MAX_MESSAGE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._lost()
            return
        message = json.loads(data)
        if "pid" in message:  # known before its exit can be: the template reports that later
            worker = self._pending.popleft()
            worker.pid = message["pid"]
            if worker.started.done():  # its spawn gave up waiting: a worker nobody would watch
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.pid, signal.SIGKILL)
                return
            self._workers[worker.pid] = worker
            worker.started.set_result(worker.pid)
        else:
            worker = self._workers.pop(message["exit"], None)
            if worker is not None:
                worker.exited(message["status"])

    def _lost(self) -> None:
        """The template died: no more forks; its workers' ends are learned from pidfds instead."""
        log.error("the worker template (pid %d) exited; workers are now started with exec", self.pid)
        self.alive = False
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._sock.fileno())
        self._sock.close()
        while self._pending:
            started = self._pending.popleft().started
            if not started.done():
                started.set_exception(OSError("the worker template has exited"))
        for pid, worker in self._workers.items():
            _watch_pidfd(loop, pid, worker)
        self._workers.clear()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, os.WNOHANG)  # most often it has exited by now: no zombie left

    def close(self) -> None:
        """Let the template go (it exits when its socket closes) and reap it."""
        if self.alive:
            self.alive = False
            if self._attached:
                with contextlib.suppress(RuntimeError):
                    asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


def _watch_pidfd(loop: asyncio.AbstractEventLoop, pid: int, worker: ForkedWorker) -> None:
    """Learn of a worker's end without its parent: a pidfd is readable once the process exits.
    Its status is lost with the template, so it counts as a failure (1)."""
    try:
        fd = worker.pidfd = os.pidfd_open(pid)
    except OSError:  # already gone
        worker.exited(1)
        return

    def gone() -> None:
        loop.remove_reader(fd)
        worker.pidfd = -1
        os.close(fd)
        worker.exited(1)

    loop.add_reader(fd, gone)


# -- the template process ------------------------------------------------------------------------------


def _template_main(sock: socket.socket, leftovers: str | None) -> None:
    """Fork a worker per request until the supervisor's socket closes; reap them, report their exits.
    Then remove ``leftovers``: the supervisor has gone, cleanly (it removes them too) or not."""
    code = 0
    try:
        with open("/proc/self/comm") as comm:
            own_name = comm.read().strip()
        _set_name(NAME)
        signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
        _close_inherited(keep=sock.fileno())
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        while True:
            ready, _, _ = select.select([sock, wake_r], [], [])
            if wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
                _reap(sock)
            if sock in ready:
                data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 1)
                if not data:
                    if leftovers is not None:
                        shutil.rmtree(leftovers, ignore_errors=True)
                    break
                message = json.loads(data)
                pid = os.fork()
                if pid == 0:
                    _set_name(own_name)
                    _worker_main(message["argv"], message["env"], fds[0], (sock.fileno(), wake_r, wake_w))
                for fd in fds:
                    os.close(fd)
                sock.send(json.dumps({"pid": pid}).encode())
    except BaseException:  # a template's failure must not run the supervisor's code
        traceback.print_exc()
        code = 1
    os._exit(code)


def _close_inherited(keep: int) -> None:
    """Close what the supervisor's launcher left open (an exec'd worker never saw it: asyncio closes
    every descriptor but 0-2 for a subprocess). At the fork the supervisor had imported modules and
    nothing else: no Python object of its owns a descriptor above 2 yet."""
    low = 3
    if keep >= low:
        os.closerange(low, keep)
        low = keep + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))


def _move_fd(fd: int, to: int) -> None:
    """Make ``fd`` descriptor number ``to`` (it may be already: a supervisor started with 0 or 1 closed)."""
    if fd != to:
        os.dup2(fd, to)
        os.close(fd)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        with contextlib.suppress(OSError):  # the supervisor is gone: nobody to tell
            sock.send(json.dumps({"exit": pid, "status": os.waitstatus_to_exitcode(status)}).encode())


def _worker_main(argv: list[str], env: dict[str, str], stdout_fd: int, inherited: tuple[int, ...]) -> None:
    """In the forked worker: become what an exec'd ``python -m gateway.cli argv`` would be, run it."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for fd in inherited:
            os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()  # its own session, as the supervisor's exec'd workers: Ctrl-C reaches the supervisor
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD)  # one sent meanwhile is delivered now
        _move_fd(stdout_fd, 1)
        _move_fd(os.open(os.devnull, os.O_RDONLY), 0)
        # its lines reach the supervisor as they are printed (also where the supervisor had none)
        sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(env)
        sys.argv = [sys.argv[0], *argv]
        from gateway.cli import main

        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # reported as an exec'd worker's traceback would be
        traceback.print_exc()
    try:
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    finally:
        os._exit(code)

