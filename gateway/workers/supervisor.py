"""The supervisor of ``serve --workers N``: host state once per host, N workers serving requests.

It checks the config and the ports (the same one-line errors and exit statuses as a single process),
starts a private Redis when the workers must share quotas or rollouts and the config names none,
runs the per-host loops (discovery, probes, scrapes, device sources) on its own registry, and feeds
every worker a snapshot of it (``gateway.workers.feed``) on each change and at least every probe
interval; the workers' request outcomes come back the same way and drive its breakers. It owns the
admin listener: host state (``/admin/pods``) answered here, ``/metrics`` merged from the workers,
the rest forwarded to a worker (``/admin/reload`` to all). SIGTERM drains every worker, then exits 0;
SIGHUP reloads everywhere; a worker that dies is started again, with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import uvicorn
from prometheus_client import Counter, Gauge
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from gateway.admin import AdminPlane
from gateway.auth import load_key_store
from gateway.config import Config, ConfigError
from gateway.metrics import GatewayMetrics
from gateway.pods.credentials import PodAccess
from gateway.pods.host import resync_static, start_host_loops
from gateway.pods.monitor import PodMonitor
from gateway.pods.registry import PodRegistry
from gateway.reload import ConfigSource, file_changes, file_digest, plan
from gateway.workers import READY_LINE
from gateway.workers.feed import frame, read_frame, snapshot
from gateway.workers.local_redis import LocalRedis, needs_shared_state
from gateway.workers.merge import merge
from gateway.workers.template import PRELOAD, SHARED_STATE, ForkedWorker, WorkerTemplate
from gateway.workers.worker import ENV, WorkerSpec, admin_path, feed_path

log = logging.getLogger("sluicegate.supervisor")

WorkerProcess = asyncio.subprocess.Process | ForkedWorker

PUBLISH_POLL_S = 0.1  # how soon a change reaches the workers
START_TIMEOUT_S = 60.0
BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
STABLE_S = 60.0  # a worker up this long has its backoff reset


@dataclass
class _Worker:
    index: int
    proc: WorkerProcess | None = None
    started: float = 0.0
    failures: int = 0
    lines: list[str] = field(default_factory=list)
    admin: aiohttp.ClientSession | None = None
    signalled: bool = False  # told to drain (a second SIGTERM would make it exit at once)

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)


class Supervisor:
    def __init__(self, config: Config, workers: int, argv: list[str], source: ConfigSource | None) -> None:
        self.config = config
        self.count = workers
        self.argv = argv
        self.source = source
        self._loaded_digest: str | None = None  # the config file's hash as last loaded (its watch)
        self.dir = tempfile.mkdtemp(prefix="sluicegate-workers-")
        self.workers = [_Worker(i) for i in range(workers)]
        self.redis: LocalRedis | None = None
        self.redis_url: str | None = None
        self.held: list[socket.socket] = []
        self.stopping = False
        self._feeds: set[asyncio.StreamWriter] = set()
        self._last_frame = b""
        self._last_push = 0.0
        self._tasks: list[asyncio.Task[Any]] = []
        self.access: PodAccess | None = None
        self.keys: Any = None
        self.ports: dict[str, int | None] = {}
        self.template: WorkerTemplate | None = None

    # -- start-up ------------------------------------------------------------------------------------

    def run(self) -> int:
        # before any thread: workers are forked from it, sharing the gateway's imported code
        shared = self.config.quotas.redis_url is not None or needs_shared_state(self.config)
        preload = PRELOAD + SHARED_STATE if shared else PRELOAD
        self.template = WorkerTemplate.start(preload, leftovers=self.dir)
        try:
            return self._run()
        finally:
            if self.template is not None:
                self.template.close()
            for sock in self.held:
                sock.close()
            if self.redis is not None:
                self.redis.stop()
            shutil.rmtree(self.dir, ignore_errors=True)

    def _run(self) -> int:
        config = self.config
        try:
            self.access = PodAccess.from_config(config)
            self.keys = load_key_store(config)
        except ConfigError as exc:
            print(f"sluicegate: {exc}", file=sys.stderr)
            return 2
        try:
            ports = self._claim_ports()
        except OSError as exc:
            print(f"sluicegate: cannot listen: {exc}", file=sys.stderr, flush=True)
            return 3
        if config.quotas.redis_url is None and needs_shared_state(config):
            self.redis = LocalRedis(self.dir)
            try:
                self.redis_url = self.redis.start()
            except ConfigError as exc:
                print(f"sluicegate: {exc}", file=sys.stderr)
                return 2
            log.info("workers share quotas and rollouts through a private redis-server at %s", self.redis_url)
        self.ports = ports
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(self._main())

    def _claim_ports(self) -> dict[str, int | None]:
        """Check every public port is free (bound without SO_REUSEPORT, so another process sharing it
        is found too), resolve port 0, and hold the TCP ones bound, not listening, with SO_REUSEPORT
        until the supervisor exits: the workers join them, nobody else can take them meanwhile. The
        UDP one is only checked: a bound UDP socket would take its share of the datagrams."""
        server = self.config.server
        port = self._hold(server.host, server.port)
        ports: dict[str, int | None] = {"port": port, "tls_port": None, "h3_port": None}
        tls = server.tls
        if tls is not None:
            tls_port = self._hold(server.host, tls.port)
            ports["tls_port"] = tls_port
            if tls.h3:
                h3 = tls.h3_port if tls.h3_port is not None else tls_port
                family, address = _address(server.host, h3, socket.SOCK_DGRAM)
                with socket.socket(family, socket.SOCK_DGRAM) as probe:
                    try:
                        probe.bind(address)
                    except OSError as exc:
                        raise OSError(exc.errno, f"HTTP/3 (UDP) port {h3}: {exc.strerror}") from None
                    ports["h3_port"] = probe.getsockname()[1]
        return ports

    def _hold(self, host: str, port: int) -> int:
        family, address = _address(host, port, socket.SOCK_STREAM)
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(address)
            except OSError as exc:
                raise OSError(exc.errno, f"[Errno {exc.errno}] error while attempting to bind on "
                              f"address {address[:2]}: {exc.strerror}") from None
            port = probe.getsockname()[1]
        hold = socket.socket(family, socket.SOCK_STREAM)
        hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        hold.bind((address[0], port, *address[2:]))
        self.held.append(hold)
        return port

    async def _main(self) -> int:
        config = self.config
        self.metrics = GatewayMetrics()
        self.worker_up = Gauge(
            "sluicegate_workers", "Worker processes running (serve --workers).",
            registry=self.metrics.registry,
        )
        self.worker_restarts = Counter(
            "sluicegate_worker_restarts", "Workers started again after they exited unexpectedly.",
            registry=self.metrics.registry,
        )
        self.registry = PodRegistry(config.pods, config.health, self.metrics, self.access)
        self.monitor = PodMonitor(self.registry, config.health)
        loops = await start_host_loops(
            self.registry, self.monitor, config.discovery, self.metrics, lambda: self.config.pods
        )
        if self.keys is not None:
            loops.append(asyncio.create_task(self.keys.watch(), name="key-store"))
        feed = await asyncio.start_unix_server(self._feed, path=feed_path(self.dir))
        loops.append(asyncio.create_task(self._publish(), name="publish"))
        if self.source is not None and self.source.path is not None:
            loops.append(asyncio.create_task(self._watch_file(self.source.path), name="config-watch"))
        admin_server = None
        lookup = self.keys.lookup if self.keys is not None else None
        self.plane = AdminPlane(self.registry, self.monitor, self.metrics, lookup)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop)
        loop.add_signal_handler(signal.SIGHUP, lambda: self._spawn_task(self.reload("SIGHUP")))
        code = 0
        try:
            failed = await self._start_all()
            if failed is not None:
                code = failed
            else:
                admin_url = None
                if config.admin.enabled:
                    try:
                        admin_server, admin_url = await self._listen_admin()
                    except OSError as exc:
                        print(f"sluicegate: cannot listen: {exc}", file=sys.stderr, flush=True)
                        code = 3
                if code == 0:
                    for line in self.workers[0].lines:
                        print(line, flush=True)
                    if admin_url is not None:
                        print(f"sluicegate admin listening on {admin_url}", flush=True)
                    log.info("%d workers serving", self.count)
                    watchers = [asyncio.create_task(self._watch(w)) for w in self.workers]
                    await asyncio.gather(*watchers)
        finally:
            self.stopping = True
            await self._stop_all()
            if admin_server is not None:
                admin_server.close()
            feed.close()
            for writer in self._feeds:
                writer.close()
            for task in loops + self._tasks:
                task.cancel()
            for task in loops + self._tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            for worker in self.workers:
                if worker.admin is not None:
                    await worker.admin.close()
        return code

    # -- workers -------------------------------------------------------------------------------------

    async def _start_all(self) -> int | None:
        """Start every worker and wait until each listens; the exit status to leave with, if one fails."""
        results = await asyncio.gather(*(self._start(w) for w in self.workers))
        for result in results:
            if result is not None:
                return result
        return None

    async def _start(self, worker: _Worker) -> int | None:
        spec = WorkerSpec(
            index=worker.index, workers=self.count, dir=self.dir, port=int(self.ports["port"] or 0),
            tls_port=self.ports["tls_port"], h3_port=self.ports["h3_port"], redis_url=self.redis_url,
            supervisor_pid=os.getpid(),
        )
        env = {**os.environ, ENV: spec.to_env(), "PYTHONUNBUFFERED": "1"}
        with contextlib.suppress(FileNotFoundError):
            os.unlink(admin_path(self.dir, worker.index))
        proc = await self._launch(env)
        worker.proc, worker.started, worker.lines, worker.signalled = proc, time.monotonic(), [], False
        assert proc.stdout is not None
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                while True:
                    line = (await proc.stdout.readline()).decode(errors="replace")
                    if not line:
                        code = await proc.wait()
                        log.error("worker %d exited at start (status %d)", worker.index, code)
                        return code or 3
                    if line.strip() == READY_LINE:
                        break
                    if line.startswith("sluicegate ") and " listening on " in line and "admin" not in line:
                        worker.lines.append(line.rstrip("\n"))
        except TimeoutError:
            log.error("worker %d did not listen within %g s", worker.index, START_TIMEOUT_S)
            proc.kill()
            await proc.wait()
            return 3
        self._spawn_task(_drain(proc.stdout))
        self._count_up()
        return None

    async def _launch(self, env: dict[str, str]) -> WorkerProcess:
        """A worker process: forked from the template while there is one, else exec'd."""
        if self.template is not None and self.template.alive:
            try:
                return await self.template.spawn(self.argv, env)
            except OSError as exc:
                log.error("cannot fork a worker from the template (%s); starting it with exec", exc)
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway.cli", *self.argv, env=env,
            stdout=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL,
            # its own process group: Ctrl-C at a terminal reaches the supervisor alone, which tells
            # each worker once (a second signal would cut the drain short)
            start_new_session=True,
        )

    async def _watch(self, worker: _Worker) -> None:
        """Wait for the worker to exit; unless the supervisor is stopping, start it again (backoff)."""
        while True:
            assert worker.proc is not None
            code = await worker.proc.wait()
            self._count_up()
            if self.stopping:
                return
            if time.monotonic() - worker.started > STABLE_S:
                worker.failures = 0
            delay = BACKOFF_S[min(worker.failures, len(BACKOFF_S) - 1)]
            worker.failures += 1
            log.warning("worker %d exited unexpectedly (status %s); starting it again in %g s",
                        worker.index, code, delay)
            await asyncio.sleep(delay)
            if self.stopping:
                return
            self.worker_restarts.inc()
            # one that fails at start has exited: the loop's wait returns and it backs off further
            await self._start(worker)

    def _count_up(self) -> None:
        self.worker_up.set(sum(w.proc is not None and w.proc.returncode is None for w in self.workers))

    def _stop(self) -> None:
        """SIGTERM/SIGINT: every worker drains (a second signal: they exit at once)."""
        if not self.stopping:
            log.info("stopping: draining %d workers", self.count)
        again = self.stopping
        self.stopping = True
        for worker in self.workers:
            if again or not worker.signalled:
                worker.signalled = True
                worker.signal(signal.SIGTERM)

    async def _stop_all(self) -> None:
        procs = [w.proc for w in self.workers if w.proc is not None and w.proc.returncode is None]
        for worker in self.workers:
            if not worker.signalled:
                worker.signalled = True
                worker.signal(signal.SIGTERM)
        grace = self.config.server.drain_timeout_s + 15
        try:
            async with asyncio.timeout(grace):
                await asyncio.gather(*(p.wait() for p in procs))
        except TimeoutError:
            for proc in procs:
                if proc.returncode is None:
                    log.error("worker pid %d still running %g s after SIGTERM; killing it", proc.pid, grace)
                    proc.kill()
            await asyncio.gather(*(p.wait() for p in procs))

    def _spawn_task(self, coro: Any) -> None:
        self._tasks.append(asyncio.ensure_future(coro))

    # -- the feed ------------------------------------------------------------------------------------

    async def _feed(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One worker's link: the current snapshot at once, then its outcomes until it leaves."""
        writer.write(frame(snapshot(self.registry)))
        self._feeds.add(writer)
        try:
            while True:
                message = await read_frame(reader)
                for name, what, at in message.get("outcomes", ()):
                    pod = self.registry.get(name)
                    if pod is None:
                        continue
                    if what is None:
                        self.registry.report_success(pod, at)
                    else:
                        self.registry.report_failure(pod, what, at)
        except (asyncio.IncompleteReadError, OSError, ValueError, TypeError):
            pass
        finally:
            self._feeds.discard(writer)
            writer.close()

    async def _publish(self) -> None:
        """Push a snapshot when it changed (looked at every PUBLISH_POLL_S), and at least once per
        probe interval."""
        every = self.config.health.probe.interval_s
        while True:
            await asyncio.sleep(PUBLISH_POLL_S)
            data = frame(snapshot(self.registry))
            now = time.monotonic()
            if data == self._last_frame and now - self._last_push < every:
                continue
            self._last_frame, self._last_push = data, now
            for writer in list(self._feeds):
                if writer.is_closing():
                    self._feeds.discard(writer)
                else:
                    writer.write(data)

    # -- reload --------------------------------------------------------------------------------------

    async def reload(self, why: str) -> None:
        """SIGHUP: the supervisor's own view (the static pods), then every worker reloads."""
        await self._reload_own(why)
        for worker in self.workers:
            worker.signal(signal.SIGHUP)

    async def _reload_own(self, why: str) -> None:
        source = self.source
        if source is not None and source.path is not None:
            try:
                loaded = await asyncio.to_thread(source.load)
            except ConfigError as exc:
                problem = " ".join(str(exc).split())
                log.warning("config reload (%s) refused by the supervisor: %s", why, problem)
            else:
                self._apply(loaded)

    async def _watch_file(self, path: str) -> None:
        """The config file, polled as each worker polls it (``reload.watch``): the supervisor's
        snapshots carry the pod list, so a change the workers saw and it did not would be pushed
        back out of them within a probe interval. The workers reload by themselves."""
        self._loaded_digest = await asyncio.to_thread(file_digest, path)
        async for digest in file_changes(path, lambda: self.config.reload, lambda: self._loaded_digest):
            self._loaded_digest = digest
            await self._reload_own("file changed")

    def _apply(self, loaded: Config) -> None:
        running = self.config
        config = plan(running, loaded).config
        if config.pods != running.pods:
            resync_static(self.registry, running.pods, config.pods)
        self.config = config

    # -- admin ---------------------------------------------------------------------------------------

    async def _listen_admin(self) -> tuple[asyncio.base_events.Server, str]:
        admin = self.config.admin
        admin_config = uvicorn.Config(
            self._admin, host=admin.host, port=admin.port, http="httptools", lifespan="off",
            interface="asgi3",
            access_log=False, log_config=None, proxy_headers=False, server_header=False,
        )
        admin_config.load()
        loop = asyncio.get_running_loop()
        state = ServerState()

        def protocol() -> HttpToolsProtocol:
            return HttpToolsProtocol(admin_config, state, {}, loop)

        try:
            server = await loop.create_server(protocol, host=admin.host, port=admin.port)
        except OSError as exc:
            raise OSError(exc.errno, f"admin listener (admin.port): {exc.strerror or exc}") from exc
        host, port = server.sockets[0].getsockname()[:2]
        netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return server, f"http://{netloc}"

    async def _admin(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Host state here; ``/metrics`` merged; ``/admin/reload`` everywhere; the rest to worker 0
        (what it changes is shared through Redis, or re-read by every worker from the same files)."""
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/metrics":
            texts = await asyncio.gather(*(self._call(w, "GET", "/metrics", b"", []) for w in self.workers))
            workers = zip(self.workers, texts, strict=True)
            parts = [(w.index, text.decode()) for w, (status, _, text) in workers if status == 200]
            body = await asyncio.to_thread(merge, self.metrics.registry, parts)
            await _answer(send, 200, body, self.metrics.content_type.encode())
            return
        if path.startswith("/admin/pods") or path == "/admin/status":
            await self.plane(scope, receive, send)
            return
        body = await _body(receive)
        method = scope["method"]
        target = path + (("?" + scope["query_string"].decode()) if scope.get("query_string") else "")
        headers = [(k.decode(), v.decode()) for k, v in scope["headers"]
                   if k.lower() in (b"authorization", b"x-api-key", b"content-type")]
        if path == "/admin/reload":
            calls = (self._call(w, method, target, body, headers) for w in self.workers)
            results = await asyncio.gather(*calls)
            status, ctype, answer = results[0]
            if 200 <= status < 300 and method == "POST" and self.source is not None and self.source.path:
                with contextlib.suppress(ConfigError):
                    self._apply(await asyncio.to_thread(self.source.load))
            await _answer(send, status, answer, ctype)
            return
        status, ctype, answer = await self._call(self.workers[0], method, target, body, headers)
        await _answer(send, status, answer, ctype)

    async def _call(
        self, worker: _Worker, method: str, target: str, body: bytes, headers: list[tuple[str, str]]
    ) -> tuple[int, bytes, bytes]:
        """One request to a worker's private admin socket: (status, content type, body); a 503 when
        the worker cannot be reached (it is restarting)."""
        if worker.admin is None or worker.admin.closed:
            worker.admin = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=admin_path(self.dir, worker.index)),
                timeout=aiohttp.ClientTimeout(total=10),
            )
        try:
            async with worker.admin.request(method, "http://worker" + target, data=body or None,
                                            headers=headers) as resp:
                ctype = resp.headers.get("content-type", "application/json").encode()
                return resp.status, ctype, await resp.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            message = f'{{"error": {{"message": "worker {worker.index} unavailable: {type(exc).__name__}"}}}}'
            return 503, b"application/json", message.encode()


async def _body(receive: Any) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _answer(send: Any, status: int, body: bytes, content_type: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.readline():
        pass


def _address(host: str, port: int, kind: int) -> tuple[int, tuple[Any, ...]]:
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=kind, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise OSError(errno.EADDRNOTAVAIL, f"cannot resolve {host!r}: {exc}") from None
    return family, address


def run_supervisor(config: Config, workers: int, argv: list[str], source: ConfigSource | None) -> int:
    """``serve --workers N`` (N >= 2): the exit status (0 after a drain, 2 bad config, 3 a port taken)."""
    return Supervisor(config, workers, argv, source).run()
