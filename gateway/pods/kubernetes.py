"""Pods from Kubernetes: a Service's EndpointSlices say which pods take traffic, their Pods say what they are.

Why: in a cluster the fleet changes under the gateway (rollouts, evictions, a MIG slice going bad) and the
EndpointSlice controller already knows which pod IPs are ready. Watching, rather than polling, keeps the
pod list current within a round trip, and the Pod objects carry what routing needs: models, variant
labels, the MIG slice, and (KEP-4680) the kubelet's own verdict on the pod's devices.

Each resource is followed the way client-go's reflector does it: list, remember the list's
resourceVersion, watch from it with bookmarks, resume from the last version seen when a connection
drops, relist on 410 Gone, back off (capped) while the API server cannot be reached. lightkube provides
the connection (kubeconfig or in-cluster service account, TLS, token refresh), the request building and
the typed models; the watch stream itself is read here, because lightkube's ``watch`` does not ask for
bookmarks, cannot decode a real Pod bookmark (``spec.containers: null``), and on 410 either raises or
silently restarts without a version, which never reports the deletions it missed.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import httpx2
import msgspec
from lightkube import AsyncClient, KubeConfig
from lightkube.config.models import Cluster, User
from lightkube.core import decoders
from lightkube.core.exceptions import NotReadyError
from lightkube.core.selector import build_selector
from lightkube.resources.core_v1 import Pod
from lightkube.resources.discovery_v1 import EndpointSlice

from gateway.config import PodCredentials
from gateway.health.k8s_device import MIG_RESOURCE_PREFIX
from gateway.health.verdict import DeviceKey, DeviceVerdict
from gateway.pods.found import KubePod
from gateway.side_server import url_of

log = logging.getLogger("sluicegate.kubernetes")

SERVICE_LABEL = "kubernetes.io/service-name"
MODELS_ANNOTATION = "sluicegate.io/models"  # comma-separated; label values cannot hold "," or "/"
MIG_UUID_ANNOTATION = "sluicegate.io/mig-uuid"
GPU_UUID_ANNOTATION = "sluicegate.io/gpu-uuid"
GPU_INSTANCE_ANNOTATION = "sluicegate.io/gpu-instance-id"
_PROFILE = re.compile(r"^(\d+g\.\d+gb)(?:[.+](\w+))?$")  # 1g.10gb, 1g.10gb.me → 1g.10gb+me


def describe_pod(pod: Pod, url: str, ready: bool, model_label: str = "model") -> KubePod:
    """Everything routing needs from one Pod object, reached at ``url``."""
    meta = pod.metadata
    labels = dict(meta.labels or {})
    annotations = meta.annotations or {}
    name = f"{meta.namespace}/{meta.name}"
    models: list[str] = []
    for listed in (labels.get(model_label, ""), annotations.get(MODELS_ANNOTATION, "")):
        for model in (m.strip() for m in listed.split(",")):
            if model and model not in models:
                models.append(model)

    profile = None
    containers = (pod.spec.containers or []) if pod.spec else []
    for res in (c.resources for c in containers if c.resources):
        for resource in [*(res.limits or {}), *(res.requests or {})]:
            if resource.startswith(MIG_RESOURCE_PREFIX) and (
                found := _PROFILE.match(resource.removeprefix(MIG_RESOURCE_PREFIX))
            ):
                profile = found[1] + (f"+{found[2]}" if found[2] else "")

    mig_uuid = annotations.get(MIG_UUID_ANNOTATION)
    gpu_uuid = annotations.get(GPU_UUID_ANNOTATION)
    verdicts: list[DeviceVerdict] = []
    statuses = (pod.status.containerStatuses or []) if pod.status else []
    for status in statuses:
        for allocated in status.allocatedResourcesStatus or ():
            for device in allocated.resources or ():
                device_id = device.resourceID
                is_mig, is_gpu = device_id.startswith("MIG-"), device_id.startswith("GPU-")
                mig_uuid = mig_uuid or (device_id if is_mig else None)
                gpu_uuid = gpu_uuid or (device_id if is_gpu else None)
                if device.health not in ("Healthy", "Unhealthy"):
                    continue  # Unknown (or absent) is no verdict either way
                reason = f"Kubernetes device health: {device.health}"
                if device.message:
                    reason += f" ({device.message})"
                key = DeviceKey(
                    gpu_uuid=device_id if is_gpu else None, mig_uuid=device_id if is_mig else None, pod=name
                )
                verdicts.append(DeviceVerdict(key, device.health == "Healthy", reason, "kubernetes"))

    instance = annotations.get(GPU_INSTANCE_ANNOTATION, "")
    return KubePod(
        name=name,
        url=url,
        ready=ready,
        models=tuple(models),
        labels=labels,
        node=pod.spec.nodeName if pod.spec else None,
        mig_profile=profile,
        mig_uuid=mig_uuid,
        gpu_uuid=gpu_uuid,
        gpu_instance_id=int(instance) if instance.isdigit() else None,
        device_health=tuple(verdicts),
    )


class _Gone(Exception):
    """The resourceVersion we watch from was compacted away: only a fresh list is correct now."""


class _WatchError(Exception):
    pass


class _BookmarkMeta(msgspec.Struct):
    resourceVersion: str | None = None


class _Bookmark(msgspec.Struct):
    metadata: _BookmarkMeta = msgspec.field(default_factory=_BookmarkMeta)


class _Reflector:
    """One resource kind's objects in a namespace, kept current by list + watch."""

    def __init__(self, owner: KubernetesDiscovery, res: type, labels: Mapping[str, str] | None) -> None:
        self.owner = owner
        self.res = res
        self.labels = dict(labels) if labels else None
        self.items: dict[str, Any] = {}
        self.rv: str | None = None
        self.synced = False
        self.failures = 0

    async def run(self, client: AsyncClient) -> None:
        kind = self.res.__name__
        while True:
            try:
                if self.rv is None:
                    await self._list(client)
                if await self._watch(client):
                    continue
            except _Gone as exc:
                log.info("%s watch: %s; listing again", kind, exc)
                self.rv = None
            except (httpx2.HTTPError, msgspec.MsgspecError, NotReadyError, _WatchError) as exc:
                log.warning("%s list/watch failed: %s", kind, str(exc) or type(exc).__name__)
            self.failures += 1  # a fresh list or a good event resets it
            delay = min(self.owner.backoff_max_s, self.owner.backoff_base_s * 2 ** (self.failures - 1))
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))

    async def _list(self, client: AsyncClient) -> None:
        listing = client.list(self.res, namespace=self.owner.namespace, labels=self.labels)
        items = [obj async for obj in listing]
        self.items = {obj.metadata.name: obj for obj in items}
        self.rv = listing.resourceVersion
        self.synced = True
        self.failures = 0
        self.owner._changed()

    async def _watch(self, client: AsyncClient) -> bool:
        """Watch from ``self.rv`` until the server ends the stream. False: it ended at once, empty."""
        generic = client._client  # lightkube's request builder, carrying base URL, auth and TLS
        timeout_s = self.owner.watch_timeout_s * random.uniform(1.0, 1.5)
        params = {
            "resourceVersion": self.rv,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": int(timeout_s),
            "labelSelector": build_selector(self.labels) if self.labels else None,
        }
        request = generic.prepare_request(
            "list", self.res, namespace=self.owner.namespace, watch=True, params=params
        )
        # the server ends the stream after timeoutSeconds; a silent connection is dead some time after that
        request.timeout = httpx2.Timeout(10.0, read=timeout_s + 30.0)
        loop = asyncio.get_running_loop()
        started, events = loop.time(), 0
        response = await generic.send(generic.build_adapter_request(request), stream=True)
        try:
            if response.status_code != 200:
                await response.aread()
                if response.status_code == 410:
                    raise _Gone(f"HTTP 410 for resourceVersion {self.rv}")
                raise _WatchError(f"HTTP {response.status_code}: {response.text[:200]}")
            async for line in response.aiter_lines():
                if line.strip():
                    self._apply(decoders.decode_watch_event(line.encode()))
                    events += 1
                    self.failures = 0
        finally:
            await response.aclose()
        return events > 0 or loop.time() - started > 1.0

    def _apply(self, event: decoders.WatchEvent) -> None:
        raw = bytes(event.object)
        if event.type == "BOOKMARK":
            self.rv = msgspec.json.decode(raw, type=_Bookmark).metadata.resourceVersion or self.rv
            return
        if event.type == "ERROR":
            status = decoders.decode_status(raw)
            if status.code == 410:
                raise _Gone(status.message or "410 Gone")
            raise _WatchError(f"watch error {status.code} {status.reason}: {status.message}")
        obj = decoders.decode_object(raw, self.res)
        if event.type == "DELETED":
            self.items.pop(obj.metadata.name, None)
        elif event.type in ("ADDED", "MODIFIED"):
            self.items[obj.metadata.name] = obj
        else:
            raise _WatchError(f"unknown watch event type {event.type!r}")
        self.rv = obj.metadata.resourceVersion
        self.owner._changed()


class KubernetesDiscovery:
    """Follows one Service's pods and reports the whole set each time it changes.

    Needs ``list`` and ``watch`` on ``endpointslices`` (discovery.k8s.io) and ``pods`` in ``namespace``.
    ``pod_labels`` narrows the Pod watch (e.g. the Service's selector); by default it covers the namespace.
    Connection: ``api_url`` (no auth; for tests and ``kubectl proxy``), else ``kubeconfig``, else lightkube's
    own search (in-cluster service account, then ``$KUBECONFIG`` or ``~/.kube/config``).
    """

    def __init__(
        self,
        namespace: str,
        service: str,
        *,
        port_name: str | None = None,
        model_label: str = "model",
        pod_labels: Mapping[str, str] | None = None,
        api_url: str | None = None,
        kubeconfig: KubeConfig | str | None = None,
        watch_timeout_s: float = 300.0,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 30.0,
        credentials: PodCredentials | None = None,
    ) -> None:
        self.namespace = namespace
        self.credentials = credentials  # carried into every pod's config
        self.service = service
        self.port_name = port_name
        self.model_label = model_label
        self.watch_timeout_s = watch_timeout_s
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        if api_url is not None:
            kubeconfig = KubeConfig.from_one(cluster=Cluster(server=api_url), user=User())
        elif isinstance(kubeconfig, str):  # a path, as the config file gives it
            kubeconfig = KubeConfig.from_file(kubeconfig)
        self._config = kubeconfig or KubeConfig.from_env()
        self._slices = _Reflector(self, EndpointSlice, {SERVICE_LABEL: service})
        self._pods = _Reflector(self, Pod, pod_labels)
        self._on_update: Callable[[list[KubePod]], None] | None = None
        self._last: list[KubePod] | None = None

    async def run(self, on_update: Callable[[list[KubePod]], None]) -> None:
        """Watch until cancelled; ``on_update`` gets the full pod list once both kinds are listed, then on
        every change to it."""
        self._on_update = on_update
        client = AsyncClient(config=self._config, namespace=self.namespace)
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._slices.run(client))
                tasks.create_task(self._pods.run(client))
        finally:
            await client.close()

    def snapshot(self) -> list[KubePod]:
        """The pods as the last list and events describe them, sorted by name."""
        found: dict[str, KubePod] = {}
        for endpoint_slice in sorted(self._slices.items.values(), key=lambda s: s.metadata.name):
            port = self._port(endpoint_slice)
            if port is None or endpoint_slice.addressType not in ("IPv4", "IPv6"):
                continue
            for endpoint in endpoint_slice.endpoints or ():
                ref = endpoint.targetRef
                pod = self._pods.items.get(ref.name) if ref and ref.kind == "Pod" else None
                if pod is None or not endpoint.addresses:
                    continue  # not a pod, or its Pod event has not arrived yet
                cond = endpoint.conditions
                ready = cond is None or (cond.ready is not False and not cond.terminating)
                seen = describe_pod(pod, url_of(endpoint.addresses[0], port), ready, self.model_label)
                if seen.node is None and endpoint.nodeName:
                    seen = replace(seen, node=endpoint.nodeName)
                if self.credentials is not None:
                    seen = replace(seen, credentials=self.credentials)
                earlier = found.get(seen.name)
                if earlier is None or (seen.ready and not earlier.ready):
                    found[seen.name] = seen
        return sorted(found.values(), key=lambda p: p.name)

    def _port(self, endpoint_slice: EndpointSlice) -> int | None:
        for port in endpoint_slice.ports or ():
            if (self.port_name is None or port.name == self.port_name) and port.port:
                return port.port
        return None

    def _changed(self) -> None:
        if not (self._slices.synced and self._pods.synced) or self._on_update is None:
            return
        pods = self.snapshot()
        if pods == self._last:
            return
        self._last = pods
        try:
            self._on_update(pods)
        except Exception:
            log.exception("the pod-list callback failed")
