"""Read a dcgm-exporter ``/metrics`` page as device verdicts and per-slice usage (sans-IO).

DCGM sees GPU faults (XIDs, ECC, failed row remaps, heat) before vLLM does; a pod on a failing GPU may
still answer ``/health`` while its streams die. This module turns one scrape into
:class:`~gateway.health.verdict.DeviceVerdict` values the pod monitor can act on, plus the per-slice
framebuffer and engine-activity gauges the gateway shows operators.

How dcgm-exporter names things (see shared/wire/facts.md):

- ``UUID`` is always the parent GPU's; a MIG slice's series add ``GPU_I_PROFILE`` and ``GPU_I_ID``.
  Device-level fields (XID, temperature, ECC, row remap) come without ``GPU_I_ID``: they concern every
  slice of the GPU, so their verdict is keyed by the GPU alone.
- With Kubernetes mapping the series carry ``namespace``/``pod``/``container``; the key then names the
  pod (``namespace/name``), which is the only link from a DCGM slice to a pod.
- ``DCGM_FI_DEV_XID_ERRORS`` holds the *last* XID (0: none), not a count.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gateway.health import exposition
from gateway.health import xid as xids
from gateway.health.verdict import DeviceKey, DeviceVerdict

SOURCE = "dcgm"

XID = "DCGM_FI_DEV_XID_ERRORS"
TEMP = "DCGM_FI_DEV_GPU_TEMP"
ECC_DBE_VOLATILE = "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"
ECC_DBE_AGGREGATE = "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL"
ROW_REMAP_FAILURE = "DCGM_FI_DEV_ROW_REMAP_FAILURE"
FB_USED = "DCGM_FI_DEV_FB_USED"
FB_FREE = "DCGM_FI_DEV_FB_FREE"
GR_ENGINE_ACTIVE = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"

_HEALTH = frozenset({XID, TEMP, ECC_DBE_VOLATILE, ECC_DBE_AGGREGATE, ROW_REMAP_FAILURE})
_USAGE = {FB_USED: "fb_used_mib", FB_FREE: "fb_free_mib", GR_ENGINE_ACTIVE: "gr_engine_active"}
_WANTED = _HEALTH | frozenset(_USAGE)


@dataclass(frozen=True, slots=True)
class SliceUsage:
    """What one MIG slice (or a whole GPU without MIG) is using, as DCGM last saw it."""

    fb_used_mib: float | None = None
    fb_free_mib: float | None = None
    gr_engine_active: float | None = None  # 0..1, the per-slice stand-in for GPU utilisation
    profile: str | None = None  # GPU_I_PROFILE, e.g. "1g.10gb"
    hostname: str | None = None


@dataclass(slots=True)
class DcgmReport:
    """One scrape: a verdict for every device that has one, and usage per slice."""

    verdicts: list[DeviceVerdict] = field(default_factory=list)
    slices: dict[DeviceKey, SliceUsage] = field(default_factory=dict)


def iter_samples(
    text: str | bytes, what: str, names: Collection[str] | None = None
) -> Iterator[tuple[str, str, dict[str, str], float]]:
    """(family name, sample name, labels, value) of every sample in Prometheus text (also used for
    vLLM's page); ValueError naming ``what`` for malformed text. ``_created`` samples are skipped.

    With ``names``, only the samples so named are read, as untyped series (family name = sample
    name), by ``gateway.health.exposition``: lines picked out by prefix, each matched by a compiled
    pattern, at a small part of prometheus_client's CPU on the event loop (a vLLM page is mostly
    histogram buckets the gateway never reads). Lines of other series are not checked.

    Without ``names``, DCGM series are looked up by family name: prometheus_client renames samples of
    counters whose names do not end in lowercase ``_total`` (``DCGM_FI_DEV_ECC_DBE_VOL_TOTAL`` gets
    ``_total`` added).
    """
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    if names is not None:
        try:
            for name, labels, value in exposition.samples(text, names):
                yield name, name, labels, value
        except ValueError as exc:
            raise ValueError(f"malformed {what} metrics text: {str(exc)[:200]}") from None
        return
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not sample.name.endswith("_created"):  # the parser gives ints for integer text
                    yield family.name, sample.name, sample.labels, float(sample.value)
    except (ValueError, IndexError, KeyError, TypeError, OverflowError) as exc:
        detail = str(exc) or type(exc).__name__
        raise ValueError(f"malformed {what} metrics text: {detail[:200]}") from None


def _key(labels: dict[str, str]) -> DeviceKey | None:
    gpu = labels.get("UUID") or labels.get("uuid")  # "uuid" with the exporter's old namespace
    if not gpu:
        return None
    instance = labels.get("GPU_I_ID") or None
    try:
        instance_id = int(instance) if instance is not None else None
    except ValueError:
        raise ValueError(f"malformed dcgm-exporter metrics text: GPU_I_ID={instance!r}") from None
    namespace, pod = labels.get("namespace"), labels.get("pod")
    return DeviceKey(
        gpu_uuid=gpu,
        gpu_instance_id=instance_id,
        pod=f"{namespace}/{pod}" if namespace and pod else None,
    )


def _xid_problem(value: float, labels: dict[str, str]) -> tuple[str | None, str | None]:
    """(problem, note) for a last-XID value."""
    if not value or math.isnan(value):
        return None, None
    if math.isinf(value):
        raise ValueError(f"malformed dcgm-exporter metrics text: {XID} is {value}")
    code = int(value)
    meaning = labels.get("err_msg", "")
    if not meaning or meaning == "Unknown Error":  # the exporter's text for codes newer than its table
        meaning = xids.describe(code)
    if xids.is_critical(code):
        return f"XID {code} ({meaning})", None
    return None, f"last XID {code} ({meaning}) is an application error, not a device fault"


def parse_dcgm(text: str | bytes, max_temp_c: float = 90.0) -> DcgmReport:
    """Verdicts and per-slice usage from one dcgm-exporter scrape.

    A device is unhealthy when its last XID is critical, it has double-bit ECC errors (volatile or
    aggregate), a row remap failed, or its temperature is at or above ``max_temp_c``. Every GPU seen
    gets a GPU-wide verdict (healthy ones too, so the caller can clear earlier faults); a slice gets its
    own verdict only if some health field is exported per slice. Unknown metrics are ignored.
    """
    problems: dict[DeviceKey, list[str]] = {}
    notes: dict[DeviceKey, list[str]] = {}
    usage: dict[DeviceKey, dict[str, Any]] = {}
    gpus: set[str] = set()
    for name, _sample, labels, value in iter_samples(text, "dcgm-exporter", _WANTED):
        key = _key(labels)
        if key is None:
            continue
        gpus.add(key.gpu_uuid or "")
        if name in _USAGE:
            slot = usage.setdefault(key, {})
            slot[_USAGE[name]] = value
            slot["profile"] = labels.get("GPU_I_PROFILE") or None
            slot["hostname"] = labels.get("Hostname") or labels.get("hostname") or None
            continue
        found = problems.setdefault(key, [])
        noted = notes.setdefault(key, [])
        if name == XID:
            problem, note = _xid_problem(value, labels)
            if problem:
                found.append(problem)
            if note:
                noted.append(note)
        elif name == TEMP and value >= max_temp_c:
            found.append(f"temperature {value:g} C at or above the {max_temp_c:g} C limit")
        elif name == ECC_DBE_VOLATILE and value > 0:
            found.append(f"double-bit ECC errors since the driver loaded: {value:g}")
        elif name == ECC_DBE_AGGREGATE and value > 0:
            found.append(f"double-bit ECC errors in the GPU's lifetime: {value:g}")
        elif name == ROW_REMAP_FAILURE and value > 0:
            found.append("a memory row remap failed")

    for gpu in gpus:
        if not any(k.gpu_uuid == gpu and k.gpu_instance_id is None for k in problems):
            problems[DeviceKey(gpu_uuid=gpu)] = []
            notes[DeviceKey(gpu_uuid=gpu)] = ["no GPU-wide health fields exported"]
    verdicts = []
    for key in sorted(problems, key=_order):
        if problems[key]:
            verdicts.append(DeviceVerdict(key, False, "; ".join(problems[key]), SOURCE))
        else:
            verdicts.append(DeviceVerdict(key, True, "; ".join(notes[key]) or "no fault reported", SOURCE))
    slices = {key: SliceUsage(**usage[key]) for key in sorted(usage, key=_order)}
    return DcgmReport(verdicts=verdicts, slices=slices)


def _order(key: DeviceKey) -> tuple[str, int, str]:
    instance = -1 if key.gpu_instance_id is None else key.gpu_instance_id
    return (key.gpu_uuid or "", instance, key.pod or "")
