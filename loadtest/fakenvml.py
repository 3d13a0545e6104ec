"""A fake NVML with pynvml's calling conventions, so the mig-agent can be tested without a GPU.

Why a fake and not mocks: the agent takes an ``nvml`` object and calls ``nvml.nvmlDeviceGetCount()``,
``nvml.nvmlEventSetWait(...)`` and so on, exactly as it would on the real ``pynvml`` module. A
``FakeNVML`` instance offers the same names, the same return shapes (pynvml's own ctypes structures
for memory and attributes, an object with ``c_nvmlEventData_t``'s field names for events) and raises
pynvml's own ``NVMLError`` subclasses with the error codes the driver would return. So the tests run
the agent's real code path, not a parallel one.

The machine is described by a small spec (a dict, or a JSON/YAML file)::

    {"driver": "550.54.15",
     "gpus": [{"name": "NVIDIA A100-SXM4-80GB", "mig": true,
               "slices": [{"profile": "3g.40gb", "gpu_instance_id": 1, "compute_instance_id": 0},
                          {"profile": "1g.10gb", "gpu_instance_id": 9, "compute_instance_id": 0,
                           "slot": 3}]},
              {"name": "NVIDIA L4", "mig": null, "xid_events": false}]}

Per GPU: ``uuid`` (default derived from the index), ``name``, ``memory_total_bytes``/``memory_used_bytes``,
``mig`` (true: enabled, false: disabled, null: MIG not supported, so ``nvmlDeviceGetMigMode`` raises
NotSupported), ``max_mig_devices`` (default 7), ``xid_events`` (false: registering for events raises
NotSupported) and ``slices``. Per slice: ``profile``, ``gpu_instance_id``, ``compute_instance_id``,
optional ``uuid``, ``slot`` (its index for ``nvmlDeviceGetMigDeviceHandleByIndex``; empty slots raise
NotFound), ``memory_total_bytes``, ``memory_used_bytes``. Top level: ``driver``, ``init_error`` (an
``NVML_ERROR_*`` name without the prefix, e.g. ``"LIBRARY_NOT_FOUND"``: ``nvmlInit`` raises it) and
``control_file``.

Injecting XIDs: in-process, call :meth:`FakeNVML.inject_xid`. From another process, append one JSON
line per XID to the control file (:func:`write_injection`, or ``python -m loadtest.fakenvml inject``);
the fake reads new lines while ``nvmlEventSetWait`` waits. The control file is the spec's
``control_file`` (relative to the spec), or ``SPEC.xid`` next to a spec loaded from ``SPEC``.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import threading
import time
import uuid as uuidlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml
import yaml

log = logging.getLogger("sluicegate.fakenvml")

ALL_INSTANCES = 0xFFFFFFFF  # an event's GI/CI id when it concerns the whole GPU
MIB = 1024 * 1024
GB = 1000**3
_PROFILE = re.compile(r"^(?:(\d+)c\.)?(\d+)g\.(\d+)gb")
_SUPPORTED_EVENTS = pynvml.nvmlEventTypeXidCriticalError
_CONTROL_POLL_S = 0.02  # how often a waiting nvmlEventSetWait looks at the control file


def _error(code: int) -> pynvml.NVMLError:
    """pynvml's own exception for ``code`` (``NVMLError(code)`` picks the subclass, as pynvml does)."""
    return pynvml.NVMLError(code)


@dataclass
class _Slice:
    slot: int
    uuid: str
    profile: str
    gpu_instance_id: int
    compute_instance_id: int
    memory_total: int
    memory_used: int
    handle: _Handle = field(init=False, repr=False)


@dataclass
class _Gpu:
    index: int
    uuid: str
    name: str
    memory_total: int
    memory_used: int
    mig: bool | None
    max_mig_devices: int
    xid_events: bool
    slices: dict[int, _Slice]
    lost: bool = False  # every call on it raises NVMLError_GpuIsLost, as after XID 79
    handle: _Handle = field(init=False, repr=False)


class _Handle:
    """An opaque device handle, like pynvml's ``c_nvmlDevice_t``; compare handles by identity."""

    __slots__ = ("_gpu", "_slice")

    def __init__(self, gpu: _Gpu, mig: _Slice | None) -> None:
        self._gpu = gpu
        self._slice = mig

    def __repr__(self) -> str:
        return "<fake nvmlDevice_t>"


class _EventSet:
    """An opaque event set, like pynvml's ``c_nvmlEventSet_t``."""

    __slots__ = ("freed", "masks", "queue")

    def __init__(self) -> None:
        self.masks: dict[int, int] = {}  # GPU index -> registered event types
        self.queue: deque[EventData] = deque()
        self.freed = False

    def __repr__(self) -> str:
        return "<fake nvmlEventSet_t>"


class EventData:
    """What ``nvmlEventSetWait`` returns: the field names of pynvml's ``c_nvmlEventData_t``."""

    __slots__ = ("computeInstanceId", "device", "eventData", "eventType", "gpuInstanceId")

    def __init__(self, device: _Handle, event_type: int, data: int, gi: int, ci: int) -> None:
        self.device = device
        self.eventType = event_type
        self.eventData = data
        self.gpuInstanceId = gi
        self.computeInstanceId = ci

    def __repr__(self) -> str:
        return (
            f"EventData(eventType=0x{self.eventType:08X}, eventData={self.eventData}, "
            f"gpuInstanceId={self.gpuInstanceId}, computeInstanceId={self.computeInstanceId})"
        )


def _int(raw: Any, where: str, default: int | None = None) -> int:
    if raw is None and default is not None:
        return default
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:
        raise ValueError(f"{where}: expected an integer >= 0, got {raw!r}")
    return raw


def _profile_gb(profile: str, where: str) -> tuple[int, int, int]:
    """(compute slices, GPU slices, GB) of a profile name such as ``1g.10gb`` or ``1c.2g.20gb``."""
    match = _PROFILE.match(profile)
    if match is None:
        raise ValueError(f"{where}: profile {profile!r} is not like '1g.10gb' or '1c.2g.20gb'")
    gi_slices = int(match[2])
    return int(match[1] or gi_slices), gi_slices, int(match[3])


def _parse_gpu(index: int, raw: Any) -> _Gpu:
    where = f"gpus[{index}]"
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a mapping, got {raw!r}")
    mig = raw.get("mig", False)
    if mig not in (True, False, None):
        raise ValueError(f"{where}.mig: expected true, false or null, got {mig!r}")
    gpu_uuid = str(raw.get("uuid") or f"GPU-{uuidlib.uuid5(uuidlib.NAMESPACE_OID, f'fakenvml-{index}')}")
    total = _int(raw.get("memory_total_bytes"), f"{where}.memory_total_bytes", 80 * GB)
    gpu = _Gpu(
        index=index,
        uuid=gpu_uuid,
        name=str(raw.get("name", "NVIDIA A100-SXM4-80GB")),
        memory_total=total,
        memory_used=_int(raw.get("memory_used_bytes"), f"{where}.memory_used_bytes", 0),
        mig=mig,
        max_mig_devices=_int(raw.get("max_mig_devices"), f"{where}.max_mig_devices", 7),
        xid_events=bool(raw.get("xid_events", True)),
        slices={},
    )
    gpu.handle = _Handle(gpu, None)
    raw_slices = raw.get("slices") or []
    if raw_slices and mig is not True:
        raise ValueError(f"{where}: slices need \"mig\": true")
    for position, item in enumerate(raw_slices):
        swhere = f"{where}.slices[{position}]"
        if not isinstance(item, dict):
            raise ValueError(f"{swhere}: expected a mapping, got {item!r}")
        profile = str(item.get("profile", ""))
        _, _, gb = _profile_gb(profile, swhere)
        gi = _int(item.get("gpu_instance_id"), f"{swhere}.gpu_instance_id")
        ci = _int(item.get("compute_instance_id"), f"{swhere}.compute_instance_id", 0)
        slot = _int(item.get("slot"), f"{swhere}.slot", position)
        if slot >= gpu.max_mig_devices or slot in gpu.slices:
            raise ValueError(f"{swhere}.slot: {slot} is taken or not below max_mig_devices")
        mig_uuid = item.get("uuid") or f"MIG-{uuidlib.uuid5(uuidlib.NAMESPACE_OID, f'{gpu_uuid}/{gi}/{ci}')}"
        piece = _Slice(
            slot=slot,
            uuid=str(mig_uuid),
            profile=profile,
            gpu_instance_id=gi,
            compute_instance_id=ci,
            memory_total=_int(item.get("memory_total_bytes"), f"{swhere}.memory_total_bytes", gb * GB),
            memory_used=_int(item.get("memory_used_bytes"), f"{swhere}.memory_used_bytes", 0),
        )
        piece.handle = _Handle(gpu, piece)
        gpu.slices[slot] = piece
    return gpu


class FakeNVML:
    """A module-like stand-in for ``pynvml``: use an instance wherever the agent takes ``nvml``.

    Only the functions the mig-agent calls are provided; every other ``nvml*`` name raises
    AttributeError, as a function missing from an old pynvml would. Constants and the ``NVMLError``
    classes are pynvml's own.
    """

    def __init__(self, spec: dict[str, Any], *, control_file: str | Path | None = None) -> None:
        if not isinstance(spec, dict):
            raise ValueError(f"fake NVML spec: expected a mapping, got {spec!r}")
        raw_gpus = spec.get("gpus") or []
        if not isinstance(raw_gpus, list):
            raise ValueError("fake NVML spec: 'gpus' must be a list")
        self._gpus = [_parse_gpu(index, raw) for index, raw in enumerate(raw_gpus)]
        self._driver = str(spec.get("driver", "550.54.15"))
        self._init_error: int | None = None
        if spec.get("init_error"):
            name = f"NVML_ERROR_{str(spec['init_error']).upper()}"
            if not hasattr(pynvml, name):
                raise ValueError(f"fake NVML spec: unknown init_error {spec['init_error']!r}")
            self._init_error = getattr(pynvml, name)
        self._control_file = Path(control_file) if control_file else None
        self._control_offset = 0  # lines already in the file are old news: skip them
        if self._control_file is not None and self._control_file.exists():
            self._control_offset = self._control_file.stat().st_size
        self._cond = threading.Condition()
        self._refcount = 0
        self._sets: list[_EventSet] = []

    @classmethod
    def from_file(cls, path: str | Path) -> FakeNVML:
        """A fake from a JSON or YAML spec file; injections come through its control file."""
        path = Path(path)
        try:
            spec = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not JSON or YAML: {exc}") from None
        if not isinstance(spec, dict):
            raise ValueError(f"{path}: expected a mapping at the top level")
        control = spec.get("control_file")
        control_path = path.parent / control if control else path.with_name(path.name + ".xid")
        return cls(spec, control_file=control_path)

    @property
    def control_file(self) -> Path | None:
        """Where other processes append XID injections (see :func:`write_injection`)."""
        return self._control_file

    # --- test hooks ----------------------------------------------------------------------------

    def inject_xid(
        self,
        gpu_index: int,
        xid: int,
        gpu_instance_id: int = ALL_INSTANCES,
        compute_instance_id: int = ALL_INSTANCES,
    ) -> int:
        """Raise XID ``xid`` on a GPU, as the driver would; returns how many event sets received it.

        Like NVML, the event reaches only event sets registered for XID events on that GPU; a set
        nobody waits on keeps it queued. Thread-safe.
        """
        if not 0 <= gpu_index < len(self._gpus):
            raise IndexError(f"no fake GPU {gpu_index}")
        gpu = self._gpus[gpu_index]
        kind = pynvml.nvmlEventTypeXidCriticalError
        delivered = 0
        with self._cond:
            for event_set in self._sets:
                if event_set.masks.get(gpu_index, 0) & kind:
                    event = EventData(gpu.handle, kind, xid, gpu_instance_id, compute_instance_id)
                    event_set.queue.append(event)
                    delivered += 1
            self._cond.notify_all()
        return delivered

    def lose_gpu(self, gpu_index: int) -> None:
        """Make the GPU fall off the bus: from now on NVML calls on it raise ``NVMLError_GpuIsLost``."""
        with self._cond:
            self._gpus[gpu_index].lost = True

    def set_memory_used(self, uuid: str, used_bytes: int) -> None:
        """Change what ``nvmlDeviceGetMemoryInfo`` reports for a GPU or MIG UUID."""
        with self._cond:
            for gpu in self._gpus:
                for device in (gpu, *gpu.slices.values()):
                    if device.uuid == uuid:
                        device.memory_used = used_bytes
                        return
        raise KeyError(uuid)

    def _read_control_file(self) -> None:
        """Turn complete new lines of the control file into injections (called with the lock held)."""
        path = self._control_file
        if path is None:
            return
        try:
            with path.open("rb") as stream:
                stream.seek(self._control_offset)
                chunk = stream.read()
        except FileNotFoundError:
            return
        end = chunk.rfind(b"\n") + 1
        self._control_offset += end
        for line in chunk[:end].splitlines():
            if not line.strip():
                continue
            try:
                cmd = json.loads(line)
                args = (
                    int(cmd["gpu_index"]),
                    int(cmd["xid"]),
                    int(cmd.get("gpu_instance_id", ALL_INSTANCES)),
                    int(cmd.get("compute_instance_id", ALL_INSTANCES)),
                )
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("fake NVML: ignoring control line %r: %s", line, exc)
                continue
            try:
                self.inject_xid(*args)  # the condition's lock is re-entrant
            except IndexError as exc:
                log.warning("fake NVML: ignoring control line %r: %s", line, exc)

    # --- helpers -------------------------------------------------------------------------------

    def _check_init(self) -> None:
        if self._refcount == 0:
            raise _error(pynvml.NVML_ERROR_UNINITIALIZED)

    def _device(self, handle: Any) -> _Handle:
        self._check_init()
        if not isinstance(handle, _Handle):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if handle._gpu.lost:
            raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return handle

    def _parent(self, handle: Any) -> _Gpu:
        """The GPU of a GPU handle; MIG handles are refused the way NVML refuses them."""
        device = self._device(handle)
        if device._slice is not None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return device._gpu

    def _mig(self, handle: Any) -> _Slice:
        device = self._device(handle)
        if device._slice is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)  # "not a MIG device"
        return device._slice

    # --- the pynvml functions the agent uses ---------------------------------------------------

    def nvmlInit(self) -> None:
        if self._init_error is not None:
            raise _error(self._init_error)
        with self._cond:
            self._refcount += 1

    def nvmlShutdown(self) -> None:
        with self._cond:
            self._check_init()
            self._refcount -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check_init()
        return self._driver

    def nvmlDeviceGetCount(self) -> int:
        self._check_init()
        return len(self._gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._check_init()
        if not 0 <= index < len(self._gpus):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if self._gpus[index].lost:
            raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return self._gpus[index].handle

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        device = self._device(handle)
        return device._slice.uuid if device._slice else device._gpu.uuid

    def nvmlDeviceGetName(self, handle: Any) -> str:
        device = self._device(handle)
        if device._slice is None:
            return device._gpu.name
        return f"{device._gpu.name} MIG {device._slice.profile}"

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        device = self._device(handle)
        owner = device._slice or device._gpu
        total, used = owner.memory_total, min(owner.memory_used, owner.memory_total)
        if version:
            free = total - used
            return pynvml.c_nvmlMemory_v2_t(version=version, total=total, reserved=0, free=free, used=used)
        return pynvml.c_nvmlMemory_t(total=total, free=total - used, used=used)

    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]:
        gpu = self._parent(device)
        if gpu.mig is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if gpu.mig else pynvml.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, device: Any) -> int:
        gpu = self._parent(device)
        return gpu.max_mig_devices if gpu.mig else 0  # NVML: zero when MIG is unsupported or disabled

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Any, index: int) -> _Handle:
        gpu = self._parent(device)
        if gpu.mig is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not gpu.mig or not 0 <= index < gpu.max_mig_devices:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        piece = gpu.slices.get(index)
        if piece is None:
            raise _error(pynvml.NVML_ERROR_NOT_FOUND)
        return piece.handle

    def nvmlDeviceGetGpuInstanceId(self, device: Any) -> int:
        return self._mig(device).gpu_instance_id

    def nvmlDeviceGetComputeInstanceId(self, device: Any) -> int:
        return self._mig(device).compute_instance_id

    def nvmlDeviceGetAttributes_v2(self, device: Any) -> Any:
        piece = self._mig(device)
        ci_slices, gi_slices, _ = _profile_gb(piece.profile, piece.uuid)
        return pynvml.c_nvmlDeviceAttributes(
            multiprocessorCount=16 * ci_slices,
            gpuInstanceSliceCount=gi_slices,
            computeInstanceSliceCount=ci_slices,
            memorySizeMB=piece.memory_total // MIB,
        )

    def nvmlDeviceGetAttributes(self, device: Any) -> Any:
        return self.nvmlDeviceGetAttributes_v2(device)

    def nvmlEventSetCreate(self) -> _EventSet:
        self._check_init()
        event_set = _EventSet()
        with self._cond:
            self._sets.append(event_set)
        return event_set

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        gpu = self._parent(handle)
        if not isinstance(eventSet, _EventSet) or eventSet.freed:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not gpu.xid_events or eventTypes & ~_SUPPORTED_EVENTS:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        with self._cond:
            eventSet.masks[gpu.index] = eventSet.masks.get(gpu.index, 0) | eventTypes

    def nvmlEventSetWait_v2(self, eventSet: Any, timeoutms: int) -> EventData:
        """The next event, waiting up to ``timeoutms``; raises ``NVMLError_Timeout`` if none came."""
        self._check_init()
        if not isinstance(eventSet, _EventSet) or eventSet.freed:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        deadline = time.monotonic() + timeoutms / 1000
        with self._cond:
            while True:
                self._read_control_file()
                if eventSet.queue:
                    return eventSet.queue.popleft()
                remaining = deadline - time.monotonic()
                if remaining <= 0 or eventSet.freed:
                    raise _error(pynvml.NVML_ERROR_TIMEOUT)
                self._cond.wait(min(remaining, _CONTROL_POLL_S) if self._control_file else remaining)

    def nvmlEventSetWait(self, eventSet: Any, timeoutms: int) -> EventData:
        return self.nvmlEventSetWait_v2(eventSet, timeoutms)

    def nvmlEventSetFree(self, eventSet: Any) -> None:
        self._check_init()
        if not isinstance(eventSet, _EventSet) or eventSet.freed:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self._cond:
            eventSet.freed = True
            self._sets.remove(eventSet)
            self._cond.notify_all()


# pynvml's constants and exception classes, so ``nvml.NVMLError_NotFound`` etc. work on the fake too.
for _name in dir(pynvml):
    if _name.startswith(("NVML_", "NVMLError", "nvmlEventType")):
        setattr(FakeNVML, _name, getattr(pynvml, _name))


def write_injection(
    control_file: str | Path,
    gpu_index: int,
    xid: int,
    gpu_instance_id: int = ALL_INSTANCES,
    compute_instance_id: int = ALL_INSTANCES,
) -> None:
    """Ask a fake NVML in another process to raise an XID: one JSON line appended to its control file."""
    line = json.dumps(
        {
            "gpu_index": gpu_index,
            "xid": xid,
            "gpu_instance_id": gpu_instance_id,
            "compute_instance_id": compute_instance_id,
        }
    )
    with open(control_file, "a") as stream:  # one short append: other readers never see half a line
        stream.write(line + "\n")


def main(argv: list[str] | None = None) -> int:
    """``python -m loadtest.fakenvml inject SPEC --gpu 0 --xid 79 [--gi 1 --ci 0]``."""
    parser = argparse.ArgumentParser(prog="python -m loadtest.fakenvml", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    inject = commands.add_parser("inject", help="raise an XID in an agent running on this spec")
    inject.add_argument("spec", help="the spec file the agent was started with (--fake-nvml)")
    inject.add_argument("--gpu", type=int, default=0, help="GPU index (default 0)")
    inject.add_argument("--xid", type=int, required=True)
    inject.add_argument("--gi", type=int, default=ALL_INSTANCES, help="GPU instance id (default: whole GPU)")
    inject.add_argument("--ci", type=int, default=ALL_INSTANCES, help="compute instance id (default: all)")
    args = parser.parse_args(argv)
    control = FakeNVML.from_file(args.spec).control_file
    assert control is not None
    write_injection(control, args.gpu, args.xid, args.gi, args.ci)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
