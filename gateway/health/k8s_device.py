"""Read Kubernetes' own device health for a pod (KEP-4680) as device verdicts (sans-IO).

Since Kubernetes 1.31 the kubelet copies the device plugin's health of each allocated device into the
pod's status (``status.containerStatuses[].allocatedResourcesStatus``). For a GPU pod that is NVIDIA's
device plugin saying "this MIG slice took a critical XID": a verdict that needs no DCGM and no node
agent, only the Pod object the Kubernetes discovery already watches. Also here: the MIG profile a pod
asked for, from its ``nvidia.com/mig-<profile>`` resources (MIG strategy ``mixed``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.health.verdict import DeviceKey, DeviceVerdict

SOURCE = "kubernetes"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _dict(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _device_key(resource_id: str) -> DeviceKey | None:
    # time-sliced replicas of one device are advertised as "<uuid>::<n>"
    device = resource_id.split("::", 1)[0]
    if device.startswith("MIG-"):
        return DeviceKey(mig_uuid=device)
    if device.startswith("GPU-"):
        return DeviceKey(gpu_uuid=device)
    return None  # some other device plugin's device


def device_verdicts(pod: Mapping[str, Any]) -> list[DeviceVerdict]:
    """A verdict per NVIDIA device the pod's containers were allocated, from the Pod object as a dict.

    Only ``Unhealthy`` is a fault; ``Unknown`` (or no health yet) is not, and the reason says so.
    A device listed more than once is unhealthy if any listing says so. Devices that are neither
    ``MIG-`` nor ``GPU-`` ids are not ours and are skipped.
    """
    verdicts: dict[DeviceKey, DeviceVerdict] = {}
    for container in _list(_dict(pod.get("status")).get("containerStatuses")):
        for allocated in _list(_dict(container).get("allocatedResourcesStatus")):
            for entry in _list(_dict(allocated).get("resources")):
                resource = _dict(entry)
                resource_id = resource.get("resourceID")
                key = _device_key(resource_id) if isinstance(resource_id, str) else None
                if key is None:
                    continue
                health = resource.get("health") or "Unknown"
                reason = f"Kubernetes device health: {health}"
                if health == "Unknown":
                    reason += " (not treated as a fault)"
                verdict = DeviceVerdict(key, health != "Unhealthy", reason, SOURCE)
                if key not in verdicts or not verdict.healthy:
                    verdicts[key] = verdict
    return list(verdicts.values())


def mig_profile(pod: Mapping[str, Any]) -> str | None:
    """The MIG profile (e.g. ``"1g.10gb"``) from the first container limit or request for
    ``nvidia.com/mig-<profile>``; None when the pod asks for none (whole GPUs, or strategy ``single``)."""
    for container in _list(_dict(pod.get("spec")).get("containers")):
        resources = _dict(_dict(container).get("resources"))
        for kind in ("limits", "requests"):
            for name in _dict(resources.get(kind)):
                if isinstance(name, str) and name.startswith(MIG_RESOURCE_PREFIX):
                    return name[len(MIG_RESOURCE_PREFIX) :]
    return None
