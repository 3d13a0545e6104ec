"""Discovery: ask each pod which models it serves, and whether it answers at all.

Static pods come from config; a pod without configured models is asked ``GET /v1/models``.
Unreachable pods are asked again sooner (``retry_interval_s``) than healthy ones.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from gateway.config import DiscoveryConfig
from gateway.metrics import GatewayMetrics
from gateway.pods.registry import Pod, PodRegistry

log = logging.getLogger("sluicegate.discovery")


async def probe(pod: Pod, session: aiohttp.ClientSession, timeout_s: float) -> frozenset[str]:
    """The model ids the pod lists at ``/v1/models``; raises on any failure."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with session.get(pod.url + "/v1/models", timeout=timeout) as resp:
        if resp.status != 200:
            raise RuntimeError(f"/v1/models answered HTTP {resp.status}")
        payload = await resp.json(content_type=None)
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        raise RuntimeError("/v1/models did not return an OpenAI model list")
    return frozenset(m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str))


async def refresh_pod(
    pod: Pod, session: aiohttp.ClientSession, config: DiscoveryConfig, metrics: GatewayMetrics
) -> bool:
    """Probe one pod and record the result in the registry entry. Returns whether the models changed."""
    before = pod.models
    try:
        models = await probe(pod, session, config.probe_timeout_s)
    except TimeoutError:
        if not pod.serving(time.monotonic()):
            _unreachable(pod, f"/v1/models timed out after {config.probe_timeout_s:g} s")
        # else: slow under load while live traffic gets answers; overload is not absence
    except (aiohttp.ClientError, RuntimeError, ValueError, RecursionError) as exc:
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
    session: aiohttp.ClientSession,
    config: DiscoveryConfig,
    metrics: GatewayMetrics,
    pods: tuple[Pod, ...] | None = None,
) -> None:
    changed = await asyncio.gather(
        *(refresh_pod(p, session, config, metrics) for p in (pods or registry.pods))
    )
    if any(changed):
        registry.reindex()


async def discovery_loop(
    registry: PodRegistry,
    session: Callable[[], aiohttp.ClientSession],
    config: DiscoveryConfig,
    metrics: GatewayMetrics,
) -> None:
    """Keep every pod's models and reachability current until cancelled."""
    next_full = time.monotonic() + config.refresh_interval_s
    while True:
        down = tuple(p for p in registry.pods if not p.reachable)
        await asyncio.sleep(config.retry_interval_s if down else config.refresh_interval_s)
        now = time.monotonic()
        try:
            if now >= next_full:
                next_full = now + config.refresh_interval_s
                await refresh_all(registry, session(), config, metrics)
            elif down:
                await refresh_all(registry, session(), config, metrics, down)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug in one round must not end discovery for good
            log.exception("discovery round failed")
