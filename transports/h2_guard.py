"""Per-connection accounting against HTTP/2 floods: frames that cost the server work and give the
client nothing it could not get more cheaply, counted so that one abusive connection is cut off
(GOAWAY ENHANCE_YOUR_CALM) before it takes the event loop from everyone else.

What is counted (see docs/hardening.md for the defaults and where they come from):

- **premature resets** (Rapid Reset, CVE-2023-44487): streams the client resets within
  ``premature_reset_s`` of opening them, and streams the server had to refuse (beyond
  MAX_CONCURRENT_STREAMS, too many headers). Past ``max_premature_resets`` of them, when they are
  also more than half of the connection's streams (Envoy's rule), the connection goes.
- **inbound control frames** (PING, SETTINGS, PRIORITY, unknown types): a token bucket of
  ``control_frame_burst`` tokens refilled at ``control_frames_per_s``. A client has no reason to
  send hundreds of these a second; each costs a parse and, for PING and SETTINGS, a reply.
- **outbound control frames** queued for a client that does not read (PING and SETTINGS ACKs,
  RST_STREAMs), counted since the transport's buffer was last empty: past
  ``max_outbound_control_frames`` (Envoy's ``max_outbound_control_frames``) the connection goes.
- **empty frames**: DATA frames with no payload and no END_STREAM, in a row
  (Envoy's ``max_consecutive_inbound_frames_with_empty_payload``).
- **window updates**: a client grants credit as it reads DATA, so WINDOW_UPDATE frames beyond
  ``max_window_updates_per_data_frame`` per DATA frame sent (plus one allowance per stream and a
  small fixed one) are a flood: Envoy's ``max_inbound_window_update_frames_per_data_frame_sent``
  (10) and its formula.

Each ``FloodGuard`` method is called once per frame of its kind, from the protocol's event loop
callback, and returns True when the connection must go. No method runs per DATA byte or per token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class H2Limits:
    """What one HTTP/2 connection may do before it is cut off, and how long it may stall."""

    head_timeout_s: float = 10.0  # a new connection's first complete request HEADERS
    max_headers: int = 100  # per request; more → 431 on that stream
    premature_reset_s: float = 1.0
    max_premature_resets: int = 100
    control_frames_per_s: float = 100.0
    control_frame_burst: int = 1000
    max_outbound_control_frames: int = 1000
    max_empty_frames: int = 10
    max_window_updates_per_data_frame: int = 10
    send_stall_s: float = 30.0  # a response chunk may wait this long for the client's window or reads


class FloodGuard:
    """One connection's flood counters (see module doc); ``clock`` is the event loop's ``time``."""

    __slots__ = (
        "_clock",
        "_last_refill",
        "_opened",
        "_tokens",
        "empty_run",
        "limits",
        "outbound",
        "premature",
        "reason",
        "streams",
        "window_updates",
    )

    def __init__(self, limits: H2Limits, clock: Callable[[], float]) -> None:
        self.limits = limits
        self._clock = clock
        self._opened: dict[int, float] = {}  # open streams: when each was opened
        self.streams = 0  # streams opened or refused on this connection
        self.premature = 0
        self._tokens = float(limits.control_frame_burst)
        self._last_refill = clock()
        self.outbound = 0  # control frames queued since the transport's buffer was last empty
        self.empty_run = 0
        self.window_updates = 0
        self.reason = ""  # why the connection was cut off, once it is

    # -- streams ---------------------------------------------------------------------------------

    def opened(self, stream_id: int) -> None:
        self.streams += 1
        self._opened[stream_id] = self._clock()

    def closed(self, stream_id: int) -> None:
        self._opened.pop(stream_id, None)

    def reset_by_client(self, stream_id: int) -> bool:
        """The client reset a stream whose answer was not complete."""
        opened = self._opened.pop(stream_id, None)
        if opened is None or self._clock() - opened >= self.limits.premature_reset_s:
            return False
        return self._count_premature("premature stream resets")

    def refused(self) -> bool:
        """The server refused a stream at once (REFUSED_STREAM, 431): as costly as a reset one."""
        self.streams += 1
        self.outbound += 1
        return self._count_premature("refused streams")

    def _count_premature(self, what: str) -> bool:
        self.premature += 1
        if self.premature > self.limits.max_premature_resets and 2 * self.premature > self.streams:
            self.reason = f"{self.premature} {what} of {self.streams} streams"
            return True
        return False

    # -- control frames --------------------------------------------------------------------------

    def control_frame(self, replies: int = 0) -> bool:
        """A PING, SETTINGS, PRIORITY or unknown frame arrived; ``replies``: frames it makes us queue."""
        now = self._clock()
        lim = self.limits
        tokens = self._tokens + (now - self._last_refill) * lim.control_frames_per_s
        self._last_refill = now
        self._tokens = tokens = min(tokens, float(lim.control_frame_burst)) - 1.0
        if tokens < 0:
            self.reason = f"control frame flood (over {lim.control_frames_per_s:g}/s)"
            return True
        if replies:
            self.outbound += replies
            if self.outbound > lim.max_outbound_control_frames:
                self.reason = f"{self.outbound} control frames queued for a client that does not read"
                return True
        return False

    def drained(self) -> None:
        """The transport's write buffer is empty: every queued control frame has gone out."""
        self.outbound = 0

    def window_update(self, data_frames_sent: int) -> bool:
        """A WINDOW_UPDATE arrived; ``data_frames_sent``: DATA frames sent on the connection so far."""
        self.window_updates += 1
        allowed = 5 + 2 * (self.streams + self.limits.max_window_updates_per_data_frame * data_frames_sent)
        if self.window_updates > allowed:
            self.reason = f"{self.window_updates} WINDOW_UPDATEs for {data_frames_sent} DATA frames sent"
            return True
        return False

    def empty_frame(self) -> bool:
        self.empty_run += 1
        if self.empty_run > self.limits.max_empty_frames:
            self.reason = f"{self.empty_run} empty DATA frames in a row"
            return True
        return False
