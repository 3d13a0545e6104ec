"""Turn a ``sluicegate mig-agent`` ``GET /v1/devices`` document into device verdicts.

Why a separate, sans-IO parser: the gateway polls one agent per node, and what it fetches must become
the same ``DeviceVerdict`` shape as DCGM's and Kubernetes' answers before the pod monitor can match it
to pods. Keeping the parsing free of I/O lets it be tested on bytes alone, and a malformed document is
refused as a whole (ValueError) rather than half-applied. The schema is in docs/mig-agent.md.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.health.verdict import DeviceKey, DeviceVerdict

SOURCE = "mig-agent"
SCHEMA_VERSION = 1


def _field(entry: dict[str, Any], name: str, kind: type, where: str) -> Any:
    """``entry[name]``: a bool, a non-empty string or an integer >= 0, as ``kind`` says."""
    value = entry.get(name)
    ok = isinstance(value, kind) and (
        (kind is bool)
        or (kind is str and value != "")
        or (kind is int and not isinstance(value, bool) and value >= 0)
    )
    if not ok:
        raise ValueError(f"mig-agent devices: {where}.{name} is {value!r}, expected a {kind.__name__}")
    return value


def _reason(entry: dict[str, Any], healthy: bool, where: str) -> str:
    reason = entry.get("reason")
    if reason is not None and not isinstance(reason, str):
        raise ValueError(f"mig-agent devices: {where}.reason is {reason!r}")
    return reason or ("healthy" if healthy else "unhealthy (no reason given)")


def _entries(doc: dict[str, Any], name: str) -> list[dict[str, Any]]:
    entries = doc.get(name, [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"mig-agent devices: {name!r} must be a list of objects")
    return entries


def parse_agent_devices(payload: dict[str, Any] | bytes) -> list[DeviceVerdict]:
    """One verdict per GPU (``DeviceKey(gpu_uuid=...)``) and per MIG slice (GPU UUID, GPU-instance id
    and MIG UUID), in the agent's order. Raises ValueError on malformed input."""
    if isinstance(payload, bytes | bytearray):
        try:
            payload = json.loads(payload)
        except (ValueError, RecursionError) as exc:  # also: too many digits, nested too deep
            raise ValueError(f"mig-agent devices: not JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise ValueError(f"mig-agent devices: expected a JSON object, got {type(payload).__name__}")
    version = payload.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise ValueError(f"mig-agent devices: unsupported schema_version {version!r}")

    verdicts = []
    for i, gpu in enumerate(_entries(payload, "gpus")):
        where = f"gpus[{i}]"
        healthy = _field(gpu, "healthy", bool, where)
        verdicts.append(
            DeviceVerdict(
                key=DeviceKey(gpu_uuid=_field(gpu, "uuid", str, where)),
                healthy=healthy,
                reason=_reason(gpu, healthy, where),
                source=SOURCE,
            )
        )
    for i, piece in enumerate(_entries(payload, "slices")):
        where = f"slices[{i}]"
        healthy = _field(piece, "healthy", bool, where)
        key = DeviceKey(
            gpu_uuid=_field(piece, "gpu_uuid", str, where),
            gpu_instance_id=_field(piece, "gpu_instance_id", int, where),
            mig_uuid=_field(piece, "mig_uuid", str, where),
        )
        reason = _reason(piece, healthy, where)
        verdicts.append(DeviceVerdict(key=key, healthy=healthy, reason=reason, source=SOURCE))
    return verdicts
