"""The feed between the supervisor and a worker: pod snapshots one way, request outcomes the other.

One Unix stream connection per worker, frames of a 4-byte big-endian length and a JSON object:
``{"pods": [...]}`` from the supervisor (every pod's identity and live state), ``{"outcomes":
[[pod, what, at], ...]}`` from a worker (``what`` None for a success). Times are the host's
monotonic clock (``CLOCK_MONOTONIC``, the same in every process of the host), so they travel as is.
"""

from __future__ import annotations

import asyncio
import json
import struct
from typing import Any

from gateway.config import PodConfig
from gateway.pods.registry import Pod, PodRegistry

_LENGTH = struct.Struct(">I")
MAX_FRAME = 64 * 1024 * 1024  # thousands of pods fit many times over

_HEALTH = ("state", "reason", "failures", "successes", "probed", "device_fault", "device_fault_at",
           "draining", "soft", "excused")
_OUTLIER = ("state", "consecutive", "ejections", "ejected_until", "reason")
_LOAD = ("kv_cache_usage", "running", "waiting", "drain_per_s", "itl_p95_s", "scraped_at")


def frame(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    return _LENGTH.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any]:
    """The next message; ``asyncio.IncompleteReadError`` when the peer closed."""
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > MAX_FRAME:
        raise ValueError(f"feed frame of {length} bytes")
    message = json.loads(await reader.readexactly(length))
    if not isinstance(message, dict):
        raise ValueError("feed frame is not a JSON object")
    return message


def pod_state(pod: Pod) -> dict[str, Any]:
    """What a worker needs of one pod to route as the supervisor sees it."""
    return {
        "config": pod.config.model_dump(mode="json"),
        "models": sorted(pod.models),
        "reachable": pod.reachable,
        "last_error": pod.last_error,
        "last_probe": pod.last_probe,
        "served_at": pod.served_at,
        "health": {k: getattr(pod.health, k) for k in _HEALTH},
        "pressure": [pod.pressure.open, pod.pressure.reason],
        "outlier": {k: getattr(pod.outlier, k) for k in _OUTLIER},
        "load": {k: getattr(pod.load, k) for k in _LOAD},
    }


def snapshot(registry: PodRegistry) -> dict[str, Any]:
    return {"pods": [pod_state(pod) for pod in registry.pods]}


class PodConfigs:
    """The snapshot's pod configs, validated again only when they change: they almost never do, and
    snapshots come at least once a scrape, into the worker's request loop."""

    def __init__(self) -> None:
        self._raw: list[Any] | None = None
        self._configs: list[PodConfig] = []

    def of(self, pods: list[dict[str, Any]]) -> list[PodConfig]:
        raw = [state["config"] for state in pods]
        if raw != self._raw:
            self._raw, self._configs = raw, [PodConfig.model_validate(config) for config in raw]
        return self._configs


def apply_snapshot(registry: PodRegistry, pods: list[dict[str, Any]], configs: list[PodConfig]) -> None:
    """Make a worker's registry what the supervisor's is: the pod set, then each pod's state.

    The supervisor's breakers hear every worker's outcomes, so their verdict wins; a worker keeps
    only its own in-flight counts, its half-open trial, and the latest success it saw itself."""
    if [pod.config for pod in registry.pods] != configs:
        registry.sync(configs)
    reindex = False
    for pod, state in zip(registry.pods, pods, strict=True):
        models = frozenset(state["models"])
        if models != pod.models:
            pod.models = models
            reindex = True
        pod.reachable = state["reachable"]
        pod.last_error = state["last_error"]
        pod.last_probe = state["last_probe"]
        pod.served_at = max(pod.served_at, state["served_at"])
        for key, value in state["health"].items():
            setattr(pod.health, key, value)
        pod.pressure.open, pod.pressure.reason = state["pressure"]
        outlier = state["outlier"]
        if outlier["state"] != pod.outlier.state:
            pod.outlier.trial_out = False
        for key, value in outlier.items():
            setattr(pod.outlier, key, value)
        for key, value in state["load"].items():
            setattr(pod.load, key, value)
    if reindex:
        registry.reindex()
