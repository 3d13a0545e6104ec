"""Quota counters in Redis, shared by every gateway replica: one round trip per admission.

Per subject (the key id) and window: a hash ``PREFIX + subject + ":" + window`` with ``r``
(requests) and ``t`` (tokens), expiring a minute after its window ends. Concurrency: a sorted set
``PREFIX + subject + ":leases"`` of stream leases scored by their expiry, so the streams of a
replica that crashed are released ``lease_ttl_s`` after its last renewal instead of never. One Lua
script checks all three limits and reserves all or nothing (EVALSHA; EVAL on NOSCRIPT, after a
restart or a SCRIPT FLUSH). Admissions that arrive in the same event-loop turn share one pipeline,
so a burst of a thousand requests costs a few connections, not a thousand. Times are the calling
replica's clock in milliseconds (see decision.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Iterable

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError

from gateway.quota.decision import WINDOW_S, Decision
from gateway.quota.policy import QuotaPolicy

# KEYS: window hash, leases zset. ARGV: now_ms, window end ms, rpm, tpm, concurrent (0: unlimited),
# tokens, lease member, lease ttl ms. Returns {refused, requests, tokens, streams}.
ADMIT = """
local now = tonumber(ARGV[1])
local rpm, tpm, conc = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local tokens = tonumber(ARGV[6])
local counts = redis.call('HMGET', KEYS[1], 'r', 't')
local r, t = tonumber(counts[1]) or 0, tonumber(counts[2]) or 0
local streams = 0
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  streams = redis.call('ZCARD', KEYS[2])
end
local refused = ''
if rpm > 0 and r + 1 > rpm then refused = 'requests'
elseif tpm > 0 and t + tokens > tpm then refused = 'tokens'
elseif conc > 0 and streams + 1 > conc then refused = 'concurrency' end
if refused == '' then
  r = redis.call('HINCRBY', KEYS[1], 'r', 1)
  t = redis.call('HINCRBY', KEYS[1], 't', tokens)
  if r == 1 then redis.call('PEXPIREAT', KEYS[1], tonumber(ARGV[2]) + 60000) end
  if conc > 0 then
    local ttl = tonumber(ARGV[8])
    redis.call('ZADD', KEYS[2], now + ttl, ARGV[7])
    redis.call('PEXPIRE', KEYS[2], ttl)
    streams = streams + 1
  end
end
return {refused, r, t, streams}
"""

# KEYS: window hash, leases zset. ARGV: tokens to refund (negative: charge), lease member or ''.
# A refund never recreates a window hash that has expired (it would live forever, unexpiring).
SETTLE = """
local refund = tonumber(ARGV[1])
if refund ~= 0 and redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HINCRBY', KEYS[1], 't', -refund)
end
if ARGV[2] ~= '' then redis.call('ZREM', KEYS[2], ARGV[2]) end
return 0
"""

# KEYS: leases zset. ARGV: new expiry ms, ttl ms, members. Re-scores only members still there.
RENEW = """
local expiry = tonumber(ARGV[1])
for i = 3, #ARGV do redis.call('ZADD', KEYS[1], 'XX', expiry, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
return 0
"""


class _Script:
    __slots__ = ("sha", "source")

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()


class RedisCounters:
    def __init__(self, url: str, prefix: str, timeout_s: float, lease_ttl_s: float) -> None:
        # No retries inside the client: a dead Redis must cost one timeout, then the breaker.
        # Admissions are bounded by the caller's asyncio.timeout(timeout_s); the socket timeouts
        # only bound background work (settles, renewals), whose batches may take longer.
        self.client = aioredis.Redis.from_url(
            url,
            socket_timeout=max(1.0, 10 * timeout_s),
            socket_connect_timeout=max(1.0, 10 * timeout_s),
            retry=Retry(NoBackoff(), 0),
            decode_responses=False,
        )
        self.prefix = prefix
        self.timeout_s = timeout_s
        self._queued: list[tuple[tuple[str, ...], tuple[object, ...], asyncio.Future[list]]] = []
        self._sending = False
        self._in_flight: set[asyncio.Task[None]] = set()
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self._admit = _Script(ADMIT)
        self._settle = _Script(SETTLE)
        self._renew = _Script(RENEW)

    def window_key(self, subject: str, window: int) -> str:
        return f"{self.prefix}{subject}:{window}"

    def leases_key(self, subject: str) -> str:
        return f"{self.prefix}{subject}:leases"

    async def admit(
        self, subject: str, policy: QuotaPolicy, tokens: int, now: float, window: int, member: str
    ) -> Decision:
        """Run the admission script; the caller bounds the wait (``asyncio.timeout``)."""
        now_ms = int(now * 1000)
        end_ms = (window + 1) * WINDOW_S * 1000
        keys = (self.window_key(subject, window), self.leases_key(subject))
        args = (
            now_ms,
            end_ms,
            policy.requests_per_minute or 0,
            policy.tokens_per_minute or 0,
            policy.max_concurrent or 0,
            tokens,
            member,
            self.lease_ttl_ms,
        )
        future: asyncio.Future[list] = asyncio.get_running_loop().create_future()
        self._queued.append((keys, args, future))
        if not self._sending:
            self._sending = True
            asyncio.get_running_loop().call_soon(self._send_queued)
        refused, requests, used, streams = await future
        return Decision(
            refused.decode() or None, window, (end_ms - now_ms) / 1000, int(requests), int(used), int(streams)
        )

    def _send_queued(self) -> None:
        """Admissions that arrived in the same loop turn share one pipeline: one round trip each,
        without a connection per request in flight."""
        self._sending = False
        batch, self._queued = self._queued, []
        if batch:
            task = asyncio.get_running_loop().create_task(self._send(batch), name="quota-admit")
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)

    async def _send(
        self, batch: list[tuple[tuple[str, ...], tuple[object, ...], asyncio.Future[list]]]
    ) -> None:
        try:
            async with asyncio.timeout(self.timeout_s * 2):
                replies = await self._replies(self._admit, [(keys, args) for keys, args, _ in batch])
        except Exception as exc:  # handed to every admission still waiting
            _fail(batch, exc)
            return
        except asyncio.CancelledError:
            _fail(batch, ConnectionError("the quota store client was closed"))
            raise
        for (_, _, future), reply in zip(batch, replies, strict=True):
            if not future.done():
                if isinstance(reply, Exception):
                    future.set_exception(reply)
                else:
                    future.set_result(reply)

    async def settle(self, settles: Iterable[tuple[str, int, int, str]]) -> None:
        """Many settles, (subject, window, refund, lease member or ''), in one pipeline."""
        calls = [
            ((self.window_key(subject, window), self.leases_key(subject)), (refund, member))
            for subject, window, refund, member in settles
        ]
        await self._pipeline(self._settle, calls)

    async def renew(self, leases: dict[str, list[str]], now: float) -> None:
        """Push every live lease of this replica ``lease_ttl_s`` into the future, in one pipeline."""
        expiry = int(now * 1000) + self.lease_ttl_ms
        calls = [
            ((self.leases_key(subject),), (expiry, self.lease_ttl_ms, *members))
            for subject, members in leases.items()
        ]
        await self._pipeline(self._renew, calls)

    async def _pipeline(
        self, script: _Script, calls: list[tuple[tuple[str, ...], tuple[object, ...]]]
    ) -> None:
        for reply in await self._replies(script, calls):
            if isinstance(reply, Exception):
                raise reply

    async def _replies(
        self, script: _Script, calls: list[tuple[tuple[str, ...], tuple[object, ...]]]
    ) -> list:
        """EVALSHA each call in one pipeline; if Redis lost the script (restart, SCRIPT FLUSH),
        send those calls again with EVAL."""
        if not calls:
            return []
        replies: list = [None] * len(calls)
        todo = list(range(len(calls)))
        for attempt in range(2):
            pipe = self.client.pipeline(transaction=False)
            for i in todo:
                keys, args = calls[i]
                if attempt:  # EVAL also puts the script back in Redis's cache
                    pipe.eval(script.source, len(keys), *keys, *args)
                else:
                    pipe.evalsha(script.sha, len(keys), *keys, *args)
            for i, reply in zip(todo, await pipe.execute(raise_on_error=False), strict=True):
                replies[i] = reply
            todo = [i for i in todo if isinstance(replies[i], NoScriptError)]
            if not todo or attempt:
                break
        return replies

    def drop_idle_connections(self) -> None:
        """Close the pool's idle connections (in the background): after Redis died they are dead
        too, and each would fail the first call made on it, the breaker's probe included."""
        task = asyncio.get_running_loop().create_task(self._drop_idle(), name="quota-reconnect")
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

    async def _drop_idle(self) -> None:
        with contextlib.suppress(Exception):
            await self.client.connection_pool.disconnect(inuse_connections=False)

    async def close(self) -> None:
        for task in list(self._in_flight):
            task.cancel()
        await self.client.aclose()


def _fail(
    batch: list[tuple[tuple[str, ...], tuple[object, ...], asyncio.Future[list]]], exc: Exception
) -> None:
    for _, _, future in batch:
        if not future.done():
            future.set_exception(exc)
