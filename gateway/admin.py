"""The admin plane: pod state, clearing a pod's device fault, and Prometheus metrics.

It is served on a listener of its own (``admin.host``/``admin.port``, loopback by default), never on
the public port: ``POST /admin/pods/NAME/clear`` puts a pod whose GPU reported a fatal XID back in
service, and the pod list maps the fleet. With auth on, ``/admin/*`` also wants a key holding the
``admin`` right (``Authorization: Bearer KEY`` or ``x-api-key``). ``/metrics`` asks for no key:
Prometheus scrapes without one, and the listener is reachable only where it is bound. Nor does
``/admin/status``, the HTML status page: it holds no data, and fetches it with the operator's key.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from gateway.errors import GatewayError, error_body
from gateway.metrics import GatewayMetrics
from gateway.pods.monitor import PodMonitor
from gateway.pods.registry import PodRegistry
from gateway.status_page import HEADERS as STATUS_HEADERS
from gateway.status_page import PAGE as STATUS_PAGE

ADMIN_RIGHT = "admin"


class AdminKey(Protocol):
    """What the admin plane needs of a key record (``gateway.auth.keystore.KeyRecord``)."""

    def has_right(self, name: str) -> bool: ...

    def expired(self, now: float) -> bool: ...


KeyLookup = Callable[[str], AdminKey | None]


def _error(error: GatewayError) -> Response:
    """Any admin error as OpenAI error JSON, like the public port's."""
    return Response(error.body(), error.status, headers=dict(error.headers), media_type="application/json")


_CHALLENGE = (("www-authenticate", 'Bearer realm="sluicegate-admin"'),)
_MISSING = GatewayError(
    401,
    "The admin API needs an API key with the 'admin' right: send 'Authorization: Bearer KEY' "
    "(or an 'x-api-key' header).",
    code="invalid_api_key",
    headers=_CHALLENGE,
)
_UNKNOWN = GatewayError(401, "The API key provided is not valid.", code="invalid_api_key", headers=_CHALLENGE)
_EXPIRED = GatewayError(401, "The API key provided has expired.", code="invalid_api_key", headers=_CHALLENGE)
_NOT_ADMIN = GatewayError(
    403, "This API key does not hold the 'admin' right the admin API requires.", code="permission_denied"
)


def presented_key(request: Request) -> str | None:
    """The key in ``Authorization: Bearer KEY``, else in ``x-api-key``; None when neither has one."""
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return request.headers.get("x-api-key", "").strip() or None


class AdminPlane:
    """The admin listener's ASGI app. ``lookup`` finds a key's record (``KeyStore.lookup``); None
    means auth is off and the admin routes ask for no key."""

    def __init__(
        self,
        registry: PodRegistry,
        monitor: PodMonitor,
        metrics: GatewayMetrics,
        lookup: KeyLookup | None,
        clock: Callable[[], float] = time.time,
        rollouts: Any = None,
        reload: Any = None,
    ) -> None:
        self.registry = registry
        self.reloader = reload  # gateway.reload.ConfigWatcher
        self.rollouts = rollouts  # gateway.canary.rollouts.Rollouts
        self.monitor = monitor
        self.metrics = metrics
        self.lookup = lookup
        self.clock = clock
        self.app = Starlette(
            routes=[
                Route("/metrics", self.prometheus, methods=["GET"]),
                Route("/admin/status", self.status_page, methods=["GET"]),
                Route("/admin/pods", self.admin_pods, methods=["GET"]),
                Route("/admin/pods/{name}/clear", self.clear_pod, methods=["POST"]),
                Route("/admin/rollouts", self.list_rollouts, methods=["GET"]),
                Route("/admin/rollouts/{model:path}/{action}", self.steer_rollout, methods=["POST"]),
                Route("/admin/reload", self.reload, methods=["GET", "POST"]),
            ],
            exception_handlers={HTTPException: http_error},
        )

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)

    def refusal(self, request: Request) -> Response | None:
        """A 401/403 for a caller who may not use the admin routes, or None when it may."""
        if self.lookup is None:
            return None
        key = presented_key(request)
        if key is None:
            return _error(_MISSING)
        record = self.lookup(key)
        if record is None:
            return _error(_UNKNOWN)
        if record.expired(self.clock()):
            return _error(_EXPIRED)
        if not record.has_right(ADMIN_RIGHT):
            return _error(_NOT_ADMIN)
        return None

    async def prometheus(self, _request: Request) -> Response:
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    async def status_page(self, _request: Request) -> Response:
        """The status page asks for no key: it is static, and its own data calls carry the key."""
        return HTMLResponse(STATUS_PAGE, headers=STATUS_HEADERS)

    async def admin_pods(self, request: Request) -> Response:
        refused = self.refusal(request)
        if refused is not None:
            return refused
        return JSONResponse(
            {
                "pods": self.registry.snapshot(),
                "failing_open": sorted(self.registry.failing_open),
                "panic": sorted(self.registry.panicking),
            }
        )

    async def clear_pod(self, request: Request) -> Response:
        """An operator checked the pod's GPU slice: forget its device fault (probes still decide)."""
        refused = self.refusal(request)
        if refused is not None:
            return refused
        pod = self.registry.get(request.path_params["name"])
        if pod is None:
            return _error(GatewayError(404, "No such pod.", code="pod_not_found"))
        self.monitor.clear(pod)
        return JSONResponse(pod.snapshot())

    async def list_rollouts(self, request: Request) -> Response:
        """Every canary rollout: its step, weights, state, and the judge's evidence."""
        refused = self.refusal(request)
        if refused is not None:
            return refused
        return JSONResponse({"rollouts": self.rollouts.status() if self.rollouts is not None else []})

    async def steer_rollout(self, request: Request) -> Response:
        """``pause``, ``resume``, ``promote`` or ``abort`` a route's rollout (``?why=`` is logged)."""
        refused = self.refusal(request)
        if refused is not None:
            return refused
        action = request.path_params["action"]
        if action not in ("pause", "resume", "promote", "abort"):
            problem = f"Unknown action {action!r}: pause, resume, promote or abort."
            return _error(GatewayError(400, problem, code="unknown_action"))
        why = request.query_params.get("why", "operator")
        status = None
        if self.rollouts is not None:
            try:
                status = self.rollouts.command(request.path_params["model"], action, why)
            except ValueError as exc:  # RolloutError: not in this state (resume a rolled-back one)
                return _error(GatewayError(409, str(exc), code="rollout_conflict"))
        if status is None:
            return _error(GatewayError(404, "No rollout for that model.", code="rollout_not_found"))
        return JSONResponse(status)

    async def reload(self, request: Request) -> Response:
        """POST: read the config file again and apply it, as SIGHUP does; GET: the last reload's outcome."""
        refused = self.refusal(request)
        if refused is not None:
            return refused
        if self.reloader is None:
            return _error(GatewayError(404, "This gateway cannot reload its config.", code="no_reload"))
        if request.method == "GET":
            return JSONResponse({"last": self.reloader.last})
        outcome = await self.reloader.reload("admin")
        if outcome["outcome"] == "error":
            problem = f"The config was refused: {outcome['error']}"
            return _error(GatewayError(422, problem, code="config_invalid"))
        if outcome["outcome"] == "none":
            problem = "The gateway runs without a config file: nothing to reload."
            return _error(GatewayError(409, problem, code="no_config_file"))
        return JSONResponse(outcome)


async def http_error(_request: Request, exc: Any) -> Response:
    """404/405 and friends in the OpenAI error shape, like every other error the gateway sends
    (the public control app uses it too)."""
    status = exc.status_code
    if status == 404:
        body = error_body("No such route on this gateway.", "invalid_request_error", "not_found")
    elif status == 405:
        body = error_body("Method not allowed on this route.", "invalid_request_error", "method_not_allowed")
    else:
        body = error_body(str(exc.detail), "invalid_request_error", str(status))
    return Response(body, status, headers=exc.headers, media_type="application/json")
