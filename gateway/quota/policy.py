"""Which quota applies to a caller: the key's own, else its tier's, else ``quotas.default``."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.config import Config, QuotaConfig


@dataclass(frozen=True, slots=True)
class QuotaPolicy:
    """The limits one key admits under; ``None`` leaves that dimension unlimited."""

    requests_per_minute: int | None
    tokens_per_minute: int | None
    max_concurrent: int | None
    fail_open: bool

    @classmethod
    def of(cls, quota: QuotaConfig) -> QuotaPolicy | None:
        if (
            quota.requests_per_minute is None
            and quota.tokens_per_minute is None
            and quota.max_concurrent is None
        ):
            return None
        return cls(
            quota.requests_per_minute,
            quota.tokens_per_minute,
            quota.max_concurrent,
            quota.on_store_down == "fail_open",
        )

    def scaled(self, replicas: int) -> QuotaPolicy:
        """This replica's share while Redis is down: each limit divided by the replicas, at least 1."""
        if replicas <= 1:
            return self

        def share(limit: int | None) -> int | None:
            return None if limit is None else max(1, limit // replicas)

        return QuotaPolicy(
            share(self.requests_per_minute),
            share(self.tokens_per_minute),
            share(self.max_concurrent),
            self.fail_open,
        )


_UNSET = object()
# One config at a time (a reload swaps it): per-tier answers for it, and per key quota object.
_cached_config: object = _UNSET
_by_tier: dict[str | None, QuotaPolicy | None] = {}
_by_key_quota: dict[int, tuple[QuotaConfig, QuotaPolicy | None]] = {}


def policy_for(config: Config, tier: str | None, key_quota: QuotaConfig | None) -> QuotaPolicy | None:
    """The key's own quota, else its tier's, else ``quotas.default``; ``None`` when nothing limits.

    Called on every request, so answers are cached per config object (per tier, and per key quota
    object, which the key store keeps for the key's life)."""
    global _cached_config
    if config is not _cached_config:
        _by_tier.clear()
        _by_key_quota.clear()
        _cached_config = config
    if key_quota is not None:
        found = _by_key_quota.get(id(key_quota))
        if found is None or found[0] is not key_quota:
            if len(_by_key_quota) > 65536:  # key store reloads make new objects: bound the cache
                _by_key_quota.clear()
            found = _by_key_quota[id(key_quota)] = (key_quota, QuotaPolicy.of(key_quota))
        return found[1]
    if tier is not None and tier not in config.tiers:
        tier = None  # an unknown name (a trusted header's) gets the default and no cache entry of its own
    try:
        return _by_tier[tier]
    except KeyError:
        pass
    tier_config = config.tiers[tier] if tier is not None else None
    quota = tier_config.quota if tier_config is not None else None
    if quota is None:
        quota = config.quotas.default
    policy = _by_tier[tier] = QuotaPolicy.of(quota) if quota is not None else None
    return policy
