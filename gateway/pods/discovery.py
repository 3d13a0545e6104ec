"""Discovery: ask each pod which models it serves, and whether it answers at all.

Static pods come from config; a pod without configured models is asked ``GET /v1/models``.
Unreachable pods are asked again sooner (``retry_interval_s``) than healthy ones.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time

from gateway.config import DiscoveryConfig
from gateway.metrics import GatewayMetrics
from gateway.pods.prober import probe_get
from gateway.pods.registry import Pod, PodRegistry

log = logging.getLogger("sluicegate.discovery")


MAX_MODELS_BODY = 4 * 1024 * 1024  # a model list (LoRA adapters included) is far smaller


class ProbeTimeout(Exception):
    """The pod did not answer ``/v1/models`` within the probe timeout."""


async def probe(pod: Pod, timeout_s: float) -> frozenset[str]:
    """The model ids the pod lists at ``/v1/models``; raises on any failure.

    Timed on a thread (``prober``), as the health probes are, so a busy event loop is not taken
    for a slow pod. Sends the pod's API key: vLLM's ``--api-key`` guards ``/v1/models`` too."""
    loop = asyncio.get_running_loop()
    call = functools.partial(
        probe_get, pod.host, pod.port, pod.tls, "/v1/models", timeout_s, MAX_MODELS_BODY,
        server_name=pod.server_name, authorization=pod.auth_header,
    )
    result = await loop.run_in_executor(None, call)
    if not result.hard:
        raise ProbeTimeout(f"/v1/models {result.detail}")
    if not result.ok:
        raise RuntimeError(f"/v1/models: {result.detail}{_refused_key(pod, result.detail)}")
    payload = json.loads(result.body)
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        raise RuntimeError("/v1/models did not return an OpenAI model list")
    return frozenset(m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str))


def _refused_key(pod: Pod, detail: str) -> str:
    """What a 401 or 403 means for the operator: the pod wants a key, or another one."""
    if detail not in ("HTTP 401", "HTTP 403"):
        return ""
    if pod.auth_header is None:
        return " (the pod wants an API key: set credentials for it, or upstream.credentials)"
    return " (the pod refused the gateway's API key: check its credentials)"


async def refresh_pod(pod: Pod, config: DiscoveryConfig, metrics: GatewayMetrics) -> bool:
    """Probe one pod and record the result in the registry entry. Returns whether the models changed."""
    before = pod.models
    try:
        models = await probe(pod, config.probe_timeout_s)
    except ProbeTimeout as exc:
        if not pod.serving(time.monotonic()):
            _unreachable(pod, str(exc))
        # else: slow under load while live traffic gets answers; overload is not absence
    except (RuntimeError, ValueError, RecursionError) as exc:
        _unreachable(pod, str(exc)[:200] or type(exc).__name__)
    else:
        if not pod.reachable:
            log.info("pod %s (%s) is reachable, serving %s", pod.name, pod.url, sorted(models))
        pod.reachable = True
        pod.last_error = None
        if not pod.config.models:
            pod.models = models
    pod.last_probe = time.monotonic()
    metrics.pod_up.labels(pod.name).set(1 if pod.reachable else 0)
    return pod.models != before


def _unreachable(pod: Pod, why: str) -> None:
    if pod.reachable or pod.last_probe is None:
        log.warning("pod %s (%s) is unreachable: %s", pod.name, pod.url, why)
    pod.reachable = False
    pod.last_error = why


async def refresh_all(
    registry: PodRegistry,
    config: DiscoveryConfig,
    metrics: GatewayMetrics,
    pods: tuple[Pod, ...] | None = None,
) -> None:
    changed = await asyncio.gather(*(refresh_pod(p, config, metrics) for p in (pods or registry.pods)))
    if any(changed):
        registry.reindex()


async def discovery_loop(registry: PodRegistry, config: DiscoveryConfig, metrics: GatewayMetrics) -> None:
    """Keep every pod's models and reachability current until cancelled."""
    next_full = time.monotonic() + config.refresh_interval_s
    while True:
        down = tuple(p for p in registry.pods if not p.reachable)
        await asyncio.sleep(config.retry_interval_s if down else config.refresh_interval_s)
        now = time.monotonic()
        try:
            if now >= next_full:
                next_full = now + config.refresh_interval_s
                await refresh_all(registry, config, metrics)
            elif down:
                await refresh_all(registry, config, metrics, down)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug in one round must not end discovery for good
            log.exception("discovery round failed")
