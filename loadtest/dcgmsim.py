"""A fake dcgm-exporter: GPU and MIG-slice metrics in the real exporter's text, with faults on demand.

The gateway's DCGM health source must be tested against GPUs that overheat, lose ECC or fall off the
bus, which no test machine will do when asked. This serves ``/metrics`` the way dcgm-exporter 4.x does
(HELP/TYPE lines, metric names, label names and order as in shared/wire/dcgm-exporter-mig.txt) for a
configured set of GPUs and slices, and lets a test inject and clear faults over HTTP.

What lives where, as with the real exporter:

- Per slice (``GPU_I_PROFILE``/``GPU_I_ID``, plus ``container``/``namespace``/``pod`` when the slice is
  mapped to a pod): ``DCGM_FI_DEV_FB_USED``, ``DCGM_FI_DEV_FB_FREE``, ``DCGM_FI_PROF_GR_ENGINE_ACTIVE``.
  A GPU without MIG reports them once, GPU-wide (with its pod's labels when mapped).
- Per GPU only: temperature, last XID, row-remap failure, double-bit ECC. DCGM reads these fields on the
  GPU entity, so the exporter's series for them never carry ``GPU_I_ID`` (see the sample). A fault
  injected "on a slice" therefore shows on its parent GPU's series, exactly as a real XID raised inside
  one MIG instance does: DCGM consumers cannot tell which slice it hit. The request is still checked
  against the slice list, and the answer says ``"rendered_on": "gpu"``.

Non-label attributes follow the exporter's ordering: the XID's ``err_code``/``err_msg`` and the pod
mapping's ``container``/``namespace``/``pod`` come last, sorted by name. Floating-point fields are written
with six decimals (Go's ``%f``), integer fields as integers. ``err_msg`` is the exporter's "No Error" for
0 and this project's own wording (gateway.health.xid.describe) otherwise.

HTTP API (JSON bodies and answers):

- ``GET /metrics``: the exporter's page.
- ``POST /faults``: ``{"gpu_uuid": "GPU-...", "gpu_instance_id": null | int, "xid": 79}``, or any of
  ``"ecc_dbe": 2``, ``"row_remap_failure": 1``, ``"temp_c": 95``, several at once; merged into the GPU's
  state until cleared. ``gpu_uuid`` may be left out when there is one GPU. 400 for unknown GPUs, slices
  or keys, or bad values.
- ``POST /usage``: ``{"gpu_uuid", "gpu_instance_id", "fb_used_mib": N, "gr_engine_active": 0.5}`` sets
  one slice's gauges (FB_FREE follows from the slice's size).
- ``DELETE /faults`` (all GPUs) or ``DELETE /faults?gpu_uuid=GPU-...``: back to a healthy GPU.
- ``GET /faults``: the fault state of every GPU.

Command line: ``python -m loadtest.dcgmsim --port 9400 --gpu GPU-...:1g.10gb@9=llm/pod-a,2g.20gb@3``
(see ``--help``); once listening it prints one line, ``dcgmsim listening on http://HOST:PORT``, which
:class:`DcgmsimProcess` waits for.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from aiohttp import web

from gateway.health.xid import describe
from gateway.side_server import serve_app
from loadtest.announced import AnnouncedServer, StartError
from loadtest.podsim.engine import parse_mig_profile

READY_PREFIX = "dcgmsim listening on "
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
WHOLE_GPU_GB = 80
USABLE_FRACTION = 0.95  # of a slice's nominal size that DCGM reports as framebuffer (9728 MiB for 10 GB)
MAPPED_USED_FRACTION = 0.875  # a slice with a vLLM pod on it: vLLM preallocates most of the memory
DEFAULT_TEMP_C = 45

# (name, type, help) in the sample's order; device-level ones have no per-slice series
_FAMILIES = [
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB)."),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB)."),
    ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge", "Ratio of time the graphics engine is active."),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C)."),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered."),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed"),
    (
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "counter",
        "Total number of double-bit volatile ECC errors (off by default; needs a custom counters file).",
    ),
]
_PER_SLICE = {"DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_PROF_GR_ENGINE_ACTIVE"}


# --- configuration -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PodRef:
    """The pod a device is mapped to (dcgm-exporter's Kubernetes mapping)."""

    namespace: str
    name: str
    container: str = "vllm"


@dataclass(frozen=True, slots=True)
class SliceSpec:
    """One MIG slice: its profile, DCGM's GPU instance id, and optionally its pod."""

    profile: str
    gpu_instance_id: int
    pod: PodRef | None = None


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU: its UUID and its MIG slices (none: a whole GPU, then optionally mapped to a pod)."""

    uuid: str
    slices: tuple[SliceSpec, ...] = ()
    pod: PodRef | None = None


def _pod_ref(text: str) -> PodRef:
    parts = text.split("/")
    if len(parts) not in (2, 3) or not all(parts):
        raise ValueError(f"a pod is NAMESPACE/NAME or NAMESPACE/NAME/CONTAINER, got {text!r}")
    return PodRef(*parts)


def parse_gpu_spec(text: str) -> GpuSpec:
    """``GPU-uuid`` | ``GPU-uuid=NS/POD[/CONTAINER]`` | ``GPU-uuid:PROFILE@GI[=NS/POD[/CONTAINER]],...``."""
    uuid, colon, rest = text.strip().partition(":")
    pod = None
    if not colon:
        uuid, eq, mapped = uuid.partition("=")
        pod = _pod_ref(mapped) if eq else None
    if not uuid.startswith("GPU-") or len(uuid) <= 4:
        raise ValueError(f"a GPU UUID starts with 'GPU-', got {uuid!r}")
    slices = []
    for item in rest.split(",") if colon else []:
        where, eq, mapped = item.strip().partition("=")
        profile, at, instance = where.partition("@")
        if not at or not instance.isdigit():
            raise ValueError(f"a slice is PROFILE@GPU_I_ID[=NS/POD[/CONTAINER]], got {item!r}")
        parse_mig_profile(profile)
        slices.append(SliceSpec(profile, int(instance), _pod_ref(mapped) if eq else None))
    ids = [s.gpu_instance_id for s in slices]
    if len(set(ids)) != len(ids):
        raise ValueError(f"GPU instance ids repeat on {uuid}: {ids}")
    if colon and not slices:
        raise ValueError(f"no slices after ':' in {text!r}")
    return GpuSpec(uuid, tuple(slices), pod)


@dataclass(slots=True)
class GpuFaults:
    """A GPU's device-level fields; the defaults are a healthy GPU."""

    xid: int = 0
    ecc_dbe: int = 0
    row_remap_failure: int = 0
    temp_c: int = DEFAULT_TEMP_C


@dataclass(slots=True)
class _Usage:
    total_mib: int
    used_mib: int
    gr_engine_active: float = 0.0


@dataclass
class DcgmsimConfig:
    """Everything the fake exporter reports besides faults."""

    gpus: list[GpuSpec]
    hostname: str = field(default_factory=socket.gethostname)
    hostname_label: str = "Hostname"  # newer exporters: "hostname"
    model_name: str = "NVIDIA A100-SXM4-80GB"
    driver_version: str = "570.172.08"
    ecc: bool = True  # ECC counters are off in the real exporter's default counters file


# --- the exporter ----------------------------------------------------------------------------------


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _series(name: str, labels: list[tuple[str, str]], value: str) -> str:
    inner = ",".join(f'{key}="{_escape(val)}"' for key, val in labels)
    return f"{name}{{{inner}}} {value}"


def _pod_attrs(pod: PodRef | None) -> dict[str, str]:
    return {"container": pod.container, "namespace": pod.namespace, "pod": pod.name} if pod else {}


def _int_field(body: dict[str, Any], key: str, maximum: int | None = None) -> int:
    value = body[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0 or value != int(value):
        raise ValueError(f"{key} must be a whole number >= 0, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{key} must be at most {maximum}, got {value!r}")
    return int(value)


class Dcgmsim:
    """The fake exporter's state (GPUs, slices, faults) and its aiohttp application."""

    FAULT_KEYS = ("xid", "ecc_dbe", "row_remap_failure", "temp_c")

    def __init__(self, config: DcgmsimConfig) -> None:
        if not config.gpus:
            raise ValueError("the exporter needs at least one GPU")
        uuids = [g.uuid for g in config.gpus]
        if len(set(uuids)) != len(uuids):
            raise ValueError(f"GPU UUIDs repeat: {uuids}")
        self.config = config
        self.gpus = {g.uuid: g for g in config.gpus}
        self.faults = {uuid: GpuFaults() for uuid in self.gpus}
        self.usage: dict[tuple[str, int | None], _Usage] = {}
        for gpu in config.gpus:
            targets = [(s.gpu_instance_id, parse_mig_profile(s.profile)[1], s.pod) for s in gpu.slices]
            for instance, gb, pod in targets or [(None, WHOLE_GPU_GB, gpu.pod)]:
                total = round(gb * 1024 * USABLE_FRACTION)
                used = round(total * MAPPED_USED_FRACTION) if pod else 0
                self.usage[(gpu.uuid, instance)] = _Usage(total, used)

    # --- rendering ---------------------------------------------------------------------------

    def _base(self, index: int, gpu: GpuSpec, mig: SliceSpec | None) -> list[tuple[str, str]]:
        labels = [
            ("gpu", str(index)),
            ("UUID", gpu.uuid),
            ("pci_bus_id", f"00000000:{0x07 + 0x10 * index:02X}:00.0"),
            ("device", f"nvidia{index}"),
            ("modelName", self.config.model_name),
        ]
        if mig is not None:
            labels += [("GPU_I_PROFILE", mig.profile), ("GPU_I_ID", str(mig.gpu_instance_id))]
        labels += [
            (self.config.hostname_label, self.config.hostname),
            ("DCGM_FI_DRIVER_VERSION", self.config.driver_version),
        ]
        return labels

    def _slice_value(self, name: str, usage: _Usage) -> str:
        if name == "DCGM_FI_DEV_FB_USED":
            return str(usage.used_mib)
        if name == "DCGM_FI_DEV_FB_FREE":
            return str(usage.total_mib - usage.used_mib)
        return f"{usage.gr_engine_active:f}"

    def _gpu_value(self, name: str, faults: GpuFaults) -> tuple[str, dict[str, str]]:
        if name == "DCGM_FI_DEV_GPU_TEMP":
            return str(faults.temp_c), {}
        if name == "DCGM_FI_DEV_XID_ERRORS":
            message = describe(faults.xid) if faults.xid else "No Error"
            return str(faults.xid), {"err_code": str(faults.xid), "err_msg": message}
        if name == "DCGM_FI_DEV_ROW_REMAP_FAILURE":
            return str(faults.row_remap_failure), {}
        return str(faults.ecc_dbe), {}

    def render(self) -> str:
        """The ``/metrics`` page as dcgm-exporter writes it."""
        lines = []
        for name, kind, text in _FAMILIES:
            if name == "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL" and not self.config.ecc:
                continue
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
            for index, gpu in enumerate(self.config.gpus):
                if name in _PER_SLICE:
                    for mig in gpu.slices or (None,):
                        usage = self.usage[(gpu.uuid, mig.gpu_instance_id if mig else None)]
                        attrs = _pod_attrs(mig.pod if mig else gpu.pod)
                        labels = self._base(index, gpu, mig) + sorted(attrs.items())
                        lines.append(_series(name, labels, self._slice_value(name, usage)))
                else:
                    value, attrs = self._gpu_value(name, self.faults[gpu.uuid])
                    attrs |= {} if gpu.slices else _pod_attrs(gpu.pod)
                    lines.append(_series(name, self._base(index, gpu, None) + sorted(attrs.items()), value))
        return "\n".join(lines) + "\n"

    # --- faults and usage --------------------------------------------------------------------

    def _target(self, body: Any, allowed: tuple[str, ...]) -> tuple[str, int | None]:
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        unknown = set(body) - {"gpu_uuid", "gpu_instance_id", *allowed}
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}; known: gpu_uuid, gpu_instance_id, {allowed}")
        if not any(key in body for key in allowed):
            raise ValueError(f"nothing to set; give one of {allowed}")
        uuid = body.get("gpu_uuid")
        if uuid is None and len(self.gpus) == 1:
            uuid = next(iter(self.gpus))
        if uuid is None:
            raise ValueError(f"give gpu_uuid; this exporter has {sorted(self.gpus)}")
        if uuid not in self.gpus:
            raise ValueError(f"no GPU {uuid!r}; this exporter has {sorted(self.gpus)}")
        instance = body.get("gpu_instance_id")
        known = [s.gpu_instance_id for s in self.gpus[uuid].slices]
        if instance is not None and (isinstance(instance, bool) or instance not in known):
            raise ValueError(f"GPU {uuid} has no GPU instance {instance!r}; it has {known}")
        return uuid, instance

    def inject(self, body: Any) -> dict[str, Any]:
        """Merge the body's faults into its GPU's state (device-level: a slice's fault is its GPU's)."""
        uuid, instance = self._target(body, self.FAULT_KEYS)
        faults = self.faults[uuid]
        updates = {}
        for key in self.FAULT_KEYS:
            if key in body:
                updates[key] = _int_field(body, key, 1 if key == "row_remap_failure" else None)
        for key, value in updates.items():
            setattr(faults, key, value)
        return {"gpu_uuid": uuid, "gpu_instance_id": instance, "rendered_on": "gpu", "faults": asdict(faults)}

    def set_usage(self, body: Any) -> dict[str, Any]:
        """Set one slice's (or a whole GPU's) framebuffer use and engine activity."""
        uuid, instance = self._target(body, ("fb_used_mib", "gr_engine_active"))
        if instance is None and self.gpus[uuid].slices:
            raise ValueError("usage is per slice on a MIG GPU; give gpu_instance_id")
        usage = self.usage[(uuid, instance)]
        used = _int_field(body, "fb_used_mib", usage.total_mib) if "fb_used_mib" in body else usage.used_mib
        active = body.get("gr_engine_active", usage.gr_engine_active)
        if isinstance(active, bool) or not isinstance(active, int | float) or not 0 <= active <= 1:
            raise ValueError(f"gr_engine_active must be between 0 and 1, got {active!r}")
        usage.used_mib, usage.gr_engine_active = used, float(active)
        return {"gpu_uuid": uuid, "gpu_instance_id": instance, **asdict(usage)}

    def clear(self, uuid: str | None = None) -> list[str]:
        """Healthy again: one GPU, or all of them. Returns the GPUs cleared."""
        if uuid is not None and uuid not in self.gpus:
            raise ValueError(f"no GPU {uuid!r}")
        cleared = [uuid] if uuid else list(self.gpus)
        for gpu in cleared:
            self.faults[gpu] = GpuFaults()
        return cleared

    # --- HTTP --------------------------------------------------------------------------------

    def app(self) -> web.Application:
        """The aiohttp application: ``/metrics`` plus the fault and usage routes."""
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/faults", self._get_faults)
        app.router.add_post("/faults", self._post(self.inject))
        app.router.add_delete("/faults", self._delete_faults)
        app.router.add_post("/usage", self._post(self.set_usage))
        return app

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(text=self.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _get_faults(self, _request: web.Request) -> web.Response:
        return web.json_response({uuid: asdict(f) for uuid, f in self.faults.items()})

    def _post(
        self, action: Callable[[Any], dict[str, Any]]
    ) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            try:
                return web.json_response(action(json.loads(await request.read() or b"{}")))
            except ValueError as exc:  # JSONDecodeError is one
                return web.json_response({"error": str(exc)}, status=400)

        return handler

    async def _delete_faults(self, request: web.Request) -> web.Response:
        try:
            return web.json_response({"cleared": self.clear(request.query.get("gpu_uuid"))})
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)


async def serve(
    config: DcgmsimConfig,
    host: str,
    port: int,
    *,
    announce: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve until ``stop`` is set (or SIGTERM/SIGINT); ``announce(url)`` once the socket is bound."""
    runner = web.AppRunner(Dcgmsim(config).app(), access_log=None, shutdown_timeout=0.5)
    await serve_app(runner, host, port, announce=announce, stop=stop)


# --- command line ---------------------------------------------------------------------------------


def _gpu_arg(text: str) -> GpuSpec:
    try:
        return parse_gpu_spec(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    """``python -m loadtest.dcgmsim``'s flags."""
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.dcgmsim",
        description="A fake dcgm-exporter serving /metrics for simulated GPUs and MIG slices, with "
        "faults injected over HTTP (POST/DELETE /faults).",
        epilog="examples: --gpu GPU-5e0f8a2c-1b7d-4c1e-9a55-0c3f2d7e8b11:1g.10gb@9=llm/vllm-a,2g.20gb@3 "
        "(MIG, slice 9 mapped to pod llm/vllm-a, container vllm); --gpu GPU-aaaa=llm/big/vllm (whole GPU)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=9400, help="port; 0 picks a free one (default 9400)")
    parser.add_argument(
        "--gpu",
        action="append",
        type=_gpu_arg,
        required=True,
        dest="gpus",
        metavar="SPEC",
        help="a GPU, repeatable: GPU-UUID[=NS/POD[/CONTAINER]] for a whole GPU, or "
        "GPU-UUID:PROFILE@GPU_I_ID[=NS/POD[/CONTAINER]],... for MIG slices (container default: vllm)",
    )
    parser.add_argument("--hostname", default=socket.gethostname(), help="the host label's value")
    parser.add_argument(
        "--hostname-label",
        choices=["Hostname", "hostname"],
        default="Hostname",
        help="the host label's name (newer exporters use 'hostname'; default Hostname)",
    )
    parser.add_argument("--model-name", default="NVIDIA A100-SXM4-80GB", help="the modelName label")
    parser.add_argument("--driver-version", default="570.172.08", help="the DCGM_FI_DRIVER_VERSION label")
    parser.add_argument(
        "--no-ecc", action="store_true", help="leave out the ECC counter, as the default counters file does"
    )
    return parser


def _announce(url: str) -> None:
    print(READY_PREFIX + url, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM/SIGINT; 0 on a clean stop, 1 if the port cannot be bound, 2 on bad config."""
    args = build_parser().parse_args(argv)
    config = DcgmsimConfig(
        gpus=args.gpus,
        hostname=args.hostname,
        hostname_label=args.hostname_label,
        model_name=args.model_name,
        driver_version=args.driver_version,
        ecc=not args.no_ecc,
    )
    try:
        Dcgmsim(config)  # validate before binding
    except ValueError as exc:
        print(f"dcgmsim: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(config, args.host, args.port, announce=_announce))
    except OSError as exc:
        print(f"dcgmsim: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


# --- launcher for system tests ------------------------------------------------------------------


class DcgmsimStartError(StartError):
    """The fake exporter exited or stayed silent instead of announcing its address."""


class DcgmsimProcess(AnnouncedServer):
    """``python -m loadtest.dcgmsim ARGS`` as a child process, on a free port unless ARGS name ``--port``.

    ``with DcgmsimProcess(["--gpu", "GPU-...:1g.10gb@9"]) as dcgm: dcgm.url`` (see :class:`AnnouncedServer`).
    """

    module = "loadtest.dcgmsim"
    ready_prefix = READY_PREFIX
    start_error = DcgmsimStartError


if __name__ == "__main__":
    raise SystemExit(main())
