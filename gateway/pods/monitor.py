"""The pod monitor: probes, scrapes and device-health sources, written into the registry.

Three loops, each on its own interval: ``GET /health`` of every pod (health with hysteresis), each
pod's own ``/metrics`` (KV cache and queue: the pressure breaker and the load score), and the GPU
sources (dcgm-exporter, the mig-agent) whose verdicts are matched to pods by GPU UUID plus GPU
instance id or by MIG UUID. A source that cannot be reached keeps its last verdicts: a fault is not
forgotten because the exporter restarted.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

from gateway.config import HealthConfig
from gateway.health.dcgm import parse_dcgm
from gateway.health.mig_agent import parse_agent_devices
from gateway.health.verdict import DeviceKey, DeviceVerdict
from gateway.health.vllm_metrics import PodLoad, parse_vllm_metrics
from gateway.pods.prober import ProbeResult, probe_get, probe_health
from gateway.pods.registry import Pod, PodRegistry
from gateway.pods.state import Load

MAX_PAGE_BYTES = 16 * 1024 * 1024  # a pod's /metrics or a device source's page; a real one is ~100 KB

log = logging.getLogger("sluicegate.monitor")

ITL_MIN_TOKENS = 20  # fewer new inter-token gaps than this between two scrapes say nothing of a pod's pace


def matches(key: DeviceKey, pod: Pod, parents: Mapping[str, tuple[str, int | None]] | None = None) -> bool:
    """Whether a device verdict concerns ``pod``: its slice, its whole GPU, or the pod by name.

    ``parents`` maps MIG UUIDs to their parent GPU and GPU instance, as the sources reported them:
    a pod known only by its slice (Kubernetes device health names the MIG device, not its GPU) still
    hears of a fault on its whole GPU.
    """
    if key.pod is not None:
        return key.pod == pod.name or key.pod.rsplit("/", 1)[-1] == pod.name
    mig = pod.config.mig
    if mig is None:
        return False
    if key.mig_uuid is not None:
        return key.mig_uuid == mig.mig_uuid
    gpu, instance = mig.gpu_uuid, mig.gpu_instance_id
    if gpu is None and parents and mig.mig_uuid in parents:
        gpu, learned = parents[mig.mig_uuid]
        instance = learned if instance is None else instance
    if key.gpu_uuid is None or key.gpu_uuid != gpu:
        return False
    return key.gpu_instance_id is None or key.gpu_instance_id == instance


class DeviceFaults:
    """The latest verdicts of every device source, and each pod's sticky device fault.

    A fault, once seen, stays with the pod even when its source stops reporting it (an exporter
    restart, a driver reload): like NVIDIA's device plugin, a slice that had a critical fault is
    not trusted again until someone says so: the pod is replaced (a new name), an operator clears
    it, or the quarantine ends with clean probes. A cleared fault is not raised again while the
    source keeps repeating the same verdict (DCGM's XID gauge shows the last XID until reset); once no
    source reports it any more, it is forgotten, so the next occurrence is a new fault.
    """

    def __init__(self) -> None:
        self.by_source: dict[str, list[DeviceVerdict]] = {}
        self.sticky: dict[str, str] = {}  # pod name -> the fault that made it unroutable
        self.cleared: dict[str, set[str]] = {}  # pod name -> reasons cleared for it
        self.parents: dict[str, tuple[str, int | None]] = {}  # MIG UUID -> (GPU UUID, GPU instance)

    def update(self, source: str, verdicts: list[DeviceVerdict]) -> None:
        self.by_source[source] = verdicts
        for verdict in verdicts:
            key = verdict.key
            if key.mig_uuid is not None and key.gpu_uuid is not None:
                self.parents[key.mig_uuid] = (key.gpu_uuid, key.gpu_instance_id)

    def fault_for(self, pod: Pod) -> str | None:
        cleared = self.cleared.get(pod.name, set())
        if cleared:  # forget cleared faults that no source repeats: if one comes back, it is new
            cleared &= {
                verdict.reason
                for verdicts in self.by_source.values()
                for verdict in verdicts
                if not verdict.healthy and matches(verdict.key, pod, self.parents)
            }
        if pod.name not in self.sticky:
            for verdicts in self.by_source.values():
                for verdict in verdicts:
                    if verdict.healthy or verdict.reason in cleared:
                        continue
                    if matches(verdict.key, pod, self.parents):
                        self.sticky[pod.name] = f"{verdict.reason} ({verdict.source})"
                        break
        return self.sticky.get(pod.name)

    def clear(self, pod: Pod) -> None:
        """Forget the pod's device fault (an operator checked the slice, or quarantine ended)."""
        self.sticky.pop(pod.name, None)
        for verdicts in self.by_source.values():
            for verdict in verdicts:
                if not verdict.healthy and matches(verdict.key, pod, self.parents):
                    self.cleared.setdefault(pod.name, set()).add(verdict.reason)


class PodMonitor:
    """Runs the health loops for a registry until cancelled."""

    def __init__(
        self,
        registry: PodRegistry,
        config: HealthConfig,
    ) -> None:
        self.registry = registry
        self.config = config
        self.devices = DeviceFaults()
        self._probe_threads: ThreadPoolExecutor | None = None
        self._page_threads: ThreadPoolExecutor | None = None  # scrapes, device pages: apart from probes

    async def run(self) -> None:
        self._probe_threads = ThreadPoolExecutor(max_workers=16, thread_name_prefix="sluicegate-probe")
        self._page_threads = ThreadPoolExecutor(max_workers=16, thread_name_prefix="sluicegate-scrape")
        try:
            await self._run()
        finally:
            self._probe_threads.shutdown(wait=False, cancel_futures=True)
            self._page_threads.shutdown(wait=False, cancel_futures=True)
            self._probe_threads = self._page_threads = None

    async def _run(self) -> None:
        loops = [self._every(self.config.probe.interval_s, self.probe_all),
                 self._every(self.config.scrape.interval_s, self.scrape_all),
                 self._every(1.0, self._tick)]
        devices = self.config.devices
        if devices.dcgm_urls or devices.agent_urls:
            loops.append(self._every(devices.interval_s, self.check_devices))
        await asyncio.gather(*loops)

    async def _every(self, interval_s: float, step: Callable[[], Awaitable[None]]) -> None:
        """Run ``step`` on a fixed cadence: a round that takes a while does not push the next one
        back (a fault is seen within one interval, not one interval plus a round's length)."""
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in one round must not stop the monitor
                log.exception("health round failed")
            due = max(due + interval_s, loop.time())  # an overrun round is followed at once, not doubled
            await asyncio.sleep(due - loop.time())

    async def _tick(self) -> None:
        self.registry.tick(time.monotonic())

    # -- probes --------------------------------------------------------------------------------------

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(pod) for pod in self.registry.pods))

    async def probe(self, pod: Pod) -> None:
        """One probe, timed on a probe thread (see ``prober``), and what it means for the pod.

        A probe that timed out is not held against a pod that live traffic shows serving (a first
        token or a 2xx within ``passive_window_s``): overload is not failure. An answer that is not
        200, or a refused connection, counts whatever the traffic says.
        """
        loop = asyncio.get_running_loop()
        timeout_s = self.config.probe.timeout_s
        # self._probe_threads is None when not running (a test calling probe directly): the default pool
        result = await loop.run_in_executor(
            self._probe_threads, probe_health, pod.host, pod.port, pod.tls, timeout_s, pod.server_name
        )
        self.record_probe(pod, result, time.monotonic())

    def record_probe(self, pod: Pod, result: ProbeResult, now: float) -> None:
        metrics = self.registry.metrics
        if metrics is not None:
            metrics.child(metrics.probes, pod.name, result.outcome).observe(result.seconds)
        if not result.ok and not result.hard and pod.serving(now):
            if metrics is not None:
                metrics.child(metrics.probes_excused, pod.name).inc()
            if pod.health.probe_excused():
                log.warning(
                    "pod %s: /health %s but live traffic got answers %.1f s ago: overloaded, not broken",
                    pod.name, result.detail, now - pod.served_at,
                )
            return
        if result.ok and pod.health.quarantine_over(now, self.config.devices.quarantine_s):
            log.warning("pod %s: quarantine over; clearing %s", pod.name, pod.health.device_fault)
            self.devices.clear(pod)
            self.registry.health_changed(pod, pod.health.set_device_fault(None, now))
        self.registry.health_changed(pod, pod.health.probe_result(result.ok, result.detail, result.hard))

    # -- the pods' own metrics ----------------------------------------------------------------------

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape(pod) for pod in self.registry.pods if pod.reachable))

    async def _get(
        self, host: str, port: int, tls: ssl.SSLContext | bool | None, path: str, timeout_s: float,
        server_name: str | None = None,
    ) -> ProbeResult:
        """One ``GET`` on a thread, as the probes (``prober``) but from a pool of its own, so that slow
        pages never hold a probe back: a loop busy relaying tokens neither delays it nor is blocked
        by it, and the gateway needs no second HTTP client."""
        loop = asyncio.get_running_loop()
        get = functools.partial(probe_get, host, port, tls, path, timeout_s, MAX_PAGE_BYTES, server_name)
        return await loop.run_in_executor(self._page_threads, get)

    async def scrape(self, pod: Pod) -> None:
        # no credentials (vLLM's --api-key leaves /metrics open); https:// pods get the shared context
        result = await self._get(pod.host, pod.port, pod.tls, "/metrics", self.config.scrape.timeout_s,
                                 pod.server_name)
        if not result.ok:
            return  # stale data ages out by itself
        try:
            parsed = parse_vllm_metrics(result.body.decode())
        except (ValueError, UnicodeDecodeError) as exc:
            log.warning("pod %s: unreadable /metrics: %s", pod.name, exc)
            return
        now = time.monotonic()
        load = pod.load
        load.kv_cache_usage = parsed.kv_cache_usage
        load.running = parsed.num_requests_running
        load.waiting = parsed.num_requests_waiting
        if parsed.ttft_count is not None:
            previous = load.ttft_seen
            if previous is not None and now > previous[1] and parsed.ttft_count >= previous[0]:
                load.drain_per_s = (parsed.ttft_count - previous[0]) / (now - previous[1])
            load.ttft_seen = (parsed.ttft_count, now)
        self._inter_token_pace(load, parsed)
        load.scraped_at = now
        self.registry.load_changed(pod, pod.pressure.update(load))

    def _inter_token_pace(self, load: Load, parsed: PodLoad) -> None:
        """The pod's p95 inter-token gap over its latest ITL_MIN_TOKENS or more gaps.

        Measured from a reference scrape that moves on only once enough new gaps were counted, so an
        idle pod keeps its last known pace instead of forgetting it between two quiet scrapes.
        """
        if parsed.itl_buckets is None:
            return
        reference = load.itl_reference
        if reference is None or reference.itl_buckets is None or (
            parsed.itl_buckets[-1][1] < reference.itl_buckets[-1][1]  # the pod restarted
        ):
            load.itl_reference = parsed
            return
        p95 = parsed.itl_quantile_since(reference, 0.95, ITL_MIN_TOKENS)
        if p95 is not None:
            load.itl_p95_s = p95
            load.itl_reference = parsed

    # -- GPU and MIG-slice sources ------------------------------------------------------------------

    async def check_devices(self) -> None:
        devices = self.config.devices
        await asyncio.gather(
            *(self._source(url, "dcgm") for url in devices.dcgm_urls),
            *(self._source(url.rstrip("/") + "/v1/devices", "mig-agent") for url in devices.agent_urls),
        )
        self.apply_device_faults()

    async def _source(self, url: str, kind: str) -> None:
        parts = urlsplit(url)
        https = parts.scheme == "https"
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        try:  # a port that is no number (ValueError) is said every round, as any unreadable source
            port = parts.port or (443 if https else 80)
            result = await self._get(parts.hostname or "", port, https, path, self.config.devices.timeout_s)
            if not result.ok:
                raise ValueError(result.detail)
            verdicts = self._parse(kind, result.body)
        except ValueError as exc:
            log.warning("device source %s unavailable, keeping its last verdicts: %s", url, exc)
            return
        self.devices.update(url, verdicts)

    def _parse(self, kind: str, body: bytes) -> list[DeviceVerdict]:
        if kind == "dcgm":
            return parse_dcgm(body, self.config.devices.max_temp_c).verdicts
        return parse_agent_devices(body)

    def set_source(self, source: str, verdicts: Iterable[DeviceVerdict]) -> None:
        """Verdicts pushed by another loop (Kubernetes device health from discovery)."""
        self.devices.update(source, list(verdicts))
        self.apply_device_faults()

    def apply_device_faults(self) -> None:
        now = time.monotonic()
        for pod in self.registry.pods:
            fault = self.devices.fault_for(pod)
            if fault != pod.health.device_fault:
                self.registry.health_changed(pod, pod.health.set_device_fault(fault, now))

    def clear(self, pod: Pod) -> None:
        """Operator action: the slice was checked; route to the pod again (probes permitting)."""
        self.devices.clear(pod)
        self.registry.health_changed(pod, pod.health.set_device_fault(None, time.monotonic()))
