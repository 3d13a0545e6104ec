"""The canary judge: an anytime-valid sequential test of "canary not worse than stable".

Sans-IO and deterministic: the caller feeds one sample per finished stream and the current time, and
asks for a verdict as often as it likes (after every request if it wants) without inflating the false
rollback rate. The test is a one-sided mixture SPRT (mSPRT, Johari et al., "Always valid inference") on
a Gaussian approximation of each metric's difference, with a non-inferiority margin. Why this test, and
not Kayenta's Mann-Whitney or Argo's threshold counts: docs/canary.md, "The judge".

State is integer sufficient statistics only (counts, sums and sums of squares of quantised log
latencies), so replicas' states add exactly and in any order: Redis can keep them with HINCRBY.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

VARIANTS = ("stable", "canary")
Variant = Literal["stable", "canary"]
Decision = Literal["continue", "pass", "fail"]

# Latencies are judged as log(seconds), quantised to 1e-4 (0.01% of the value: far below any
# difference worth a rollback) so that sums are integers and merge exactly, and clipped so that one
# absurd value (a clock jump, a 3-hour hang) cannot dominate a sum of squares.
QUANTUM = 10_000
_LOG_FLOOR = math.log(1e-4)
_LOG_CAP = math.log(3600.0)
# A variance floor in log units (a 1% spread) so identical values cannot give a zero variance.
_VAR_FLOOR = 1e-4

# Alternatives for the rate test: 0.2% to 58% in steps of 1.5x, equally weighted. A fixed grid (not
# one relative to the null) keeps each term a fixed likelihood ratio; its cost is log(15) nats.
_RATE_GRID = tuple(0.002 * 1.5**i for i in range(15))

_FIELDS = ("streams", "errors", "stalls", "ttft_n", "ttft_sum", "ttft_sq", "itl_n", "itl_sum", "itl_sq")
_CLASSES = ("clean", "infra")
STATE_KEYS = tuple(f"{v}.{c}.{f}" for v in VARIANTS for c in _CLASSES for f in _FIELDS)


@dataclass(frozen=True, slots=True)
class JudgeConfig:
    """The test's knobs; the defaults are what docs/canary.md argues for.

    ``alpha`` bounds the chance that a canary inside every tolerance is ever failed during a step, over
    all four metrics together (each gets alpha/4). Tolerances say how much worse still counts as
    "not worse": latencies relative (0.10 = 10% slower geometric mean), rates as
    ``canary <= stable * (1 + rate_tolerance) + rate_margin``. ``tau_*`` is the spread of the mixture
    over latency effects (log units): the test is most sensitive to effects of about that size beyond
    the margin. Rates use a fixed grid of alternatives (``_RATE_GRID``) instead.
    """

    alpha: float = 0.01
    ttft_tolerance: float = 0.10
    itl_tolerance: float = 0.10
    rate_tolerance: float = 0.10
    rate_margin: float = 0.005
    tau_latency: float = 0.3
    min_samples_to_fail: int = 20

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha < 1.0:
            raise ValueError("alpha must be between 0 and 1")
        for name in ("ttft_tolerance", "itl_tolerance", "rate_tolerance", "rate_margin"):
            if getattr(self, name) < 0.0:
                raise ValueError(f"{name} must not be negative")
        if self.tau_latency <= 0.0:
            raise ValueError("tau_latency must be positive")
        if self.min_samples_to_fail < 2:
            raise ValueError("min_samples_to_fail must be at least 2 (a variance needs two samples)")


@dataclass(frozen=True, slots=True)
class MetricEvidence:
    """One metric's comparison, in the units an operator reads.

    Latencies: ``stable``/``canary`` are geometric means in seconds, ``effect`` their ratio and
    ``margin`` the ratio tolerated. Rates: the two rates, their difference, and the highest canary rate
    tolerated against this stable rate. ``statistic`` is log of the mixture likelihood ratio; the
    metric triggers when it reaches ``threshold`` = log(4/alpha).
    """

    metric: str
    n_stable: int
    n_canary: int
    stable: float
    canary: float
    effect: float
    margin: float
    statistic: float
    threshold: float
    triggered: bool


@dataclass(frozen=True, slots=True)
class Tally:
    """Counts for one variant and one class of samples (clean or infra), for the evidence."""

    streams: int
    errors: int
    stalls: int
    ttft_gmean_s: float | None


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the judge says now, and why: enough to log, export and show without recomputing."""

    decision: Decision
    reason: str
    triggered: tuple[str, ...]
    metrics: tuple[MetricEvidence, ...]
    clean: dict[str, Tally]
    infra: dict[str, Tally]
    held_s: float
    min_hold_s: float
    min_samples: int

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-able form for the admin API and the log."""
        return asdict(self)


def _quantised_log(seconds: float) -> int:
    if not (seconds >= 0.0 and math.isfinite(seconds)):
        raise ValueError(f"latency must be a finite, non-negative number of seconds, not {seconds!r}")
    value = math.log(seconds) if seconds > 0.0 else _LOG_FLOOR
    return round(min(max(value, _LOG_FLOOR), _LOG_CAP) * QUANTUM)


def _log_mixture_lr(theta: float, margin: float, var: float, tau: float) -> float:
    """log of the one-sided normal-mixture likelihood ratio for H0: theta <= margin.

    Mixing over effects above the margin (half-normal, scale tau) keeps the ratio a supermartingale
    for every theta in the null, not only at its edge, so the composite null is tested exactly (in the
    Gaussian approximation) and the one-sidedness is worth a factor 2 over the two-sided form.
    """
    shrink = var / (var + tau * tau)
    z = (theta - margin) / math.sqrt(var) * math.sqrt(1.0 - shrink)
    # log(Phi(z) * exp(z^2/2)), stable for very negative z (where both factors under/overflow).
    if z > -20.0:
        tail = math.log(0.5 * math.erfc(-z / math.sqrt(2.0))) + 0.5 * z * z
    else:
        tail = -math.log(-z * math.sqrt(2.0 * math.pi)) + math.log1p(-1.0 / (z * z))
    return math.log(2.0) + 0.5 * math.log(shrink) + tail


def _log_bernoulli_mixture(k: int, n: int, p0: float) -> float:
    """log of a discrete mixture of Bernoulli likelihood ratios, alternatives above p0, against p0.

    Exact for rare events, where a normal approximation is badly off in the tail: each term's
    expectation is at most 1 for any true rate <= p0, so the mixture is a test supermartingale for
    the whole composite null. Terms at or below p0 are left out (their weight is kept, so this only
    costs power).
    """
    if not 0.0 < p0 < 1.0:  # the stable bound is never 0 ((k+1)/(n+2)); 1 tolerates everything
        return -math.inf
    base = k * math.log(p0) + (n - k) * math.log1p(-p0)
    terms = [k * math.log(p) + (n - k) * math.log1p(-p) - base for p in _RATE_GRID if p > p0]
    if not terms:
        return -math.inf
    top = max(terms)
    return top + math.log(sum(math.exp(t - top) for t in terms)) - math.log(len(_RATE_GRID))


class Judge:
    """Compares canary with stable for one rollout step; feed it with ``add``, ask ``verdict``.

    ``min_samples`` (clean streams per variant) and ``min_hold_s`` are the step's own gates for a
    pass; ``started_at`` is the step's start on the caller's clock (the same for every replica).
    """

    __slots__ = ("_min_hold_s", "_min_samples", "_s", "_started_at", "config")

    def __init__(
        self,
        config: JudgeConfig | None = None,
        *,
        min_samples: int = 100,
        min_hold_s: float = 60.0,
        started_at: float = 0.0,
    ) -> None:
        if min_samples < 1:
            raise ValueError("min_samples must be at least 1: a canary with no traffic never passes")
        if min_hold_s < 0.0:
            raise ValueError("min_hold_s must not be negative")
        self.config = config or JudgeConfig()
        self._min_samples = min_samples
        self._min_hold_s = min_hold_s
        self._started_at = started_at
        self._s: dict[str, int] = dict.fromkeys(STATE_KEYS, 0)

    def add(
        self,
        variant: Variant,
        *,
        ttft: float | None = None,
        itl: float | None = None,
        stalled: bool = False,
        failed: bool = False,
        infra: bool = False,
    ) -> None:
        """Record one finished stream: a few integer additions and at most two logs.

        ``ttft``/``itl`` are None when the stream never got that far. ``infra`` marks a pod under GPU
        pressure or with a device fault: the sample is kept apart and never judged.
        """
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; the judge compares 'stable' and 'canary'")
        p = f"{variant}.{'infra' if infra else 'clean'}."
        s = self._s
        s[p + "streams"] += 1
        if failed:
            s[p + "errors"] += 1
        if stalled:
            s[p + "stalls"] += 1
        if ttft is not None:
            q = _quantised_log(ttft)
            s[p + "ttft_n"] += 1
            s[p + "ttft_sum"] += q
            s[p + "ttft_sq"] += q * q
        if itl is not None:
            q = _quantised_log(itl)
            s[p + "itl_n"] += 1
            s[p + "itl_sum"] += q
            s[p + "itl_sq"] += q * q

    def to_state(self) -> dict[str, int]:
        """The sufficient statistics, flat: one Redis hash field per key."""
        return dict(self._s)

    def merge(self, other_state: Mapping[str, int | str | bytes]) -> None:
        """Add another replica's state (or a Redis hash, whose values come back as strings).

        Integer sums make this exact and order-free: merging equals feeding one judge every sample.
        Missing keys count as zero; unknown keys are refused, since they mean a different format.
        """
        unknown = set(other_state) - set(STATE_KEYS)
        if unknown:
            raise ValueError(f"not a judge state: unknown keys {sorted(unknown)[:3]}")
        for key, value in other_state.items():
            self._s[key] += int(value)

    def verdict(self, now: float) -> Verdict:
        """Judge the samples so far; ``now`` is the caller's clock, the one ``started_at`` is on."""
        cfg = self.config
        threshold = math.log(4.0 / cfg.alpha)
        metrics = (
            self._latency("ttft", cfg.ttft_tolerance, threshold),
            self._latency("itl", cfg.itl_tolerance, threshold),
            self._rate("errors", threshold),
            self._rate("stalls", threshold),
        )
        triggered = tuple(m.metric for m in metrics if m.triggered)
        clean = {v: self._tally(v, "clean") for v in VARIANTS}
        infra = {v: self._tally(v, "infra") for v in VARIANTS}
        held = max(0.0, now - self._started_at)
        n_can, n_stable = clean["canary"].streams, clean["stable"].streams
        if triggered:
            decision: Decision = "fail"
            reason = "canary worse than stable on " + ", ".join(triggered)
        elif min(n_can, n_stable) < self._min_samples:
            decision = "continue"
            reason = (
                f"inconclusive: {n_can} canary and {n_stable} stable samples of {self._min_samples} "
                "needed per variant"
            )
        elif held < self._min_hold_s:
            decision = "continue"
            reason = f"holding: {held:.0f} s of {self._min_hold_s:.0f} s"
        else:
            decision = "pass"
            reason = f"not worse after {n_can} canary samples and {held:.0f} s"
        return Verdict(
            decision, reason, triggered, metrics, clean, infra, held, self._min_hold_s, self._min_samples
        )

    def _latency(self, name: str, tolerance: float, threshold: float) -> MetricEvidence:
        cfg = self.config
        stats = []
        for v in VARIANTS:
            n = self._s[f"{v}.clean.{name}_n"]
            total = self._s[f"{v}.clean.{name}_sum"]
            sq = self._s[f"{v}.clean.{name}_sq"]
            mean = total / n / QUANTUM if n else 0.0
            # n*sq - total^2 is exact in integers: no cancellation however large the sums grow.
            var = (n * sq - total * total) / (n * (n - 1)) / QUANTUM**2 if n > 1 else 0.0
            stats.append((n, mean, max(var, _VAR_FLOOR)))
        (n_s, m_s, v_s), (n_c, m_c, v_c) = stats
        margin = math.log1p(tolerance)
        statistic = -math.inf
        if min(n_s, n_c) >= cfg.min_samples_to_fail:
            statistic = _log_mixture_lr(m_c - m_s, margin, v_s / n_s + v_c / n_c, cfg.tau_latency)
        return MetricEvidence(
            name,
            n_s,
            n_c,
            math.exp(m_s) if n_s else math.nan,
            math.exp(m_c) if n_c else math.nan,
            math.exp(m_c - m_s) if n_s and n_c else math.nan,
            1.0 + tolerance,
            statistic,
            threshold,
            statistic >= threshold,
        )

    def _rate(self, name: str, threshold: float) -> MetricEvidence:
        cfg = self.config
        n_s, n_c = self._s["stable.clean.streams"], self._s["canary.clean.streams"]
        k_s, k_c = self._s[f"stable.clean.{name}"], self._s[f"canary.clean.{name}"]
        p_s = k_s / n_s if n_s else math.nan
        p_c = k_c / n_c if n_c else math.nan
        tolerated = math.nan
        statistic = -math.inf
        if n_s:
            # Stable's rate enters as an upper bound ((k+1)/(n+2) plus two standard errors): its own
            # sampling noise must not make the null stricter than the tolerance says.
            shrunk = (k_s + 1) / (n_s + 2)
            upper = min(1.0, shrunk + 2.0 * math.sqrt(shrunk * (1.0 - shrunk) / (n_s + 2)))
            tolerated = min(1.0, upper * (1.0 + cfg.rate_tolerance) + cfg.rate_margin)
            if min(n_s, n_c) >= cfg.min_samples_to_fail:
                statistic = _log_bernoulli_mixture(k_c, n_c, tolerated)
        return MetricEvidence(
            name,
            n_s,
            n_c,
            p_s,
            p_c,
            p_c - p_s,
            tolerated,
            statistic,
            threshold,
            statistic >= threshold,
        )

    def _tally(self, variant: str, cls: str) -> Tally:
        p = f"{variant}.{cls}."
        n = self._s[p + "ttft_n"]
        gmean = math.exp(self._s[p + "ttft_sum"] / n / QUANTUM) if n else None
        return Tally(self._s[p + "streams"], self._s[p + "errors"], self._s[p + "stalls"], gmean)
