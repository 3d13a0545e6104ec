"""Which XIDs mean a broken GPU, decided the way NVIDIA's Kubernetes device plugin decides.

DCGM and NVML hand us bare XID numbers. Most are hardware or driver faults that make every slice of
the GPU unusable, but a handful are raised when one application misbehaves (an illegal memory access,
a killed context) and say nothing about the device. The device plugin (internal/rm/health.go) ignores
exactly those; we apply the same rule so that our verdicts agree with what Kubernetes will do.
"""

from __future__ import annotations

APPLICATION_XIDS: frozenset[int] = frozenset({13, 31, 43, 45, 68, 109})
"""XIDs caused by an application, not the device; the device plugin ignores them."""

_MEANINGS: dict[int, str] = {
    13: "graphics engine exception, usually a faulting kernel",
    31: "GPU memory page fault, usually an application's bad address",
    43: "GPU stopped processing after an application fault",
    45: "channel torn down after an earlier error (preemptive cleanup)",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint or warning",
    62: "internal micro-controller halted",
    63: "ECC page retirement or row remap recorded",
    64: "ECC page retirement or row remap could not be recorded",
    68: "video decoder exception",
    74: "NVLink error",
    79: "GPU fell off the bus",
    92: "high rate of single-bit ECC errors",
    94: "contained uncorrectable ECC error",
    95: "uncontained uncorrectable ECC error",
    109: "context switch timed out",
    119: "GSP firmware call timed out",
    120: "GSP firmware error",
}


def is_critical(xid: int) -> bool:
    """True when ``xid`` means the device is faulty. 0 (no XID) and application XIDs are not."""
    return xid > 0 and xid not in APPLICATION_XIDS


def describe(xid: int) -> str:
    """A short human meaning of ``xid`` for logs and verdict reasons."""
    if xid == 0:
        return "no XID"
    return _MEANINGS.get(xid, "no description known to the gateway")
