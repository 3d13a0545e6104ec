"""The per-host loops that write a pod registry: discovery (static, Kubernetes, DNS), probes, scrapes
and device sources. A single process runs them beside its requests; with ``serve --workers N`` the
supervisor runs them once for the host and feeds the workers (``gateway.workers``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gateway.config import DiscoveryConfig, PodConfig
from gateway.metrics import GatewayMetrics
from gateway.pods.discovery import discovery_loop, refresh_all
from gateway.pods.dns import DnsDiscovery
from gateway.pods.found import KubePod
from gateway.pods.monitor import PodMonitor
from gateway.pods.registry import PodRegistry


async def start_host_loops(
    registry: PodRegistry,
    monitor: PodMonitor,
    discovery: DiscoveryConfig,
    metrics: GatewayMetrics,
    static_pods: Callable[[], tuple[PodConfig, ...]],
) -> list[asyncio.Task[None]]:
    """One discovery round (the first requests already know every pod's models), then the loops as
    tasks; ``static_pods`` is the running config's pod list (it changes on reload)."""
    await refresh_all(registry, discovery, metrics)

    def discovered(pods: list[KubePod]) -> None:
        found_pods(registry, monitor, static_pods(), pods)

    loops = [
        asyncio.create_task(discovery_loop(registry, discovery, metrics), name="discovery"),
        asyncio.create_task(monitor.run(), name="pod-monitor"),
    ]
    if discovery.kubernetes is not None:
        from gateway.pods.kubernetes import KubernetesDiscovery  # its client only where it is used

        k8s = discovery.kubernetes
        watcher = KubernetesDiscovery(
            k8s.namespace, k8s.service, port_name=k8s.port_name, model_label=k8s.model_label,
            api_url=k8s.api_url, kubeconfig=k8s.kubeconfig, credentials=k8s.credentials,
        )
        loops.append(asyncio.create_task(watcher.run(discovered), name="kubernetes"))
    if discovery.dns is not None:
        dns = discovery.dns
        resolver = DnsDiscovery(
            dns.host, dns.port, models=dns.models, interval_s=dns.interval_s, credentials=dns.credentials
        )
        loops.append(asyncio.create_task(resolver.run(discovered), name="dns"))
    return loops


def found_pods(
    registry: PodRegistry, monitor: PodMonitor, static: tuple[PodConfig, ...], pods: list[KubePod]
) -> None:
    """A new snapshot from Kubernetes or DNS: the configured pods plus these.

    A pod whose endpoint is not ready (or terminating) stays in the registry as draining: no new
    streams, and the ones in flight finish. Its Kubernetes device health joins the other
    device sources."""
    registry.sync([*static, *(p.to_pod_config() for p in pods)])
    for found in pods:
        pod = registry.get(found.name)
        if pod is not None:
            registry.health_changed(pod, pod.health.set_draining(not found.ready))
    monitor.set_source("kubernetes", [v for p in pods for v in p.device_health])


def resync_static(
    registry: PodRegistry, running: tuple[PodConfig, ...], reloaded: tuple[PodConfig, ...]
) -> None:
    """A reload changed the config's pod list: ``reloaded`` in place of ``running``, every pod
    discovery found kept as it is."""
    static = {pod.name for pod in running}
    registry.sync([*reloaded, *(pod.config for pod in registry.pods if pod.name not in static)])
