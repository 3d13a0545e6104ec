"""What a chat request reports besides its tokens: the whole answer, and how it travelled.

``Negotiation`` is also the negotiation's per-request working state (its hidden fields), so that
a retry after a failure knows what was already tried.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from transports.h3_client import H3ClientConnection

log = logging.getLogger("sluicegate.client")


@dataclass
class Negotiation:
    """What the client did to carry one request: useful in logs, asserted on in tests.

    Times are seconds from the start of the request.
    """

    transport: str | None = None
    attempts: list[str] = field(default_factory=list)
    raced: bool = False
    race_delay: float | None = None
    tcp_started_after: float | None = None
    h3_error: str | None = None
    headers_after: float | None = None
    first_token_after: float | None = None
    started: float = field(default=0.0, repr=False)
    tries: int = field(default=0, repr=False)
    current: str | None = field(default=None, repr=False)
    avoid_h3: bool = field(default=False, repr=False)
    h3_reused: bool = field(default=False, repr=False)
    h3_conn: H3ClientConnection | None = field(default=None, repr=False)

    def note(self, text: str) -> None:
        """Record a step in ``attempts`` (and the debug log)."""
        self.attempts.append(text)
        log.debug("negotiation: %s", text)


@dataclass
class ChatResult:
    """A whole (non-streamed) chat completion and how it travelled."""

    text: str
    transport: str
    finish_reason: str | None
    usage: dict[str, Any] | None
    raw: dict[str, Any]
    negotiation: Negotiation
