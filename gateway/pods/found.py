"""A pod a discovery source (Kubernetes, DNS) found: what routing needs to know of it.

Its own module so that DNS discovery and the app can hold one without importing the Kubernetes
client (lightkube and httpx: several MB of memory in every gateway, used only by Kubernetes
discovery).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from pydantic import ValidationError

from gateway.config import MigIdentity, PodConfig, PodCredentials
from gateway.health.verdict import DeviceVerdict

log = logging.getLogger("sluicegate.kubernetes")


@dataclass(frozen=True, slots=True)
class KubePod:
    """One pod behind the Service, as discovery last saw it (compare with ``==``; not hashable)."""

    name: str  # namespace/name
    url: str  # http://<endpoint address>:<port>
    ready: bool = True  # the EndpointSlice says ready and not terminating
    models: tuple[str, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    node: str | None = None
    mig_profile: str | None = None  # "1g.10gb", from a nvidia.com/mig-<profile> limit or request
    mig_uuid: str | None = None  # MIG-...
    gpu_uuid: str | None = None  # GPU-... (the parent GPU)
    gpu_instance_id: int | None = None
    device_health: tuple[DeviceVerdict, ...] = ()  # the kubelet's per-device health (KEP-4680)
    credentials: PodCredentials | None = None  # the discovery source's, for vLLM's --api-key

    def to_pod_config(self) -> PodConfig:
        """The registry's view. ``mig`` needs the parent GPU's UUID or the slice's own MIG UUID (the
        monitor learns the parent from the mig-agent or DCGM); without either, MIG facts stay here."""
        mig = None
        if self.gpu_uuid or self.mig_uuid:
            try:
                mig = MigIdentity(
                    gpu_uuid=self.gpu_uuid,
                    mig_uuid=self.mig_uuid,
                    profile=self.mig_profile,
                    gpu_instance_id=self.gpu_instance_id,
                )
            except ValidationError as exc:
                log.warning("pod %s: MIG identity left out: %s", self.name, exc.errors()[0]["msg"])
        return PodConfig(
            name=self.name,
            url=self.url,
            models=self.models,
            mig=mig,
            labels=dict(self.labels),
            credentials=self.credentials,
        )
