"""A pod's live state: health with hysteresis, the GPU-pressure breaker, and outlier ejection.

Pure state machines over a clock the caller passes in, so they are tested without sockets or
sleeps; the pod monitor feeds them probe, scrape and device results, and the relay feeds them the
outcome of each attempt. Envoy's vocabulary where it fits: consecutive failures eject a host for
``base_ejection_s`` times the number of ejections so far, never more than ``max_ejection_percent`` of
the pool at once, and an ejected host comes back through a single half-open trial request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.config import OutlierConfig, PressureConfig, ProbeConfig

if TYPE_CHECKING:
    from gateway.health.vllm_metrics import PodLoad

HEALTHY, DEGRADED, UNHEALTHY, DRAINING = "healthy", "degraded", "unhealthy", "draining"
CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
HEALTH_STATES = (HEALTHY, DEGRADED, UNHEALTHY, DRAINING)
BREAKER_STATES = (CLOSED, OPEN, HALF_OPEN)


class HealthState:
    """Probe results with hysteresis, plus device faults that act at once.

    ``unhealthy_after`` consecutive probe failures make the pod unhealthy and ``healthy_after``
    consecutive successes bring it back; one failure short of that it is degraded (still routable,
    but last in line). A device fault (critical XID, double-bit ECC, Kubernetes ``Unhealthy``) makes
    it unhealthy at once and stays until it is cleared (the pod replaced, an operator, or the
    quarantine ending with clean probes).

    Probe failures come in two kinds. A pod that *answers* that it is broken (vLLM's 503 when its
    engine died) or refuses the connection is believed: a ``hard`` failure. A probe that merely timed
    out is ``soft`` evidence: an overloaded pod is slow to answer ``/health`` while it streams tokens
    to everyone it admitted. The registry's panic threshold may override an unhealthy state made of
    soft failures only (``condemned`` is False), never a hard one, a device fault or a drain.
    """

    __slots__ = ("_config", "device_fault", "device_fault_at", "draining", "excused", "failures", "probed",
                 "reason", "soft", "state", "successes")

    def __init__(self, config: ProbeConfig) -> None:
        self._config = config
        self.state = HEALTHY
        self.reason = "not probed yet"
        self.failures = 0
        self.successes = 0
        self.probed = False
        self.device_fault: str | None = None
        self.device_fault_at = 0.0
        self.draining = False
        self.soft = True  # every failure of the current (or last) streak was a timeout
        self.excused = False  # the last probe timed out while the pod was serving live traffic

    def probe_result(self, ok: bool, detail: str = "", hard: bool = True) -> str | None:
        """Record one probe (``hard``: the pod answered or refused, not a timeout); returns the new
        state when it changed."""
        self.probed = True
        self.excused = False
        if ok:
            self.failures = 0
            self.successes += 1
        else:
            # a new streak starts soft, unless the pod is still out from hard failures
            fresh = self.failures == 0 and self.state != UNHEALTHY
            self.soft = not hard if fresh else self.soft and not hard
            self.successes = 0
            self.failures += 1
            self.reason = f"probe failed: {detail}" if detail else "probe failed"
        return self._settle()

    def probe_excused(self) -> bool:
        """A probe timed out while live traffic shows the pod serving: neither a failure nor a
        success. Returns True for the first of a run (worth a log line)."""
        first = not self.excused
        self.excused = True
        return first

    def set_device_fault(self, reason: str | None, now: float) -> str | None:
        """A device source's verdict: a reason makes the pod unhealthy; None clears the fault."""
        if reason is not None and self.device_fault is None:
            self.device_fault_at = now
        self.device_fault = reason
        return self._settle()

    def quarantine_over(self, now: float, quarantine_s: float | None) -> bool:
        """Whether a device fault has lasted its quarantine and may be cleared by clean probes."""
        if self.device_fault is None or quarantine_s is None:
            return False
        return now - self.device_fault_at >= quarantine_s

    def set_draining(self, draining: bool) -> str | None:
        self.draining = draining
        return self._settle()

    def _settle(self) -> str | None:
        before = self.state
        cfg = self._config
        if self.device_fault is not None:
            self.state, self.reason = UNHEALTHY, self.device_fault
        elif self.draining:
            self.state, self.reason = DRAINING, "draining (endpoint not ready or terminating)"
        elif self.failures >= cfg.unhealthy_after:
            self.state = UNHEALTHY
        elif self.state == UNHEALTHY and self.successes < cfg.healthy_after:
            pass  # stays out until enough clean probes
        elif self.failures > 0:
            self.state = DEGRADED
        else:
            self.state = HEALTHY
            self.reason = "probes passing" if self.probed else self.reason
        return self.state if self.state != before else None

    @property
    def routable(self) -> bool:
        return self.state in (HEALTHY, DEGRADED)

    @property
    def condemned(self) -> bool:
        """Out for a reason no panic overrides: a device fault, a drain, or a pod that said it is broken."""
        return self.device_fault is not None or self.draining or (self.state == UNHEALTHY and not self.soft)


@dataclass(slots=True)
class Load:
    """What the pod's own ``/metrics`` said last, and when (the loop's clock)."""

    kv_cache_usage: float | None = None
    running: float | None = None
    waiting: float | None = None
    drain_per_s: float | None = None  # requests the pod finished per second, between two scrapes
    itl_p95_s: float | None = None  # 95th percentile inter-token gap between the last two scrapes
    scraped_at: float | None = None
    # what the monitor measures the next rates from; they go with the pod when it leaves
    ttft_seen: tuple[int, float] | None = None  # (first tokens counted, at)
    itl_reference: PodLoad | None = None  # the scrape the pod's pace is measured from


class PressureBreaker:
    """Stops new streams to a pod whose KV cache or waiting queue is too full, with hysteresis.

    Opens at ``kv_high`` or ``waiting_high`` and closes only when both are back under ``kv_low`` and
    ``waiting_low``, so a pod hovering at the threshold does not flap. Sheddable traffic has lower
    limits of its own (``sheddable_kv``, ``sheddable_waiting``): it is shed first.
    """

    __slots__ = ("_config", "open", "reason")

    def __init__(self, config: PressureConfig) -> None:
        self._config = config
        self.open = False
        self.reason = ""

    def update(self, load: Load) -> bool | None:
        """Feed a fresh scrape; returns the new open/closed state when it changed."""
        cfg = self._config
        kv = load.kv_cache_usage or 0.0
        waiting = load.waiting or 0.0
        before = self.open
        if not self.open and (kv >= cfg.kv_high or waiting >= cfg.waiting_high):
            self.open = True
            self.reason = f"KV cache {kv:.0%}, {waiting:g} waiting"
        elif self.open and kv < cfg.kv_low and waiting < cfg.waiting_low:
            self.open = False
            self.reason = ""
        return self.open if self.open != before else None

    def admits_sheddable(self, load: Load) -> bool:
        cfg = self._config
        kv, waiting = load.kv_cache_usage or 0.0, load.waiting or 0.0
        return kv < cfg.sheddable_kv and waiting < cfg.sheddable_waiting


class OutlierDetector:
    """Ejects a pod after consecutive gateway-visible failures; brings it back via one trial.

    Failures are what the pod did wrong: connect errors, resets, 5xx, gateway timeouts. A 4xx, a
    client that left, or a long generation never counts (breakers that tripped on those caused
    retry storms in other routers).
    """

    __slots__ = ("_config", "consecutive", "ejected_until", "ejections", "reason", "state", "trial_out")

    def __init__(self, config: OutlierConfig) -> None:
        self._config = config
        self.state = CLOSED
        self.consecutive = 0
        self.ejections = 0
        self.ejected_until = 0.0
        self.trial_out = False
        self.reason = ""

    def success(self) -> str | None:
        self.consecutive = 0
        self.trial_out = False
        if self.state != CLOSED:
            self.state = CLOSED
            self.reason = ""
            return CLOSED
        return None

    def failure(self, what: str, now: float, may_eject: bool) -> str | None:
        """Count a failure; returns OPEN when this one ejects the pod."""
        self.consecutive += 1
        self.trial_out = False
        cfg = self._config
        tripped = self.state == CLOSED and self.consecutive >= cfg.consecutive_failures and may_eject
        if self.state == HALF_OPEN or tripped:
            self.ejections += 1
            seconds = min(cfg.base_ejection_s * self.ejections, cfg.max_ejection_s)
            self.ejected_until = now + seconds
            self.state = OPEN
            self.reason = f"ejected for {seconds:g} s after {self.consecutive} failures in a row ({what})"
            return OPEN
        return None

    def tick(self, now: float) -> str | None:
        """Move an ejection that has run its time to half-open; returns the new state if it moved."""
        if self.state == OPEN and now >= self.ejected_until:
            self.state = HALF_OPEN
            self.reason = "half-open: the next request is a trial"
            return HALF_OPEN
        return None

    def admits(self) -> bool:
        """Closed admits everything; half-open admits one trial at a time; open admits nothing."""
        return self.state == CLOSED or (self.state == HALF_OPEN and not self.trial_out)
