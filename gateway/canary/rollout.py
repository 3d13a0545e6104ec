"""The rollout plan of one route as a sans-IO state machine: steps, holds, advance and rollback.

The caller owns every clock and every side effect: it feeds finished streams with ``observe``, calls
``tick(now)`` as often as it likes (after every request, or on a timer), and applies the returned
``Change`` by swapping in ``router.with_weights(change.weights)``. Keeping the machine free of I/O makes
it testable on simulated time and lets a shared-state layer (Redis) drive the same object on every
replica.

One judge per step, started at the step's start: evidence from 1% does not carry into 5%, where the
canary serves other callers. A step at 100% is never judged (no stable traffic is left to compare
with): passing the last step below 100 promotes. See docs/canary.md, "The rollout".
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.canary.judge import Judge, JudgeConfig, Verdict
from gateway.config_routes import RolloutConfig

State = Literal["progressing", "paused", "promoted", "rolled_back"]
What = Literal["started", "advanced", "promoted", "rolled_back", "paused", "resumed"]

STATUS_HISTORY = 20  # events in status(): enough for an operator, bounded for the admin API


class RolloutError(ValueError):
    """A manual control that makes no sense in the current state (the admin API answers 409)."""


@dataclass(frozen=True, slots=True)
class Event:
    """One entry of the rollout's history: what happened, when, why, and the judge's evidence."""

    at: float
    what: What
    reason: str
    step: int
    percent: float
    triggered: tuple[str, ...] = ()
    evidence: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (tuples become lists)."""
        return {
            "at": self.at,
            "what": self.what,
            "reason": self.reason,
            "step": self.step,
            "percent": self.percent,
            "triggered": list(self.triggered),
            "evidence": self.evidence,
        }


@dataclass(frozen=True, slots=True)
class Change:
    """A transition the caller must apply: the route's new weights, and the event that caused it."""

    route: str
    state: State
    weights: dict[str, float]
    event: Event = field(repr=False)

    @property
    def what(self) -> What:
        return self.event.what

    @property
    def reason(self) -> str:
        return self.event.reason


def _plain(value: Any) -> Any:
    """Verdict evidence as strict JSON: NaN and infinities (no data, no statistic yet) become None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


class Rollout:
    """One route's rollout: the current step, its judge, its state and what happened so far.

    Only two variants are supported: ``stable`` and ``config.canary``. Pass ``variants`` (the route's
    variant names) to have that checked here; ``RouteConfig`` checks it too.
    """

    __slots__ = (
        "_judge",
        "_judge_config",
        "_last_now",
        "_last_verdict",
        "canary",
        "canary_percent",
        "config",
        "history",
        "route",
        "state",
        "step",
        "step_started_at",
    )

    def __init__(
        self,
        route: str,
        config: RolloutConfig,
        *,
        started_at: float,
        variants: Collection[str] | None = None,
    ) -> None:
        canary = config.canary
        if canary == "stable":
            raise ValueError(f"route {route!r}: rollout.canary cannot be 'stable' (the baseline)")
        if variants is not None and set(variants) != {"stable", canary}:
            raise ValueError(
                f"route {route!r}: a rollout needs exactly the variants 'stable' and {canary!r}; "
                f"it has {', '.join(variants)}"
            )
        self.route = route
        self.config = config
        self.canary = canary
        self._judge_config = JudgeConfig(**config.judge.model_dump())
        self.state: State = "progressing"
        self.step = 0
        self.canary_percent = config.steps[0]
        self.history: list[Event] = []
        self._last_verdict: Verdict | None = None
        self._last_now = started_at
        self._start_step(started_at)
        self._record(started_at, "started", f"canary {canary!r} at {self.canary_percent:g} %")

    @property
    def judge(self) -> Judge:
        """The current step's judge (to merge other replicas' states into, or read its state)."""
        return self._judge

    @property
    def last_verdict(self) -> Verdict | None:
        return self._last_verdict

    def weights(self) -> dict[str, float]:
        """The route's weights for the current state, in percent: feed them to ``Router.with_weights``."""
        return {self.canary: self.canary_percent, "stable": 100.0 - self.canary_percent}

    def observe(self, variant: str, **sample: Any) -> None:
        """Feed one finished stream (``Judge.add``'s keywords) to the current step's judge.

        Ignored once the rollout is over and for variants outside the rollout: a stream that started
        before a change may finish after it, and must not fail or crash anything.
        """
        if self.state not in ("progressing", "paused"):
            return
        if variant == self.canary:
            self._judge.add("canary", **sample)
        elif variant == "stable":
            self._judge.add("stable", **sample)

    def tick(self, now: float) -> Change | None:
        """Ask the judge; act on fail (even when paused) and, while progressing, on pass."""
        if self.state not in ("progressing", "paused"):
            return None
        self._last_now = now
        verdict = self._judge.verdict(now)
        self._last_verdict = verdict
        if verdict.decision == "fail":
            return self._roll_back(now, verdict.reason, verdict)
        if verdict.decision == "pass" and self.state == "progressing":
            return self._advance(now, verdict)
        return None

    def pause(self, now: float, why: str) -> Change:
        """Hold the current step: samples still count, a fail still rolls back, a pass waits."""
        self._require("pause", "progressing")
        self.state = "paused"
        return self._change(now, "paused", why or "paused by operator")

    def resume(self, now: float) -> Change:
        """Let the judge's pass advance again (the hold kept running while paused)."""
        self._require("resume", "paused")
        self.state = "progressing"
        return self._change(now, "resumed", "resumed by operator")

    def promote(self, now: float) -> Change:
        """Skip the remaining steps: the canary takes all traffic."""
        self._require("promote", "progressing", "paused")
        self.state = "promoted"
        self.step = len(self.config.steps) - 1
        self.canary_percent = 100.0
        return self._change(now, "promoted", "promoted by operator")

    def abort(self, now: float, why: str) -> Change:
        """Roll back by hand: the canary's weight goes to 0 at once."""
        self._require("abort", "progressing", "paused")
        return self._roll_back(now, why or "aborted by operator", None)

    def follow(
        self, state: State, step: int, percent: float, step_started_at: float, event: Event | None
    ) -> None:
        """Take on a transition decided elsewhere (another replica, through Redis), with no judging
        here: a new step (or the same step restarted) starts an empty judge on the decider's clock."""
        if step != self.step or step_started_at != self.step_started_at:
            self.step = step
            self._start_step(step_started_at)
        self.state = state
        self.canary_percent = percent
        if event is not None and (not self.history or self.history[-1] != event):
            self.history.append(event)

    def rebase(self, samples: Mapping[str, int]) -> None:
        """Replace the step's judge's samples with these (every replica's, merged): the judge's
        ``merge`` is exact, so a fresh judge fed the merged state is the judge of all of them."""
        self._start_step(self.step_started_at)
        self._judge.merge(samples)

    def status(self, now: float | None = None) -> dict[str, Any]:
        """JSON-ready summary for the admin API; ``now`` defaults to the last tick's time."""
        now = self._last_now if now is None else now
        state = self._judge.to_state()
        samples = {
            name: {cls: state[f"{side}.{cls}.streams"] for cls in ("clean", "infra")}
            for name, side in (("stable", "stable"), (self.canary, "canary"))
        }
        return {
            "route": self.route,
            "state": self.state,
            "step": self.step,
            "steps": list(self.config.steps),
            "percent": self.canary_percent,
            "weights": self.weights(),
            "canary": self.canary,
            "on_rollback": self.config.on_rollback,
            "step_started_at": self.step_started_at,
            "hold_elapsed_s": max(0.0, now - self.step_started_at),
            "min_hold_s": self.config.min_hold_s,
            "min_samples": self.config.min_samples,
            "samples": samples,
            "verdict": _plain(self._last_verdict.as_dict()) if self._last_verdict else None,
            "history": [event.as_dict() for event in self.history[-STATUS_HISTORY:]],
        }

    def _start_step(self, now: float) -> None:
        self.step_started_at = now
        self._judge = Judge(
            self._judge_config,
            min_samples=self.config.min_samples,
            min_hold_s=self.config.min_hold_s,
            started_at=now,
        )

    def _advance(self, now: float, verdict: Verdict) -> Change:
        steps = self.config.steps
        nxt = self.step + 1
        evidence = _plain(verdict.as_dict())
        if nxt >= len(steps) or steps[nxt] >= 100.0:
            self.state = "promoted"
            self.step = min(nxt, len(steps) - 1)
            self.canary_percent = 100.0
            return self._change(now, "promoted", verdict.reason, evidence=evidence)
        self.step = nxt
        self.canary_percent = steps[nxt]
        self._start_step(now)
        reason = f"{verdict.reason}; now {self.canary_percent:g} %"
        return self._change(now, "advanced", reason, evidence=evidence)

    def _roll_back(self, now: float, reason: str, verdict: Verdict | None) -> Change:
        self.state = "rolled_back"
        self.canary_percent = 0.0
        if verdict is None:
            return self._change(now, "rolled_back", reason)
        return self._change(
            now, "rolled_back", reason, triggered=verdict.triggered, evidence=_plain(verdict.as_dict())
        )

    def _require(self, action: str, *states: State) -> None:
        if self.state not in states:
            raise RolloutError(f"cannot {action} the rollout of {self.route!r}: it is {self.state}")

    def _record(
        self,
        now: float,
        what: What,
        reason: str,
        *,
        triggered: tuple[str, ...] = (),
        evidence: dict[str, Any] | None = None,
    ) -> Event:
        event = Event(now, what, reason, self.step, self.canary_percent, triggered, evidence)
        self.history.append(event)
        return event

    def _change(
        self,
        now: float,
        what: What,
        reason: str,
        *,
        triggered: tuple[str, ...] = (),
        evidence: dict[str, Any] | None = None,
    ) -> Change:
        self._last_now = now
        event = self._record(now, what, reason, triggered=triggered, evidence=evidence)
        return Change(self.route, self.state, self.weights(), event)
