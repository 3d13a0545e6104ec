"""What a health source says about a GPU or one of its MIG slices, in one shape for all sources.

DCGM, Kubernetes device health and the mig-agent each name devices their own way (parent GPU UUID
plus GPU-instance id, pod name, MIG UUID); each source's parser turns its wire format into
``DeviceVerdict`` values keyed by a ``DeviceKey``, and the pod monitor matches those keys to pods.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DeviceKey:
    """One device as a source names it. A verdict on a whole GPU has ``gpu_instance_id`` and
    ``mig_uuid`` None: it concerns every slice of that GPU."""

    gpu_uuid: str | None = None  # GPU-... (the parent GPU, also on MIG series)
    gpu_instance_id: int | None = None  # DCGM's GPU_I_ID, NVML's GPU instance id
    mig_uuid: str | None = None  # MIG-... (the device plugin's device id)
    pod: str | None = None  # namespace/name, when the source maps devices to pods itself


@dataclass(frozen=True, slots=True)
class DeviceVerdict:
    """A source's judgement: ``healthy`` False makes every pod on the device unroutable."""

    key: DeviceKey
    healthy: bool
    reason: str  # for people: "XID 79 (GPU has fallen off the bus)", "Kubernetes device health: Unhealthy"
    source: str  # "dcgm", "kubernetes", "mig-agent"
