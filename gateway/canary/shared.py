"""A rollout shared by the gateway's replicas through Redis: one step, one merged judge, one decider.

Keys, per route and *epoch* (a digest of the route's config, so a new plan or new variants start
afresh instead of following an old rollout's end), under ``quotas.key_prefix + "rollout:"``:

- ``{model}:{epoch}:state``: the hash every replica follows: ``version`` (bumped by every write),
  ``state``, ``step``, ``percent``, ``step_started_at`` (the decider's wall clock), ``event`` (the
  last history event as JSON) and ``by`` (the replica that wrote it).
- ``{model}:{epoch}:{step}:{started}:samples``: the step's judge state, summed by every replica's
  HINCRBY of what it saw since its last flush (the judge's integer state merges exactly).
- ``{model}:{epoch}:decider``: a lease (``SET NX PX``, renewed every tick) naming the one replica
  that judges and decides; if it dies, another takes over when the lease lapses.

Every write to the state is a compare-and-set on ``version`` (Lua), so two replicas that decide at
once (a lease handed over mid-tick, an operator on each) cannot both win: the loser follows. A
rollback is the exception: it overwrites any state that is not already over, since going back to
stable is always safe and must not be lost (a replica that rolled back alone while Redis was away).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.canary.rollout import Event

KEY_TTL_MS = 7 * 24 * 3600 * 1000  # a finished rollout's keys outlive any sensible deploy, then go
LEASE_MS = 3000  # three ticks: a decider that misses two renewals still holds it

# KEYS: lease. ARGV: replica, ttl ms. 1 when this replica holds the lease (taken or renewed).
LEASE = """
local holder = redis.call('GET', KEYS[1])
if not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

# KEYS: state. ARGV: expected version, state, step, percent, step_started_at, event JSON, replica,
# ttl ms. The new version, or 0 when another write came first (a rollback wins unless it is over).
COMMIT = """
local v = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
if v ~= tonumber(ARGV[1]) then
  local now = redis.call('HGET', KEYS[1], 'state')
  if ARGV[2] ~= 'rolled_back' or now == 'rolled_back' or now == 'promoted' then return 0 end
end
redis.call('HSET', KEYS[1], 'version', v + 1, 'state', ARGV[2], 'step', ARGV[3], 'percent', ARGV[4],
  'step_started_at', ARGV[5], 'event', ARGV[6], 'by', ARGV[7])
redis.call('PEXPIRE', KEYS[1], ARGV[8])
return v + 1
"""


def epoch(route_config: Any) -> str:
    """A digest of the route's config: replicas with the same plan share one rollout."""
    return hashlib.sha256(route_config.model_dump_json().encode()).hexdigest()[:12]


@dataclass(frozen=True, slots=True)
class Shared:
    """The shared state as read from Redis."""

    version: int
    state: str
    step: int
    percent: float
    step_started_at: float
    event: Event | None
    by: str

    @classmethod
    def parse(cls, fields: Mapping[bytes, bytes]) -> Shared | None:
        if not fields:
            return None
        f = {k.decode(): v.decode() for k, v in fields.items()}
        event = None
        if f.get("event"):
            raw = json.loads(f["event"])
            raw["triggered"] = tuple(raw.get("triggered") or ())
            event = Event(**raw)
        return cls(int(f["version"]), f["state"], int(f["step"]), float(f["percent"]),
                   float(f["step_started_at"]), event, f.get("by", "?"))  # fmt: skip


@dataclass(frozen=True, slots=True)
class Synced:
    """One tick's round trip: whether this replica decides, the shared state, the step's samples."""

    decider: bool
    shared: Shared | None
    samples: dict[str, int]


class SharedRollouts:
    """The Redis side of shared rollouts; the caller (``Rollouts``) bounds every call's time."""

    def __init__(self, url: str, key_prefix: str) -> None:
        import redis.asyncio as aioredis  # here: redis-py is imported only where rollouts are shared
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        # No retries inside the client: a dead Redis costs one timeout per tick, then the next tick.
        self.client = aioredis.Redis.from_url(
            url, socket_timeout=1.0, socket_connect_timeout=1.0, retry=Retry(NoBackoff(), 0)
        )
        self.prefix = key_prefix + "rollout:"
        self.replica = f"{socket.gethostname()}:{os.getpid()}:{os.urandom(3).hex()}"
        self._lease = self.client.register_script(LEASE)
        self._commit = self.client.register_script(COMMIT)

    def key(self, model: str, epoch: str, *parts: object) -> str:
        return ":".join((self.prefix + model, epoch, *(str(p) for p in parts)))

    def samples_key(self, model: str, epoch: str, step: int, started_at: float) -> str:
        return self.key(model, epoch, step, repr(started_at), "samples")

    async def sync(self, model: str, epoch: str, samples_key: str, delta: Mapping[str, int]) -> Synced:
        """Flush this replica's new samples, take or renew the lease, read the state and the merged
        samples: one pipelined round trip."""
        pipe = self.client.pipeline(transaction=False)
        for field, value in delta.items():
            pipe.hincrby(samples_key, field, value)
        if delta:
            pipe.pexpire(samples_key, KEY_TTL_MS)
        await self._lease(
            keys=[self.key(model, epoch, "decider")], args=[self.replica, LEASE_MS], client=pipe
        )
        pipe.hgetall(self.key(model, epoch, "state"))
        pipe.hgetall(samples_key)
        *_, decider, state, samples = await pipe.execute()
        merged = {k.decode(): int(v) for k, v in samples.items()}
        return Synced(decider == 1, Shared.parse(state), merged)

    async def read(self, model: str, epoch: str) -> Shared | None:
        return Shared.parse(await self.client.hgetall(self.key(model, epoch, "state")))

    async def commit(
        self, model: str, epoch: str, expected: int, status: Mapping[str, Any], event: Event | None
    ) -> int:
        """Write the rollout's state if the shared one is still ``expected``: the new version, or 0."""
        args = [
            expected, status["state"], status["step"], repr(float(status["percent"])),
            repr(float(status["step_started_at"])), json.dumps(event.as_dict()) if event else "",
            self.replica, KEY_TTL_MS,
        ]  # fmt: skip
        return int(await self._commit(keys=[self.key(model, epoch, "state")], args=args))

    async def close(self) -> None:
        await self.client.aclose()
