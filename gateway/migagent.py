"""``sluicegate mig-agent``: a per-node agent that watches GPUs and MIG slices through NVML.

Why: the gateway must stop routing to a pod whose MIG slice (or whole GPU) has faulted, and learn it
within seconds, not when the next requests time out. The driver reports faults as XID events; this
agent listens for them the way NVIDIA's Kubernetes device plugin does (application XIDs are ignored; a
MIG-scoped XID marks only the slice whose GPU-instance/compute-instance ids it names; a device-wide XID
marks the GPU and every slice on it; unhealthy is sticky) and serves the result as JSON for the
gateway's ``health.devices.agent_urls`` (parsed by :mod:`gateway.health.mig_agent`).

All NVML calls block, so none runs on the event loop: :meth:`MigAgent.start` and :meth:`MigAgent.stop`
run before and after the loop (or in a worker thread), and one monitor thread waits for events and
re-reads the inventory every ``poll_ms``. HTTP handlers only read what that thread stored. The agent
takes the NVML bindings as a module-like object: the real ``pynvml``, or
:class:`loadtest.fakenvml.FakeNVML` for tests, through the same calls. See docs/mig-agent.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

from gateway.health.mig_agent import SCHEMA_VERSION
from gateway.health.xid import describe, is_critical
from gateway.side_server import serve_app

log = logging.getLogger("sluicegate.migagent")

ALL_INSTANCES = 0xFFFFFFFF  # an event's GI/CI id when the XID concerns the whole GPU
READY_PREFIX = "mig-agent listening on "
DEFAULT_PORT = 9477


@dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str
    name: str | None
    mig_mode: bool | None  # None: the GPU does not support MIG
    memory_total_bytes: int | None
    memory_used_bytes: int | None
    nvml_error: str | None = None  # set when the last refresh could not read this GPU


@dataclass(frozen=True)
class SliceInfo:
    gpu_uuid: str
    mig_uuid: str
    gpu_instance_id: int
    compute_instance_id: int
    profile: str | None
    memory_total_bytes: int | None
    memory_used_bytes: int | None


class MigAgent:
    """Inventory, XID events and sticky health for the GPUs NVML sees on this node."""

    def __init__(self, nvml: Any, *, node: str, poll_ms: int = 2000) -> None:
        self.nvml = nvml
        self.node = node
        self.poll_ms = poll_ms
        self.driver: str | None = None
        self._lock = threading.Lock()
        self._gpus: list[GpuInfo] = []
        self._slices: list[SliceInfo] = []
        self._updated_at: float | None = None
        self._faults: dict[str, str] = {}  # GPU or MIG UUID -> reason; sticky until cleared
        self._last_xid: dict[str, int] = {}  # GPU or MIG UUID -> last XID attributed to it
        self._watched: set[str] = set()  # GPU UUIDs registered for XID events
        self._event_set: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._initialised = False

    # --- lifecycle (blocking; never on the event loop) ------------------------------------------

    def start(self) -> None:
        """Initialise NVML, read the inventory, register for XID events and start the monitor thread.

        Raises the bindings' ``NVMLError`` when NVML cannot be initialised or the GPUs cannot be listed.
        """
        nvml = self.nvml
        nvml.nvmlInit()
        self._initialised = True
        try:
            self.driver = self._optional(nvml.nvmlSystemGetDriverVersion)
            self.refresh()
            self._register_events()
        except BaseException:
            self.stop()
            raise
        self._thread = threading.Thread(target=self._monitor, name="mig-agent-nvml", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the monitor thread, free the event set and shut NVML down."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.poll_ms / 1000 + 5)
            if self._thread.is_alive():  # still inside an NVML call: leave NVML to process exit
                log.warning("the NVML monitor thread did not stop in time")
                return
        if not self._initialised:
            return
        self._initialised = False
        with contextlib.suppress(self.nvml.NVMLError):
            if self._event_set is not None:
                self.nvml.nvmlEventSetFree(self._event_set)
        with contextlib.suppress(self.nvml.NVMLError):
            self.nvml.nvmlShutdown()

    def alive(self) -> bool:
        """True while the monitor thread runs."""
        return self._thread is not None and self._thread.is_alive()

    # --- NVML reads ------------------------------------------------------------------------------

    def _optional(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` for a nice-to-have field: None where the GPU or driver does not support it or
        NVML refuses it (a lost GPU still raises, so that the GPU is reported as such)."""
        nvml = self.nvml
        try:
            return fn(*args)
        except nvml.NVMLError_GpuIsLost:
            raise
        except nvml.NVMLError as exc:
            if not isinstance(exc, nvml.NVMLError_NotSupported | nvml.NVMLError_FunctionNotFound):
                log.debug("%s: %s", getattr(fn, "__name__", fn), exc)
            return None

    def _profile(self, mig: Any) -> str | None:
        """The MIG profile (``1g.10gb``): from the device name, else from its attributes."""
        name = self._optional(self.nvml.nvmlDeviceGetName, mig) or ""
        _, sep, tail = name.rpartition(" MIG ")
        if sep and tail.strip():
            return tail.strip()
        attrs = self._optional(self.nvml.nvmlDeviceGetAttributes, mig)
        if attrs is None:
            return None
        gi, ci = attrs.gpuInstanceSliceCount, attrs.computeInstanceSliceCount
        gb = math.ceil(attrs.memorySizeMB / 1024)
        return f"{gi}g.{gb}gb" if ci == gi else f"{ci}c.{gi}g.{gb}gb"

    def _read_slices(self, handle: Any, gpu_uuid: str) -> list[SliceInfo]:
        nvml = self.nvml
        found = []
        for slot in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except nvml.NVMLError_NotFound:  # an empty slot
                continue
            try:
                memory = self._optional(nvml.nvmlDeviceGetMemoryInfo, mig)
                found.append(
                    SliceInfo(
                        gpu_uuid=gpu_uuid,
                        mig_uuid=nvml.nvmlDeviceGetUUID(mig),
                        gpu_instance_id=nvml.nvmlDeviceGetGpuInstanceId(mig),
                        compute_instance_id=nvml.nvmlDeviceGetComputeInstanceId(mig),
                        profile=self._profile(mig),
                        memory_total_bytes=memory.total if memory is not None else None,
                        memory_used_bytes=memory.used if memory is not None else None,
                    )
                )
            except nvml.NVMLError as exc:  # e.g. the slice was destroyed while we looked
                log.warning("GPU %s MIG slot %d: %s", gpu_uuid, slot, exc)
        return found

    def _read_gpu(self, index: int) -> tuple[GpuInfo, list[SliceInfo]]:
        nvml = self.nvml
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        uuid = nvml.nvmlDeviceGetUUID(handle)
        mode = self._optional(nvml.nvmlDeviceGetMigMode, handle)
        mig_mode = None if mode is None else mode[0] == nvml.NVML_DEVICE_MIG_ENABLE
        memory = self._optional(nvml.nvmlDeviceGetMemoryInfo, handle)
        gpu = GpuInfo(
            index=index,
            uuid=uuid,
            name=self._optional(nvml.nvmlDeviceGetName, handle),
            mig_mode=mig_mode,
            memory_total_bytes=memory.total if memory is not None else None,
            memory_used_bytes=memory.used if memory is not None else None,
        )
        return gpu, self._read_slices(handle, uuid) if mig_mode else []

    def refresh(self) -> None:
        """Re-read GPUs and slices. A GPU that cannot be read keeps its last known entry."""
        nvml = self.nvml
        with self._lock:
            previous = {gpu.index: gpu for gpu in self._gpus}
            previous_slices = list(self._slices)
        gpus: list[GpuInfo] = []
        slices: list[SliceInfo] = []
        for index in range(nvml.nvmlDeviceGetCount()):
            try:
                gpu, found = self._read_gpu(index)
            except nvml.NVMLError as exc:
                old = previous.get(index)
                log.warning("GPU %d (%s): %s", index, old.uuid if old else "unknown", exc)
                if old is None:
                    continue
                gpu = replace(old, nvml_error=str(exc))
                found = [s for s in previous_slices if s.gpu_uuid == old.uuid]
                if isinstance(exc, nvml.NVMLError_GpuIsLost):
                    with self._lock:
                        self._faults.setdefault(old.uuid, f"NVML: {exc}")
            gpus.append(gpu)
            slices.extend(found)
        with self._lock:
            self._gpus, self._slices, self._updated_at = gpus, slices, time.time()

    def _register_events(self) -> None:
        nvml = self.nvml
        try:
            self._event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            log.warning("cannot create an NVML event set (%s): XIDs will not be seen", exc)
            return
        for gpu in self._gpus:
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(gpu.index)
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self._event_set)
            except nvml.NVMLError as exc:
                log.warning("GPU %s: cannot register for XID events (%s): its faults will not be seen",
                            gpu.uuid, exc)
                continue
            self._watched.add(gpu.uuid)

    # --- events ----------------------------------------------------------------------------------

    def _monitor(self) -> None:
        """The monitor thread: wait for XID events, and re-read the inventory every ``poll_ms``."""
        nvml = self.nvml
        next_refresh = time.monotonic() + self.poll_ms / 1000
        last_error = ""
        while not self._stop.is_set():
            if self._event_set is None or not self._watched:
                self._stop.wait(self.poll_ms / 1000)
            else:
                try:
                    event = nvml.nvmlEventSetWait(self._event_set, self.poll_ms)
                except nvml.NVMLError_Timeout:
                    pass
                except nvml.NVMLError as exc:
                    if str(exc) != last_error:
                        log.warning("waiting for NVML events: %s", exc)
                        last_error = str(exc)
                    self._stop.wait(self.poll_ms / 1000)
                else:
                    last_error = ""
                    try:
                        self._on_event(event)
                    except Exception:  # never let one event end the monitor thread
                        log.exception("handling NVML event %r", event)
            if time.monotonic() >= next_refresh and not self._stop.is_set():
                try:
                    self.refresh()
                except Exception:
                    log.exception("refreshing the GPU inventory")
                next_refresh = time.monotonic() + self.poll_ms / 1000

    def _targets(self, gpu_uuid: str | None, gi: int, ci: int) -> list[str]:
        """The UUIDs an XID event concerns, from the current inventory; [] if nothing matches."""
        with self._lock:
            if gpu_uuid is None:  # as the device plugin: an event we cannot place concerns every GPU
                return [gpu.uuid for gpu in self._gpus]
            gpu = next((g for g in self._gpus if g.uuid == gpu_uuid), None)
            if gpu is None:
                return []
            if not gpu.mig_mode or gi == ALL_INSTANCES:
                return [gpu.uuid]
            return [
                s.mig_uuid
                for s in self._slices
                if s.gpu_uuid == gpu_uuid
                and s.gpu_instance_id == gi
                and ci in (ALL_INSTANCES, s.compute_instance_id)
            ]

    def _on_event(self, event: Any) -> None:
        nvml = self.nvml
        if not event.eventType & nvml.nvmlEventTypeXidCriticalError:
            return
        xid, gi, ci = int(event.eventData), int(event.gpuInstanceId), int(event.computeInstanceId)
        try:
            gpu_uuid: str | None = nvml.nvmlDeviceGetUUID(event.device)
        except nvml.NVMLError as exc:
            log.warning("XID %d on a GPU NVML cannot name (%s)", xid, exc)
            gpu_uuid = None
        targets = self._targets(gpu_uuid, gi, ci)
        if not targets:  # perhaps a slice created since the last refresh
            self.refresh()
            targets = self._targets(gpu_uuid, gi, ci)
        scope = "device-wide" if gi == ALL_INSTANCES else f"GI {gi} CI {ci if ci != ALL_INSTANCES else '*'}"
        if not targets:
            log.warning("XID %d (%s) on GPU %s %s matches no known device; ignored", xid, describe(xid),
                        gpu_uuid, scope)
            return
        critical = is_critical(xid)
        reason = f"XID {xid} ({describe(xid)})"
        with self._lock:
            for uuid in targets:
                self._last_xid[uuid] = xid
                if critical:
                    self._faults.setdefault(uuid, reason)  # the first fault is the one to explain
        verdict = "unhealthy" if critical else "ignored (application XID)"
        log.warning("%s on GPU %s %s -> %s: %s", reason, gpu_uuid, scope, ", ".join(targets), verdict)

    # --- state for HTTP (no NVML calls) ----------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The ``GET /v1/devices`` document (schema in docs/mig-agent.md)."""
        with self._lock:
            gpus = [
                {
                    "uuid": g.uuid,
                    "index": g.index,
                    "name": g.name,
                    "mig_mode": g.mig_mode,
                    "memory_total_bytes": g.memory_total_bytes,
                    "memory_used_bytes": g.memory_used_bytes,
                    "xid_events": g.uuid in self._watched,
                    "healthy": g.uuid not in self._faults,
                    "reason": self._faults.get(g.uuid),
                    "last_xid": self._last_xid.get(g.uuid),
                    "nvml_error": g.nvml_error,
                }
                for g in self._gpus
            ]
            slices = []
            for s in self._slices:
                fault = self._faults.get(s.mig_uuid) or self._faults.get(s.gpu_uuid)
                slices.append(
                    {
                        "gpu_uuid": s.gpu_uuid,
                        "mig_uuid": s.mig_uuid,
                        "gpu_instance_id": s.gpu_instance_id,
                        "compute_instance_id": s.compute_instance_id,
                        "profile": s.profile,
                        "memory_total_bytes": s.memory_total_bytes,
                        "memory_used_bytes": s.memory_used_bytes,
                        "healthy": fault is None,
                        "reason": fault,
                        "last_xid": self._last_xid.get(s.mig_uuid),
                    }
                )
            return {
                "schema_version": SCHEMA_VERSION,
                "node": self.node,
                "driver": self.driver,
                "updated_at": self._updated_at,
                "gpus": gpus,
                "slices": slices,
            }

    def clear(self, uuid: str) -> list[str]:
        """Forget the faults of a GPU (and its slices) or of one slice; the UUIDs cleared.

        Raises KeyError for a UUID the agent does not know.
        """
        with self._lock:
            slices = [s.mig_uuid for s in self._slices if s.gpu_uuid == uuid]
            known = {g.uuid for g in self._gpus} | {s.mig_uuid for s in self._slices} | self._faults.keys()
            if uuid not in known:
                raise KeyError(uuid)
            cleared = [u for u in (uuid, *slices) if self._faults.pop(u, None) is not None]
        if cleared:
            log.warning("operator cleared faults of %s", ", ".join(cleared))
        return cleared


# --- HTTP -----------------------------------------------------------------------------------------


def make_app(agent: MigAgent) -> web.Application:
    """``GET /healthz``, ``GET /v1/devices`` and ``POST /v1/clear`` over ``agent``."""

    async def healthz(_: web.Request) -> web.Response:
        if agent.alive():
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "the NVML monitor thread is not running"}, status=503)

    async def devices(_: web.Request) -> web.Response:
        return web.json_response(agent.snapshot())

    async def clear(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            body = None
        uuid = body.get("uuid") if isinstance(body, dict) else None
        if not isinstance(uuid, str) or not uuid:
            message = 'expected a JSON body {"uuid": "GPU-... or MIG-..."}'
            return web.json_response({"error": message}, status=400)
        try:
            cleared = agent.clear(uuid)
        except KeyError:
            return web.json_response({"error": f"unknown device {uuid}"}, status=404)
        return web.json_response({"cleared": cleared})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/devices", devices)
    app.router.add_post("/v1/clear", clear)
    return app


async def serve(
    agent: MigAgent,
    host: str,
    port: int,
    *,
    announce: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve ``agent`` (already started) until ``stop`` is set; without ``stop``, until SIGTERM/SIGINT."""
    runner = web.AppRunner(make_app(agent), access_log=None, shutdown_timeout=0.5)
    await serve_app(runner, host, port, announce=announce, stop=stop)


# --- command line ---------------------------------------------------------------------------------


def _poll_ms(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 10:
        raise argparse.ArgumentTypeError(f"expected milliseconds >= 10, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The agent's flags, shared by ``python -m gateway.migagent`` and ``sluicegate mig-agent``."""
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port; 0 picks a free one (default {DEFAULT_PORT})"
    )
    parser.add_argument(
        "--node-name",
        default=os.environ.get("NODE_NAME") or socket.gethostname(),
        help="node name to report (default: $NODE_NAME, else the hostname)",
    )
    parser.add_argument(
        "--poll-ms", type=_poll_ms, default=2000,
        help="longest wait for an XID event, and how often the inventory is re-read (default 2000)",
    )
    parser.add_argument(
        "--fake-nvml", metavar="SPEC_FILE",
        help="use loadtest.fakenvml configured by this JSON/YAML spec instead of the NVIDIA driver",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def load_nvml(fake_spec: str | None) -> Any:
    """The real ``pynvml`` module, or a fake NVML built from ``fake_spec``."""
    if fake_spec:
        from loadtest.fakenvml import FakeNVML

        return FakeNVML.from_file(fake_spec)
    import pynvml

    return pynvml


def run(args: argparse.Namespace) -> int:
    """Run until SIGTERM/SIGINT: 0 on a clean stop, 1 if the port cannot be bound, 2 without NVML."""
    logging.basicConfig(level=args.log_level.upper(), format="mig-agent %(levelname)s %(message)s")
    try:
        nvml = load_nvml(args.fake_nvml)
    except (OSError, ValueError) as exc:
        print(f"mig-agent: cannot load the fake NVML spec: {exc}", file=sys.stderr)
        return 2
    agent = MigAgent(nvml, node=args.node_name, poll_ms=args.poll_ms)
    try:
        agent.start()
    except nvml.NVMLError as exc:
        print(
            f"mig-agent: cannot initialise NVML: {exc} (needs the NVIDIA driver's libnvidia-ml.so.1 "
            "and /dev/nvidia* in the container; --fake-nvml SPEC runs on a fake)",
            file=sys.stderr,
        )
        return 2
    def announce(url: str) -> None:
        print(READY_PREFIX + url, flush=True)

    try:
        asyncio.run(serve(agent, args.host, args.port, announce=announce))
    except OSError as exc:
        print(f"mig-agent: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        agent.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m gateway.migagent [flags]``; ``sluicegate mig-agent`` takes the same flags."""
    parser = argparse.ArgumentParser(
        prog="sluicegate mig-agent",
        description="Serve the health of this node's GPUs and MIG slices, from NVML XID events, as JSON.",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
