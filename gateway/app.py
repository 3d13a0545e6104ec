"""Application assembly: the relay's hot path in front, Starlette for everything else.

Inference routes go straight to the raw-ASGI relay (no middleware wraps its per-chunk sends);
the public control plane (models, health, readiness) is an ordinary Starlette app, which also
runs the lifespan: the pod client and the discovery and health loops. The admin plane (``/admin/*``,
``/metrics``) is a separate app (``gateway.admin``) that only the admin listener serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.admin import AdminKey, AdminPlane, KeyLookup, http_error
from gateway.admit import GRPC_WEB_PREFIX, ROUTES
from gateway.auth import KeyStore, load_key_store
from gateway.collector import settle_after_startup
from gateway.config import Config
from gateway.errors import model_not_found
from gateway.loop_lag import LoopLag
from gateway.metrics import GatewayMetrics
from gateway.phases.limit import build_quotas
from gateway.pods.credentials import PodAccess
from gateway.pods.host import start_host_loops
from gateway.pods.monitor import PodMonitor
from gateway.pods.registry import PodRegistry
from gateway.relay import Receive, Relay, Scope, Send
from gateway.reload import ConfigSource, ConfigWatcher
from transports.hangups import HangupWatcher
from transports.pod_client import PodClient

log = logging.getLogger("sluicegate")


class _Lookup:
    """A bare lookup function as the relay's key store (tests hand one in)."""

    def __init__(self, lookup: KeyLookup) -> None:
        self._lookup = lookup

    def lookup(self, key: str | bytes) -> AdminKey | None:
        return self._lookup(key.decode("latin-1") if isinstance(key, bytes) else key)


class Gateway:
    """The ASGI application uvicorn serves on the public port; ``admin`` is the admin listener's.

    With auth on, the key store (``auth.keys_file``) is loaded here: a store that cannot be used is
    a ``ConfigError`` before anything listens. ``lookup`` replaces it (tests): a key's record by
    the key as sent."""

    def __init__(
        self,
        config: Config,
        lookup: KeyLookup | None = None,
        source: ConfigSource | None = None,
        worker: Any = None,
    ) -> None:
        self.config = config
        # A worker of ``serve --workers N`` (``gateway.workers.worker.WorkerLink``): its pods' state
        # comes from the supervisor's snapshots, none of the per-host loops run here.
        self.worker = worker
        self.metrics = GatewayMetrics()
        self.registry = PodRegistry(
            config.pods, config.health, self.metrics, PodAccess.from_config(config)
        )
        self.monitor = PodMonitor(self.registry, config.health)
        self._pod_client: PodClient | None = None
        keys: Any = None
        if config.auth.enabled:
            keys = load_key_store(config) if lookup is None else _Lookup(lookup)
            lookup = keys.lookup
        self.keys = keys
        self.relay = Relay(
            config, self.registry, self.metrics, self.pod_client, keys, build_quotas(config, self.metrics)
        )
        if isinstance(keys, KeyStore):
            self.metrics.watch_key_store(keys)
        self._grpc_web: Any = None  # the endpoint, built on the first gRPC-Web call (``grpc_web``)
        self.metrics.watch_runtime(
            lambda: len(asyncio.all_tasks()),
            lambda: self._pod_client.open_connections if self._pod_client else 0,
        )
        self.loop_lag = LoopLag(self.metrics.registry, lambda: self.relay.in_flight > 0)
        self.started = time.time()
        self.control = Starlette(
            routes=[
                Route("/v1/models", self.list_models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.get_model, methods=["GET"]),
                Route("/healthz", self.healthz, methods=["GET"]),
                Route("/readyz", self.readyz, methods=["GET"]),
            ],
            exception_handlers={HTTPException: http_error},
            lifespan=self._lifespan,
        )
        # SIGHUP, a changed config file, POST /admin/reload (``source``: where the config came from)
        self.reloader = ConfigWatcher(self, source)
        rollouts = self.relay.rollouts
        self.admin = AdminPlane(
            self.registry, self.monitor, self.metrics, lookup, rollouts=rollouts, reload=self.reloader
        )
        if self.relay.rollouts.active:
            self.metrics.watch_rollouts(self.relay.rollouts)

    def pod_client(self) -> PodClient:
        if self._pod_client is None:
            raise RuntimeError("the pod client exists only while the app is running")
        return self._pod_client

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            route = ROUTES.get(scope["path"])
            if route is not None:
                await self.relay(scope, receive, send, route)
                return
            if scope["path"].startswith(GRPC_WEB_PREFIX):
                await (self._grpc_web or await self.grpc_web())(scope, receive, send)
                return
        await self.control(scope, receive, send)

    async def grpc_web(self) -> Any:
        """The gRPC-Web endpoint (any origin may call it: CORS, docs/grpc-web.md), loaded when first
        called: it and protobuf are ~3 MB in every worker that serves no gRPC-Web. The ~20 ms import
        runs on a thread, so streams in flight keep flowing meanwhile."""
        if self._grpc_web is None:
            module = await asyncio.to_thread(importlib.import_module, "gateway.grpc_web")
            if self._grpc_web is None:  # another first call may have built it meanwhile
                self._grpc_web = module.GrpcWebEndpoint(self.relay)
        return self._grpc_web

    @contextlib.asynccontextmanager
    async def _lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        upstream = self.config.upstream
        self._pod_client = PodClient(
            self.config.timeouts.connect_s, upstream.keepalive_timeout_s, upstream.max_idle_per_pod
        )
        self.relay.hangups = HangupWatcher()
        await self.relay.start()  # key store reloads, quota leases
        loops = [asyncio.create_task(self.loop_lag.run(), name="loop-lag")]
        if self.worker is not None:  # serve --workers N: the supervisor measures the pods and feeds us
            await self.worker.start(self.registry)
        else:
            loops += await start_host_loops(
                self.registry, self.monitor, self.config.discovery, self.metrics, lambda: self.config.pods
            )
        if self.relay.rollouts.active:
            loops.append(asyncio.create_task(self.relay.rollouts.run(), name="rollouts"))
        await self.reloader.start()
        settle_after_startup()
        try:
            yield
        finally:
            await self.reloader.close()
            for task in loops:
                task.cancel()
            for task in loops:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await self._pod_client.close()
            await self.relay.close()
            if self.worker is not None:
                await self.worker.close()
            self.relay.hangups.close()
            self.relay.hangups = None
            self._pod_client = None

    async def list_models(self, _request: Request) -> Response:
        created = int(self.started)
        return JSONResponse({
            "object": "list",
            "data": [
                {"id": model, "object": "model", "created": created, "owned_by": "sluicegate"}
                for model in self.registry.models()
            ],
        })

    async def get_model(self, request: Request) -> Response:
        """``GET /v1/models/{id}``: a served model's object (ids may hold slashes), else OpenAI's 404."""
        model = request.path_params["model"]
        if not self.registry.knows(model):
            error = model_not_found(model)
            return Response(error.body(), error.status, media_type="application/json")
        return JSONResponse(
            {"id": model, "object": "model", "created": int(self.started), "owned_by": "sluicegate"}
        )

    async def healthz(self, _request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def drain(self) -> None:
        """Stop taking work and let streams in flight finish, until the drain deadline."""
        timeout = self.config.server.drain_timeout_s
        log.info("draining: %d requests in flight, up to %g s", self.relay.in_flight, timeout)
        await self.relay.drain(timeout)
        log.info("drained")

    async def readyz(self, _request: Request) -> Response:
        if self.relay.draining:
            return JSONResponse({"status": "draining", "reason": "the gateway is shutting down"}, 503)
        if self.worker is not None and not self.worker.fed:
            return JSONResponse({"status": "not_ready", "reason": "no pod snapshot from the supervisor"}, 503)
        models = self.registry.routable_models()
        if models:
            return JSONResponse({"status": "ready", "models": models})
        return JSONResponse({"status": "not_ready", "reason": "no routable pod for any model"}, 503)
