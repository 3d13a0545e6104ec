"""The gateway's rollouts: each route's ``Rollout`` fed by finished requests, ticked once a second,
and its weights swapped into the route phase's ``Router`` when it advances or rolls back.

Samples: a canary route's requests that reached a pod and did not end by the client's choice (a 4xx
or a client that left says nothing about the variant). A pod under GPU pressure or with a device
fault makes its samples ``infra``: counted, shown, never held against the canary's code.

Alone (no ``quotas.redis_url``) a process judges and decides by itself. With Redis the replicas
share each rollout (``gateway.canary.shared``): every tick each one flushes its new samples, the one
holding the decider lease judges the merged samples and writes any change, and every other one
follows the shared state. With Redis away a replica keeps its step and weights, never advances, and
rolls back alone only when its own judge fails (written to Redis when it returns). Clocks are wall
clocks, since a step's start is compared across replicas. See docs/canary.md, "Several replicas".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.canary.rollout import Change, Rollout
from gateway.canary.shared import Shared, SharedRollouts, epoch
from gateway.config import Config
from gateway.exchange import Exchange
from gateway.phases.route import Route

log = logging.getLogger("sluicegate.rollout")

TICK_S = 1.0
_BROKEN = frozenset(
    {"upstream_truncated", "upstream_broke_mid_stream", "upstream_error_event", "internal_error"}
)
ACTIONS = ("pause", "resume", "promote", "abort")


@dataclass(slots=True)
class _Sync:
    """This replica's bookkeeping for one shared rollout."""

    epoch: str
    version: int = 0  # the shared state's version this replica is at
    flushed: dict[str, int] = field(default_factory=dict)  # judge state already in Redis
    step_key: tuple[int, float] = (0, 0.0)  # the step ``flushed`` belongs to
    pending: bool = False  # a local change (operator, rollback without Redis) not yet written


class Rollouts:
    """Every route with a ``rollout`` plan, and the route phase whose routers it steers."""

    def __init__(self, config: Config, route: Route) -> None:
        self.route = route
        self.active: dict[str, Rollout] = {}
        self.shared: SharedRollouts | None = None
        self._sync: dict[str, _Sync] = {}
        self._redis_up = True
        self._store_errors: tuple[type[BaseException], ...] = (OSError, TimeoutError)
        self._wake = asyncio.Event()
        # set by the relay: moves a route's in-flight canary streams to stable (on_rollback: resume)
        self.on_rollback: Callable[[str, str], object] | None = None
        self._moved: set[Rollout] = set()  # the rollouts whose streams were moved (once each)
        self._take(config, route, reload=False)

    def observe(self, ex: Exchange, elapsed_s: float) -> None:
        """A finished request of a canary route, as a sample for its rollout's judge."""
        rollout = self.active.get(ex.public_model) if ex.variant is not None else None
        if rollout is None or ex.pod is None or ex.status < 200 or 400 <= ex.status < 500:
            return
        stalled = ex.detail == "timeout_stall"
        failed = not stalled and (ex.status >= 500 or ex.detail in _BROKEN)
        ttft = itl = None
        if not failed:
            ttft = ex.ttft
            itl = ex.time_per_output_token(elapsed_s)
        pod = ex.pod
        infra = pod.pressure.open or pod.health.device_fault is not None
        rollout.observe(ex.variant, ttft=ttft, itl=itl, stalled=stalled, failed=failed, infra=infra)

    async def run(self) -> None:
        """Judge every rollout once a second (sooner after an operator's command, to share it)."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), TICK_S)
            self._wake.clear()
            for model, rollout in list(self.active.items()):
                if self.active.get(model) is not rollout:
                    continue  # stopped or restarted by a config reload meanwhile
                if self.shared is None:
                    change = rollout.tick(time.time())
                    if change is not None:
                        self._changed(model, rollout, change)
                    continue
                try:
                    async with asyncio.timeout(TICK_S):
                        await self._tick_shared(model, rollout)
                    if not self._redis_up:
                        log.warning("rollouts: Redis is back; sharing rollouts again")
                    self._redis_up = True
                except self._store_errors as exc:
                    if self._redis_up:
                        log.warning("rollouts: Redis unreachable (%s); keeping each step, rollback only", exc)
                    self._redis_up = False
                    self._tick_alone(model, rollout)
                except Exception:  # a bug here must not stop every rollout's tick
                    log.exception("rollout %s: shared tick failed", model)

    def reconfigure(self, config: Config, route: Route) -> None:
        """Follow a reloaded config, steering ``route`` (the one about to be swapped in) from now on.

        A route whose config is unchanged (the same epoch) keeps its rollout as it is: step, judge
        evidence, history. One whose config changed restarts at step 0; one no longer planned stops,
        its weights the config's again. Nothing is awaited, so the swap is whole or not at all."""
        self._take(config, route, reload=True)

    def _take(self, config: Config, route: Route, reload: bool) -> None:
        """The rollouts of ``config``'s routes (at start-up every one new; on a ``reload`` those whose
        epoch is unchanged kept), their weights in ``route``'s routers, and Redis when it is needed."""
        now = time.time()
        active: dict[str, Rollout] = {}
        sync: dict[str, _Sync] = {}
        for model, rc in config.routes.items():
            if rc.rollout is None:
                continue
            digest = epoch(rc)
            old = self.active.get(model)
            if old is not None and self._sync[model].epoch == digest:
                active[model], sync[model] = old, self._sync[model]
                continue
            rollout = active[model] = Rollout(model, rc.rollout, started_at=now, variants=rc.variants)
            sync[model] = _Sync(digest)
            if reload:
                how = "its route changed: restarted at step 0" if old is not None else "started"
                log.info("rollout %s: %s by a config reload; weights now %s", model, how, rollout.weights())
        for model in self.active.keys() - active.keys():  # none at start-up
            log.info("rollout %s: stopped by a config reload (the route has no rollout plan now)", model)
        self.route, self.active, self._sync = route, active, sync
        for model, rollout in active.items():
            self._apply(model, rollout.weights())
        url = config.quotas.redis_url
        if self.shared is None and url and active:
            from redis.exceptions import RedisError  # redis-py only when rollouts are shared

            self.shared = SharedRollouts(url, config.quotas.key_prefix)
            self._store_errors = (RedisError, OSError, TimeoutError)

    def command(self, model: str, action: str, why: str = "operator") -> dict[str, Any] | None:
        """An operator's pause / resume / promote / abort; None for a route with no rollout.
        ``RolloutError`` when the rollout's state does not allow it (resuming a finished one).
        With Redis, it applies here at once and is written for every replica on the next tick."""
        rollout = self.active.get(model)
        if rollout is None:
            return None
        now = time.time()
        if action == "pause":
            change = rollout.pause(now, why)
        elif action == "resume":
            change = rollout.resume(now)
        elif action == "promote":
            change = rollout.promote(now)
        else:
            change = rollout.abort(now, why)
        self._changed(model, rollout, change)
        if self.shared is not None:
            self._sync[model].pending = True
            self._wake.set()
        return rollout.status(now)

    def status(self) -> list[dict[str, Any]]:
        now = time.time()
        return [rollout.status(now) for rollout in self.active.values()]

    async def _tick_shared(self, model: str, rollout: Rollout) -> None:
        """Flush, lease, read; then write a pending change, follow a newer state, or decide."""
        assert self.shared is not None
        sync = self._sync[model]
        live = rollout.state in ("progressing", "paused")
        taken = rollout.judge.to_state()
        step_key = (rollout.step, rollout.step_started_at)
        if sync.step_key != step_key:
            sync.step_key, sync.flushed = step_key, {}
        delta = {
            k: v - sync.flushed.get(k, 0) for k, v in taken.items() if live and v != sync.flushed.get(k, 0)
        }
        samples_key = self.shared.samples_key(model, sync.epoch, *step_key)
        synced = await self.shared.sync(model, sync.epoch, samples_key, delta)
        if (rollout.step, rollout.step_started_at) == step_key and live:
            # What arrived while the round trip was away stays local until the next flush.
            later = {k: v - taken[k] for k, v in rollout.judge.to_state().items() if v != taken[k]}
            sync.flushed = synced.samples
            rollout.rebase(synced.samples)
            rollout.judge.merge(later)
        shared = synced.shared
        if shared is None:  # the first replica up writes the rollout's start
            await self._publish(model, rollout, expected=0, event=sync.pending)
        elif sync.pending:
            await self._publish(model, rollout)
        elif shared.version != sync.version:
            self._follow(model, rollout, shared)
        elif synced.decider and live:
            change = rollout.tick(time.time())
            if change is not None:
                await self._publish(model, rollout, change=change)

    async def _publish(
        self,
        model: str,
        rollout: Rollout,
        *,
        expected: int | None = None,
        change: Change | None = None,
        event: bool = True,
    ) -> None:
        """Write this replica's state for the others (the decider's ``change``, an operator's command
        or a rollback made without Redis); if another write came first, drop this one and follow."""
        assert self.shared is not None
        sync = self._sync[model]
        last = rollout.history[-1] if rollout.history and event else None
        status = {"state": rollout.state, "step": rollout.step, "percent": rollout.canary_percent,
                  "step_started_at": rollout.step_started_at}  # fmt: skip
        expected = sync.version if expected is None else expected
        version = await self.shared.commit(model, sync.epoch, expected, status, last)
        was_pending, sync.pending = sync.pending, False
        if version:
            sync.version = version
            if change is not None:
                self._changed(model, rollout, change)  # the one decision: logged by its decider only
            return
        if change is not None:
            rollout.history.remove(change.event)  # never made: another replica's write came first
        elif was_pending:
            log.warning("rollout %s: another replica's change came first; this one is dropped", model)
        shared = await self.shared.read(model, sync.epoch)
        if shared is not None:
            self._follow(model, rollout, shared)

    def _follow(self, model: str, rollout: Rollout, shared: Shared) -> None:
        """Take on the shared state, as decided by another replica (or an operator on one)."""
        self._sync[model].version = shared.version
        before = (rollout.state, rollout.step, rollout.canary_percent)
        rollout.follow(shared.state, shared.step, shared.percent, shared.step_started_at, shared.event)
        self._apply(model, rollout.weights())  # also when this replica's own lost decision changed it
        if rollout.state == "rolled_back":
            self._move_streams(model, rollout)  # each replica moves its own streams, once
        if (rollout.state, rollout.step, rollout.canary_percent) != before:
            what, why = (shared.event.what, shared.event.reason) if shared.event else ("?", "?")
            log.info("rollout %s follows %s: now %s (%s: %s); weights now %s", model, shared.by,
                     rollout.state, what, why, rollout.weights())  # fmt: skip

    def _tick_alone(self, model: str, rollout: Rollout) -> None:
        """Without Redis: no advance (that needs every replica's samples), but a fail rolls back."""
        now = time.time()
        if rollout.state not in ("progressing", "paused") or rollout.judge.verdict(now).decision != "fail":
            return
        change = rollout.tick(now)
        if change is not None:
            self._changed(model, rollout, change)
            self._sync[model].pending = True

    def _changed(self, model: str, rollout: Rollout, change: Change) -> None:
        self._apply(model, change.weights)
        if change.what == "rolled_back":
            self._move_streams(model, rollout)
        level = logging.WARNING if rollout.state == "rolled_back" else logging.INFO
        log.log(level, "rollout %s: %s (%s: %s); weights now %s", model, rollout.state, change.what,
                change.reason, change.weights)  # fmt: skip

    def _move_streams(self, model: str, rollout: Rollout) -> None:
        """``on_rollback: resume``: the canary's streams in flight continue on stable (``rollback.py``)."""
        if rollout.config.on_rollback != "resume" or self.on_rollback is None or rollout in self._moved:
            return
        self._moved.add(rollout)
        self.on_rollback(model, rollout.canary)

    def _apply(self, model: str, weights: dict[str, float]) -> None:
        """Swap in the route's router with these weights: one assignment, streams untouched."""
        router = self.route.routers.get(model)
        if router is not None:
            self.route.routers[model] = router.with_weights(weights)
