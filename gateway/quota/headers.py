"""OpenAI's rate-limit headers, so the openai SDKs' own back-off works against the gateway unchanged.

``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` on every answer (only for the limits
that are set), resets in OpenAI's duration form ("1s", "59.2s", "1m0s", "120ms"), and on a
refusal ``retry-after`` (whole seconds) with ``retry-after-ms``, which the SDKs read first.
"""

from __future__ import annotations

import math

from gateway.quota.decision import Decision
from gateway.quota.policy import QuotaPolicy


def duration(seconds: float) -> str:
    """OpenAI's (Go's) duration form, rounded up to a tenth of a second: a client that waits this
    long finds the window reset."""
    if seconds < 1:
        return f"{max(1, math.ceil(seconds * 1000))}ms"
    tenths = math.ceil(round(seconds * 10, 6))
    minutes, tenths = divmod(tenths, 600)
    secs = f"{tenths // 10}s" if tenths % 10 == 0 else f"{tenths / 10:.1f}s"
    return f"{minutes}m{secs}" if minutes else secs


def rate_headers(policy: QuotaPolicy, decision: Decision) -> tuple[tuple[bytes, bytes], ...]:
    reset = duration(decision.reset_s).encode()
    headers: list[tuple[bytes, bytes]] = []
    if policy.requests_per_minute is not None:
        limit = policy.requests_per_minute
        headers += [
            (b"x-ratelimit-limit-requests", str(limit).encode()),
            (b"x-ratelimit-remaining-requests", str(max(0, limit - decision.requests)).encode()),
            (b"x-ratelimit-reset-requests", reset),
        ]
    if policy.tokens_per_minute is not None:
        limit = policy.tokens_per_minute
        headers += [
            (b"x-ratelimit-limit-tokens", str(limit).encode()),
            (b"x-ratelimit-remaining-tokens", str(max(0, limit - decision.tokens)).encode()),
            (b"x-ratelimit-reset-tokens", reset),
        ]
    return tuple(headers)


def retry_headers(seconds: float) -> tuple[tuple[str, str], ...]:
    return (
        ("retry-after", str(max(1, math.ceil(seconds)))),
        ("retry-after-ms", str(math.ceil(seconds * 1000))),
    )
