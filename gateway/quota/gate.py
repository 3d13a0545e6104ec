"""Admission against a key's quota: check and reserve, or refuse with OpenAI's 429; settle at the end.

Counters live in this process (no ``quotas.redis_url``) or in Redis, shared by the replicas. With
Redis, one EVALSHA per admission under ``asyncio.timeout(timeout_ms)``; a failure opens a circuit
breaker, and while it is open no request touches Redis: ``fail_open`` policies count in this
process at each limit divided by ``quotas.replicas``, ``fail_closed`` ones answer 503. A call that
timed out may still run once Redis wakes up: it then counts a request that was not served, which
errs on the side of the limit. Settling never blocks a request: refunds and lease releases are
queued and sent in one pipeline by a background task; releases a down Redis could not take are
kept and sent when it is back (refunds are dropped when unsure whether they ran: over-counting is
the safe side). Leases of live streams are renewed every ``lease_ttl_s / 3``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from gateway.config import QuotasConfig
from gateway.errors import GatewayError
from gateway.metrics import GatewayMetrics
from gateway.quota.breaker import CLOSED, Breaker
from gateway.quota.decision import Decision, window_of
from gateway.quota.headers import duration, rate_headers, retry_headers
from gateway.quota.memory import MemoryCounters
from gateway.quota.policy import QuotaPolicy

if TYPE_CHECKING:
    from gateway.quota.redis_store import RedisCounters

log = logging.getLogger("sluicegate.quota")

MAX_PENDING = 100_000  # queued lease releases kept for a Redis that is down
STORE_DOWN_RETRY_S = 1.0


class Admission:
    """One admitted request's reservation: its rate-limit headers, and how to settle it."""

    __slots__ = (
        "_quotas",
        "_settled",
        "headers",
        "lease",
        "local",
        "release",
        "reserved",
        "subject",
        "window",
    )

    def __init__(
        self,
        quotas: Quotas | None,
        subject: str,
        window: int,
        reserved: int,
        headers: tuple[tuple[bytes, bytes], ...],
        lease: str = "",
        local: bool = True,
        release: bool = False,
    ) -> None:
        self._quotas = quotas
        self._settled = False
        self.subject = subject
        self.window = window
        self.reserved = reserved
        self.headers = headers
        self.lease = lease  # the Redis lease member ('' when not leased there)
        self.local = local  # counted in this process (no Redis, or Redis was down)
        self.release = release  # holds a local stream slot

    def settle(self, used_tokens: int) -> None:
        """Charge what was used: refund ``reserved - used`` (negative: charge the excess) in the
        window it was reserved in, and free the stream slot. Idempotent; never blocks."""
        if self._settled:
            return
        self._settled = True
        if self._quotas is not None:
            self._quotas._settle(self, used_tokens)


class Quotas:
    """Per-key requests and tokens per clock minute, and streams at once; see the module docstring."""

    def __init__(
        self,
        config: QuotasConfig,
        metrics: GatewayMetrics | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self._clock = clock
        self._memory = MemoryCounters(clock)
        self._redis: RedisCounters | None = None
        self._store_errors: tuple[type[BaseException], ...] = (OSError, TimeoutError)
        if config.redis_url:  # redis-py (~8 MB, more with what it imports) only when a store is named
            from redis.exceptions import RedisError

            from gateway.quota.redis_store import RedisCounters

            self._redis = RedisCounters(
                config.redis_url, config.key_prefix, config.timeout_ms / 1000, config.lease_ttl_s
            )
            self._store_errors = (RedisError, OSError, TimeoutError)
        self._where = _where(config.redis_url) if config.redis_url else "memory"
        self._timeout_s = config.timeout_ms / 1000
        self._background_timeout_s = max(1.0, 10 * self._timeout_s)
        self._breaker = Breaker(config.breaker_open_s, time.monotonic)
        self._replica = uuid.uuid4().hex[:12]
        self._serial = itertools.count()
        self._leases: dict[str, dict[str, None]] = {}  # this replica's live Redis leases, per subject
        # The fleet's counts per subject as Redis last reported them (window, requests, tokens):
        # the local fallback starts from this replica's share of them.
        self._seen: dict[str, tuple[int, int, int]] = {}
        self._seen_window = -1
        self._pending: list[tuple[str, int, int, str]] = []
        self._flushing: asyncio.Task[None] | None = None
        self._renewing: asyncio.Task[None] | None = None
        self._closed = False
        self._down_modes: set[str] = set()
        self._metrics = metrics
        if metrics is not None:
            self._mode = {m: metrics.child(metrics.quota_store_mode, m) for m in ("redis", "local", "closed")}
            self._outcome = {
                o: metrics.child(metrics.quota_decisions, o)
                for o in ("admitted", "refused", "store_down_admitted", "store_down_refused")
            }
            self._latency = {o: metrics.child(metrics.quota_redis_seconds, o) for o in ("ok", "error")}
            self._mode["redis" if self._redis is not None else "local"].set(1)

    @property
    def store_up(self) -> bool:
        """False while the breaker keeps requests off Redis (always True without Redis)."""
        return self._redis is None or self._breaker.state == CLOSED

    async def start(self) -> None:
        """Start the lease renewal loop; Redis itself is connected on first use."""
        if self._redis is not None and self._renewing is None:
            self._renewing = asyncio.get_running_loop().create_task(self._renew_loop(), name="quota-leases")

    async def close(self) -> None:
        self._closed = True
        if self._renewing is not None:
            # Bounded: a client library that swallowed the cancellation must not hang shutdown.
            self._renewing.cancel()
            await asyncio.wait({self._renewing}, timeout=self._background_timeout_s)
            self._renewing = None
        await self.drain()
        if self._redis is not None:
            if self._pending and self.store_up:
                await self._flush()
            await self._redis.close()

    async def drain(self) -> None:
        """Wait until the settles queued so far have been sent to Redis (or failed to be)."""
        while self._flushing is not None:
            await asyncio.shield(self._flushing)

    async def admit(self, subject: str, policy: QuotaPolicy, tokens: int) -> Admission:
        """Check and reserve one request, ``tokens`` tokens and a stream slot for ``subject`` (the
        key id), all or nothing; refuse with 429 ``rate_limit_exceeded`` (or 503 while Redis is
        down under ``fail_closed``)."""
        if self._redis is None:
            return self._decided(subject, policy, tokens, self._memory.admit(subject, policy, tokens), False)
        attempt = self._breaker.attempt()
        if attempt is not None:
            now = self._clock()
            lease = f"{self._replica}:{next(self._serial)}" if policy.max_concurrent is not None else ""
            probe = attempt == "probe"
            started = time.perf_counter()
            try:
                async with asyncio.timeout(self._timeout_s):
                    decision = await self._redis.admit(subject, policy, tokens, now, window_of(now), lease)
            except asyncio.CancelledError:
                if probe:
                    self._breaker.abandoned()
                raise
            except self._store_errors as exc:
                self._observe("error", started)
                self._failed(probe, exc)
            else:
                self._observe("ok", started)
                if self._breaker.succeeded(probe):
                    self._back()
                self._remember(subject, decision)
                if decision.refused is None and lease:
                    self._leases.setdefault(subject, {})[lease] = None
                else:
                    lease = ""
                return self._decided(subject, policy, tokens, decision, False, lease)
        if not policy.fail_open:
            self._count("store_down_refused")
            self._down_mode("closed")
            raise GatewayError(
                503,
                "The quota store is unreachable and this key's quota is fail_closed; retry shortly.",
                "service_unavailable",
                "quota_store_unavailable",
                headers=retry_headers(STORE_DOWN_RETRY_S),
            )
        self._down_mode("local")
        share = policy.scaled(self.config.replicas)
        seen = self._seen.pop(subject, None)
        if seen is not None:  # the first local admission of this subject since Redis was lost
            replicas = self.config.replicas
            self._memory.seed(subject, seen[0], seen[1] // replicas, seen[2] // replicas)
        return self._decided(subject, share, tokens, self._memory.admit(subject, share, tokens), True)

    def _remember(self, subject: str, decision: Decision) -> None:
        """Keep the subject's latest fleet-wide counts (only this window's: older ones are dropped
        when a new window begins, so this follows the keys in use, not every key ever seen)."""
        if decision.window != self._seen_window:
            self._seen_window = decision.window
            self._seen.clear()
        self._seen[subject] = (decision.window, decision.requests, decision.tokens)

    def _decided(
        self, subject: str, policy: QuotaPolicy, tokens: int, decision: Decision, down: bool, lease: str = ""
    ) -> Admission:
        headers = rate_headers(policy, decision)
        if decision.refused is not None:
            self._count("store_down_refused" if down else "refused")
            raise _refusal(policy, tokens, decision, headers)
        self._count("store_down_admitted" if down else "admitted")
        local = self._redis is None or down
        release = local and policy.max_concurrent is not None
        return Admission(self, subject, decision.window, tokens, headers, lease, local, release)

    def _settle(self, admission: Admission, used: int) -> None:
        refund = admission.reserved - max(0, used)
        if admission.local:
            self._memory.settle(admission.subject, admission.window, refund, admission.release)
            return
        lease = admission.lease
        if lease:
            live = self._leases.get(admission.subject)
            if live is not None:
                live.pop(lease, None)
                if not live:
                    del self._leases[admission.subject]
        if refund or lease:
            self._queue([(admission.subject, admission.window, refund, lease)])

    def _queue(self, settles: list[tuple[str, int, int, str]]) -> None:
        self._pending.extend(settles)
        if len(self._pending) > MAX_PENDING:
            del self._pending[: len(self._pending) - MAX_PENDING]  # the oldest leases expire anyway
        if self._flushing is None and self.store_up:
            with contextlib.suppress(RuntimeError):  # no running loop: sent with the next one
                self._flushing = asyncio.get_running_loop().create_task(self._flush(), name="quota-settle")

    async def _flush(self) -> None:
        """Send queued settles in one pipeline per batch; whatever arrives meanwhile is the next batch."""
        assert self._redis is not None
        try:
            while self._pending and self.store_up:
                batch, self._pending = self._pending, []
                try:
                    async with asyncio.timeout(self._background_timeout_s):
                        await self._redis.settle(batch)
                except self._store_errors as exc:
                    self._failed(False, exc)
                    # Whether they ran is unknown: keep the releases (idempotent), not the refunds.
                    kept = [(s, w, 0, lease) for s, w, _, lease in batch if lease]
                    self._pending[:0] = kept
                    return
        finally:
            self._flushing = None

    async def _renew_loop(self) -> None:
        assert self._redis is not None
        interval = self.config.lease_ttl_s / 3
        while not self._closed:
            await asyncio.sleep(interval)
            if self._leases:
                leases = {subject: list(members) for subject, members in self._leases.items()}
                try:
                    async with asyncio.timeout(self._background_timeout_s):
                        await self._redis.renew(leases, self._clock())
                except self._store_errors as exc:
                    self._failed(False, exc)
            if self._pending and self._flushing is None and self.store_up:
                self._queue([])

    def _failed(self, probe: bool, exc: BaseException) -> None:
        if not self._breaker.failed(probe):
            return
        assert self._redis is not None
        self._redis.drop_idle_connections()
        why = str(exc) or type(exc).__name__
        log.warning(
            "quota store %s unreachable (%s): no request asks it for %.1f s; fail_open quotas count "
            "in this process at limit / %d replicas, fail_closed quotas answer 503",
            self._where,
            why,
            self.config.breaker_open_s,
            self.config.replicas,
        )
        if self._metrics is not None:
            self._mode["redis"].set(0)

    def _back(self) -> None:
        log.info("quota store %s answers again: counting in Redis", self._where)
        self._down_modes.clear()
        if self._metrics is not None:
            self._mode["redis"].set(1)
            self._mode["local"].set(0)
            self._mode["closed"].set(0)
        if self._pending and self._flushing is None:
            self._queue([])

    def _down_mode(self, mode: str) -> None:
        if mode not in self._down_modes:
            self._down_modes.add(mode)
            if self._metrics is not None:
                self._mode[mode].set(1)

    def _count(self, outcome: str) -> None:
        if self._metrics is not None:
            self._outcome[outcome].inc()

    def _observe(self, outcome: str, started: float) -> None:
        if self._metrics is not None:
            self._latency[outcome].observe(time.perf_counter() - started)


def _where(url: str) -> str:
    """The store's address for logs, without a password."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or ''}{f':{parts.port}' if parts.port else ''}{parts.path}"


def _refusal(
    policy: QuotaPolicy, tokens: int, decision: Decision, headers: tuple[tuple[bytes, bytes], ...]
) -> GatewayError:
    reset = duration(decision.reset_s)
    retry_s = decision.reset_s
    if decision.refused == "requests":
        message = (
            f"Rate limit reached for requests per minute: limit {policy.requests_per_minute}, "
            f"used {decision.requests}, requested 1. Please try again in {reset}."
        )
    elif decision.refused == "tokens" and tokens > (policy.tokens_per_minute or 0):
        message = (
            f"Request too large for tokens per minute: limit {policy.tokens_per_minute}, requested "
            f"{tokens} (the prompt's estimate plus max_tokens for each choice). Lower max_tokens or "
            "the prompt."
        )
    elif decision.refused == "tokens":
        message = (
            f"Rate limit reached for tokens per minute: limit {policy.tokens_per_minute}, used "
            f"{decision.tokens}, requested {tokens}. Please try again in {reset}."
        )
    else:
        retry_s = STORE_DOWN_RETRY_S
        message = (
            f"Too many concurrent requests: limit {policy.max_concurrent} streams at once for this key. "
            "Please try again when one ends."
        )
    return GatewayError(
        429,
        message,
        "rate_limit_exceeded",
        "rate_limit_exceeded",
        headers=(*retry_headers(retry_s), *((k.decode(), v.decode()) for k, v in headers)),
    )
