"""A small fake Kubernetes API server, so pod discovery is tested against the real list+watch protocol.

Why: the hard parts of watching Kubernetes (resuming from a resourceVersion, bookmarks, ``410 Gone`` after
history was compacted, connections dropped mid-stream) never happen against a mock that returns canned
objects. This server speaks the wire protocol over a real socket, so a client is exercised end to end.

What it implements, for one namespace:

- ``GET /api/v1/namespaces/{ns}/pods`` and ``/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices``:
  a list (``{"kind": "PodList", "metadata": {"resourceVersion": "N"}, "items": [...]}``; items without
  kind/apiVersion, as a real server sends them) filtered by ``labelSelector``.
- The same paths with ``watch=true``: a chunked stream of newline-delimited JSON events. With a
  ``resourceVersion`` it replays every kept change after that version, then streams live ones; without
  one (or with ``"0"``) it first sends a synthetic ADDED per existing object. A version older than the
  kept history answers ``ERROR`` with a ``Status`` (code 410, reason ``Expired``) in a 200 stream, the way
  the watch cache does (``gone_as_http=True`` answers HTTP 410 with the Status body instead). Label
  selectors are applied per event: an object that starts or stops matching is sent as ADDED or DELETED.
  ``allowWatchBookmarks=true`` lets ``bookmark()`` reach the watcher, shaped like a real bookmark (only
  ``metadata.resourceVersion`` set, required fields present but empty). ``timeoutSeconds`` ends the
  stream cleanly.
- ``GET /api/v1/namespaces/{ns}/pods/{name}`` (404 with a ``Status`` when absent).

Where it is simpler than a real API server: one global resourceVersion counter for every kind (real
servers also share one, from etcd, but clients must treat it as opaque); no authentication, RBAC,
admission, defaulting or validation (objects are stored as given); label selectors support only the
equality forms (``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``; set-based ``in``/``notin`` answer 400); no
``fieldSelector``, pagination (``limit`` is ignored and ``continue`` never set), list ``resourceVersion``
semantics (a list is always the latest state), ``sendInitialEvents``, protobuf, or write verbs over HTTP:
tests change state through the Python API. Bookmarks are sent only when a test asks, never on a timer.
History is kept until ``expire_history()``, rather than for a few minutes, and 410 is only ever the answer
to a new watch (a real server can also end a live watch that fell behind with it). A watch from a version
newer than the current one is served as if it were current (a real server waits, then answers 504).
"""

from __future__ import annotations

import asyncio
import copy
import json
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

PODS = "pods"
SLICES = "endpointslices"
_KINDS = {PODS: ("v1", "Pod"), SLICES: ("discovery.k8s.io/v1", "EndpointSlice")}
_CREATED = "2026-01-01T00:00:00Z"

Obj = dict[str, Any]


class SelectorError(ValueError):
    pass


def parse_selector(text: str | None) -> list[tuple[str, str, str | None]]:
    """``a=b,c!=d,e,!f`` as (op, key, value) triples; set-based forms are rejected."""
    terms: list[tuple[str, str, str | None]] = []
    for raw in (text or "").split(","):
        term = raw.strip()
        if not term:
            continue
        if " in " in term or " notin " in term or "(" in term:
            raise SelectorError(f"set-based selector {term!r} is not supported by the fake")
        if "!=" in term:
            key, value = term.split("!=", 1)
            terms.append(("!=", key.strip(), value.strip()))
        elif "=" in term:
            key, value = term.replace("==", "=", 1).split("=", 1)
            terms.append(("=", key.strip(), value.strip()))
        elif term.startswith("!"):
            terms.append(("!", term[1:].strip(), None))
        else:
            terms.append(("exists", term, None))
    return terms


def matches(obj: Obj | None, terms: list[tuple[str, str, str | None]]) -> bool:
    if obj is None:
        return False
    labels = obj.get("metadata", {}).get("labels") or {}
    for op, key, value in terms:
        if (
            (op == "=" and labels.get(key) != value)
            or (op == "!=" and labels.get(key) == value)
            or (op == "exists" and key not in labels)
            or (op == "!" and key in labels)
        ):
            return False
    return True


def _status(code: int, reason: str, message: str) -> Obj:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def make_pod(
    name: str,
    ip: str | None,
    *,
    namespace: str = "default",
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    node: str = "gpu-node-1",
    limits: dict[str, str] | None = None,
    ready: bool = True,
    device_health: list[tuple[str, str, str]] | None = None,
) -> Obj:
    """A Pod shaped like a running vLLM pod; ``device_health`` is (resource name, resourceID, health)."""
    status: Obj = {
        "phase": "Running",
        "hostIP": "192.168.0.10",
        "podIP": ip,
        "podIPs": [{"ip": ip}] if ip else [],
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        "containerStatuses": [
            {
                "name": "vllm",
                "ready": ready,
                "restartCount": 0,
                "image": "vllm/vllm-openai:latest",
                "imageID": "",
                "started": True,
                "state": {"running": {"startedAt": _CREATED}},
            }
        ],
    }
    if device_health:
        grouped: dict[str, list[Obj]] = {}
        for resource, device_id, health in device_health:
            grouped.setdefault(resource, []).append({"resourceID": device_id, "health": health})
        status["containerStatuses"][0]["allocatedResourcesStatus"] = [
            {"name": resource, "resources": devices} for resource, devices in grouped.items()
        ]
    if ip is None:
        del status["podIP"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": dict(labels or {}),
            "annotations": dict(annotations or {}),
        },
        "spec": {
            "nodeName": node,
            "containers": [
                {
                    "name": "vllm",
                    "image": "vllm/vllm-openai:latest",
                    "ports": [{"name": "http", "containerPort": 8000, "protocol": "TCP"}],
                    "resources": {"limits": dict(limits or {}), "requests": dict(limits or {})},
                }
            ],
        },
        "status": status,
    }


def make_endpoint(
    pod: Obj, *, ready: bool = True, terminating: bool = False, serving: bool | None = None
) -> Obj:
    meta = pod["metadata"]
    return {
        "addresses": [pod["status"]["podIP"]],
        "conditions": {
            "ready": ready and not terminating,
            "serving": ready if serving is None else serving,
            "terminating": terminating,
        },
        "targetRef": {
            "kind": "Pod",
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid", ""),
        },
        "nodeName": pod["spec"]["nodeName"],
    }


def make_slice(
    name: str,
    service: str,
    endpoints: list[Obj],
    *,
    namespace: str = "default",
    ports: Sequence[tuple[str, int]] = (("http", 8000),),
    address_type: str = "IPv4",
) -> Obj:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "generateName": f"{service}-",
            "labels": {
                "kubernetes.io/service-name": service,
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
            },
        },
        "addressType": address_type,
        "endpoints": endpoints,
        "ports": [{"name": n, "port": p, "protocol": "TCP"} for n, p in ports],
    }


@dataclass
class _Event:
    rv: int
    kind: str
    type: str  # ADDED, MODIFIED, DELETED
    old: Obj | None
    new: Obj


@dataclass(eq=False)
class _Watcher:
    kind: str
    terms: list[tuple[str, str, str | None]]
    bookmarks: bool
    queue: asyncio.Queue[Obj | None] = field(default_factory=asyncio.Queue)


class FakeKube:
    """The fake server and the Python API tests drive it with (all calls on the server's event loop)."""

    def __init__(self, namespace: str = "default", *, gone_as_http: bool = False) -> None:
        self.namespace = namespace
        self.gone_as_http = gone_as_http
        self.rv = 1
        self.floor = 1  # watches from a version older than this get 410
        self.objects: dict[str, dict[str, Obj]] = {PODS: {}, SLICES: {}}
        self.history: list[_Event] = []
        self.watchers: set[_Watcher] = set()
        self.lists: list[str] = []  # kind of each list request served
        self.watches: list[tuple[str, str | None]] = []  # (kind, resourceVersion asked) of each watch
        self._runner: web.AppRunner | None = None
        self._stopping = False
        self._watch_started = asyncio.Condition()
        self.url = ""

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        app = web.Application()
        ns = "/namespaces/{ns}/"
        app.router.add_get("/api/v1" + ns + PODS, self._collection(PODS))
        app.router.add_get("/apis/discovery.k8s.io/v1" + ns + SLICES, self._collection(SLICES))
        app.router.add_get("/api/v1" + ns + PODS + "/{name}", self._get_pod)
        self._stopping = False
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = self._runner.addresses[0]
        self.url = f"http://{bound[0]}:{bound[1]}"
        return self.url

    async def stop(self) -> None:
        """Close the listener and every connection; objects and history survive for a later ``start``."""
        self._stopping = True  # a watch arriving from now on is cut at once
        self.drop_watches()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def wait_for_watches(self, count: int) -> None:
        """Until ``count`` watch requests have arrived in all (bound it with ``asyncio.wait_for``)."""
        async with self._watch_started:
            await self._watch_started.wait_for(lambda: len(self.watches) >= count)

    async def __aenter__(self) -> FakeKube:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- state changes (each bumps the resourceVersion and reaches matching watchers) ----------------
    def put(self, kind: str, obj: Obj) -> Obj:
        """Create or replace an object (ADDED or MODIFIED); returns the stored copy."""
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        meta["namespace"] = self.namespace
        old = self.objects[kind].get(meta["name"])
        meta["uid"] = old["metadata"]["uid"] if old else str(uuid.uuid4())
        meta["creationTimestamp"] = _CREATED
        self.rv += 1
        meta["resourceVersion"] = str(self.rv)
        self.objects[kind][meta["name"]] = obj
        self._publish(_Event(self.rv, kind, "MODIFIED" if old else "ADDED", old, obj))
        return obj

    def delete(self, kind: str, name: str) -> None:
        old = self.objects[kind].pop(name)
        self.rv += 1
        gone = copy.deepcopy(old)
        gone["metadata"]["resourceVersion"] = str(self.rv)
        self._publish(_Event(self.rv, kind, "DELETED", old, gone))

    def get(self, kind: str, name: str) -> Obj | None:
        return self.objects[kind].get(name)

    # -- a Service's pods, the way the EndpointSlice controller would show them ----------------------
    def slice_name(self, service: str) -> str:
        return f"{service}-abcde"

    def add_pod(
        self, service: str, pod: Obj, *, ready: bool = True, port: tuple[str, int] = ("http", 8000)
    ) -> Obj:
        """Store ``pod`` (see ``make_pod``) and list it in the Service's EndpointSlice."""
        stored = self.put(PODS, pod)
        name = self.slice_name(service)
        current = self.get(SLICES, name) or make_slice(name, service, [], ports=[port])
        endpoints = [e for e in current["endpoints"] if e["targetRef"]["name"] != stored["metadata"]["name"]]
        endpoints.append(make_endpoint(stored, ready=ready))
        self.put(SLICES, {**current, "endpoints": endpoints})
        return stored

    def set_endpoint(self, service: str, pod_name: str, *, ready: bool, terminating: bool = False) -> None:
        current = copy.deepcopy(self.objects[SLICES][self.slice_name(service)])
        for endpoint in current["endpoints"]:
            if endpoint["targetRef"]["name"] == pod_name:
                endpoint["conditions"] = {
                    "ready": ready and not terminating,
                    "serving": ready,
                    "terminating": terminating,
                }
        self.put(SLICES, current)

    def set_device_health(self, pod_name: str, resource: str, device_id: str, health: str) -> None:
        pod = copy.deepcopy(self.objects[PODS][pod_name])
        status = pod["status"]["containerStatuses"][0]
        status["allocatedResourcesStatus"] = [
            {"name": resource, "resources": [{"resourceID": device_id, "health": health}]}
        ]
        self.put(PODS, pod)

    def remove_pod(self, service: str, pod_name: str) -> None:
        """Take the pod out of the Service's slice, then delete it (the controller's order)."""
        current = self.objects[SLICES][self.slice_name(service)]
        endpoints = [e for e in current["endpoints"] if e["targetRef"]["name"] != pod_name]
        self.put(SLICES, {**current, "endpoints": endpoints})
        self.delete(PODS, pod_name)

    # -- protocol events -----------------------------------------------------------------------------
    def bookmark(self) -> None:
        """Send every watcher that allowed bookmarks one carrying the current resourceVersion."""
        for watcher in self.watchers:
            if watcher.bookmarks:
                watcher.queue.put_nowait({"type": "BOOKMARK", "object": self._bookmark_object(watcher.kind)})

    def expire_history(self) -> None:
        """Forget all changes so far: a watch from any older resourceVersion now gets 410 Gone."""
        self.history.clear()
        self.floor = self.rv

    def drop_watches(self) -> None:
        """Cut every open watch connection abruptly (no final chunk), as a failing proxy or node would."""
        for watcher in self.watchers:
            watcher.queue.put_nowait(None)
        self.watchers.clear()

    def _bookmark_object(self, kind: str) -> Obj:
        api_version, type_name = _KINDS[kind]
        obj: Obj = {
            "kind": type_name,
            "apiVersion": api_version,
            "metadata": {"resourceVersion": str(self.rv)},
        }
        if kind == PODS:
            obj |= {"spec": {"containers": None}, "status": {}}
        else:
            obj |= {"addressType": "", "endpoints": None}
        return obj

    def _publish(self, event: _Event) -> None:
        self.history.append(event)
        for watcher in self.watchers:
            line = self._as_seen_by(watcher, event)
            if line is not None:
                watcher.queue.put_nowait(line)

    @staticmethod
    def _as_seen_by(watcher: _Watcher, event: _Event) -> Obj | None:
        if event.kind != watcher.kind:
            return None
        was = matches(event.old, watcher.terms) if event.type != "ADDED" else False
        now = matches(event.new, watcher.terms) if event.type != "DELETED" else False
        if not (was or now):
            return None
        kind = "MODIFIED" if was and now else "ADDED" if now else "DELETED"
        return {"type": kind, "object": _with_kind(watcher.kind, event.new)}

    # -- HTTP ----------------------------------------------------------------------------------------
    def _check_ns(self, request: web.Request) -> None:
        if request.match_info["ns"] != self.namespace:
            missing = _status(404, "NotFound", f'namespaces "{request.match_info["ns"]}" not found')
            raise web.HTTPNotFound(text=json.dumps(missing), content_type="application/json")

    async def _get_pod(self, request: web.Request) -> web.Response:
        self._check_ns(request)
        name = request.match_info["name"]
        pod = self.objects[PODS].get(name)
        if pod is None:
            return web.json_response(_status(404, "NotFound", f'pods "{name}" not found'), status=404)
        return web.json_response(_with_kind(PODS, pod))

    def _collection(self, kind: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handler(request: web.Request) -> web.StreamResponse:
            self._check_ns(request)
            try:
                terms = parse_selector(request.query.get("labelSelector"))
            except SelectorError as exc:
                return web.json_response(_status(400, "BadRequest", str(exc)), status=400)
            if request.query.get("watch") in ("true", "1"):
                return await self._watch(request, kind, terms)
            self.lists.append(kind)
            api_version, type_name = _KINDS[kind]
            items = [o for o in self.objects[kind].values() if matches(o, terms)]
            return web.json_response(
                {
                    "kind": type_name + "List",
                    "apiVersion": api_version,
                    "metadata": {"resourceVersion": str(self.rv)},
                    "items": [{k: v for k, v in o.items() if k not in ("kind", "apiVersion")} for o in items],
                }
            )

        return handler

    async def _watch(self, request: web.Request, kind: str, terms: list) -> web.StreamResponse:
        since = request.query.get("resourceVersion") or None
        if since is not None and not since.isdigit():
            invalid = _status(400, "BadRequest", f"invalid resourceVersion {since!r}")
            return web.json_response(invalid, status=400)
        self.watches.append((kind, since))
        watcher = _Watcher(kind, terms, request.query.get("allowWatchBookmarks") == "true")
        expired = None
        if since is None or since == "0":
            current = (_with_kind(kind, o) for o in self.objects[kind].values())
            backlog = [{"type": "ADDED", "object": o} for o in current if matches(o, terms)]
        elif int(since) < self.floor:
            expired = _status(410, "Expired", f"too old resource version: {since} ({self.floor})")
            backlog = [{"type": "ERROR", "object": expired}]
        else:
            seen = (self._as_seen_by(watcher, e) for e in self.history if e.rv > int(since))
            backlog = [line for line in seen if line is not None]
        if expired is None:
            self.watchers.add(watcher)  # registered before the first await: no change can slip between
        if self._stopping:
            watcher.queue.put_nowait(None)
        async with self._watch_started:
            self._watch_started.notify_all()
        if expired and self.gone_as_http:
            return web.json_response(expired, status=410)

        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        loop = asyncio.get_running_loop()
        timeout = float(request.query.get("timeoutSeconds") or 0)
        deadline = loop.time() + timeout if timeout else None
        try:
            for line in backlog:
                await resp.write(json.dumps(line).encode() + b"\n")
            while not expired:
                remaining = None if deadline is None else deadline - loop.time()
                try:
                    line = await asyncio.wait_for(watcher.queue.get(), remaining)
                except TimeoutError:
                    break  # timeoutSeconds: a clean end; the client watches again from where it was
                if line is None:  # drop_watches(): cut the connection without the final chunk
                    if request.transport is not None:
                        request.transport.abort()
                    return resp
                await resp.write(json.dumps(line).encode() + b"\n")
            await resp.write_eof()
            return resp
        finally:
            self.watchers.discard(watcher)


def _with_kind(kind: str, obj: Obj) -> Obj:
    api_version, type_name = _KINDS[kind]
    return {"kind": type_name, "apiVersion": api_version, **obj}
