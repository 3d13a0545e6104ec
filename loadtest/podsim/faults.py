"""Fault knobs: how a simulated pod misbehaves, per request or for the whole process.

Syntax (the ``x-podsim-fault`` header and the ``--fault`` flag): ``key=value;key=value``.
``POST /admin/faults`` takes the same knobs as a JSON object (or that string under ``"spec"``).

=========================  ======================================================================
knob                       effect on a generation request
=========================  ======================================================================
``first_token_delay_ms=N`` wait N ms more before the first token
``stall_after=N``          after N tokens go silent forever, connection left open
``drop_after=N``           after N tokens abort the TCP connection (no terminating chunk)
``malformed_after=N``      after N tokens send one event that is not JSON, then carry on
``error_after=N``          after N tokens send vLLM's mid-stream error event, then ``[DONE]``
``end_after=N``            after N tokens end the chunked body cleanly: no finish_reason, no ``[DONE]``
``close_after=N``          after N tokens close the connection (FIN) without the terminating chunk
``no_finish=1``            the answer's last chunk has no finish_reason, then a clean end, no ``[DONE]``
``garbage_after=N``        after N tokens one line that is neither SSE nor JSON, then a clean end
``bad_utf8_after=N``       after N tokens a data line with invalid UTF-8, then a clean end
``endless_line_after=N``   after N tokens a data line that never ends: bytes, never a newline
``huge_event_after=N``     after N tokens one valid 4 MiB token event, then carry on
``keepalive_after=N``      after N tokens only ``: keep-alive`` comments, forever, connection open
``status=CODE``            answer CODE (400..599) with a vLLM error body; 503 adds Retry-After
``refuse=1``               reset the connection without answering
``unhealthy=1``            ``/health`` and ``/ping`` answer 503 (useful as a process fault)
``health_delay_ms=N``      ``/health`` and ``/ping`` answer N ms late (an overloaded pod's probe)
``kv_usage=F``             ``/metrics`` reports KV-cache usage F (0..1) instead of the engine's
``waiting=N``              ``/metrics`` reports N waiting requests instead of the engine's
=========================  ======================================================================

"After N tokens" counts content tokens already sent; a fault whose N is not reached before
the answer ends never fires. ``kv_usage`` and ``waiting`` act only as process faults (set with
``--fault`` or ``/admin/faults``): they let a test push a gateway's pressure breaker without
filling a real cache. Admin endpoints are never subject to faults.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

_COUNT_KNOBS = (
    "stall_after", "drop_after", "malformed_after", "error_after", "end_after", "close_after",
    "garbage_after", "bad_utf8_after", "endless_line_after", "huge_event_after", "keepalive_after",
)  # fmt: skip
_FLAG_KNOBS = ("refuse", "unhealthy", "no_finish")


@dataclass(frozen=True, slots=True)
class Faults:
    """A set of fault knobs; ``None`` means the knob is not set."""

    first_token_delay_ms: float | None = None
    stall_after: int | None = None
    drop_after: int | None = None
    malformed_after: int | None = None
    error_after: int | None = None
    end_after: int | None = None
    close_after: int | None = None
    no_finish: bool | None = None
    garbage_after: int | None = None
    bad_utf8_after: int | None = None
    endless_line_after: int | None = None
    huge_event_after: int | None = None
    keepalive_after: int | None = None
    status: int | None = None
    refuse: bool | None = None
    unhealthy: bool | None = None
    health_delay_ms: float | None = None
    kv_usage: float | None = None
    waiting: int | None = None

    def merged(self, override: Faults) -> Faults:
        """These faults with every knob set in ``override`` replacing ours."""
        changes = {f.name: getattr(override, f.name) for f in fields(override)}
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        """The knobs that are set, for ``GET /admin/faults``."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = int(value) if isinstance(value, bool) else value
        return out

    def to_spec(self) -> str:
        """The ``key=value;...`` form of these faults."""
        return ";".join(f"{k}={_fmt(v)}" for k, v in self.to_dict().items())

    def any_stream_fault(self) -> bool:
        """Whether a token-position fault (stall, drop, malformed, error, an early end...) is set."""
        return any(getattr(self, name) is not None for name in _COUNT_KNOBS)

    def __bool__(self) -> bool:
        return bool(self.to_dict())


NO_FAULTS = Faults()
KNOBS: tuple[str, ...] = tuple(f.name for f in fields(Faults))


def _fmt(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _coerce(key: str, value: Any) -> Any:
    """One knob's value, checked; raises ValueError with a message naming the knob."""
    if key not in KNOBS:
        raise ValueError(f"unknown fault knob {key!r}; known knobs: {', '.join(KNOBS)}")
    if isinstance(value, bool):
        value = int(value)
    text = str(value).strip()
    try:
        if key in ("first_token_delay_ms", "health_delay_ms"):
            number: float = float(text)
            if not number >= 0 or number == float("inf"):
                raise ValueError
            return number
        if key == "kv_usage":
            number = float(text)
            if not 0 <= number <= 1:
                raise ValueError
            return number
        number = int(text)
    except ValueError:
        ms = "a number of milliseconds >= 0"
        kind = {"first_token_delay_ms": ms, "health_delay_ms": ms, "kv_usage": "a fraction 0..1"}.get(
            key, "an integer"
        )
        raise ValueError(f"fault knob {key!r} needs {kind}, got {value!r}") from None
    if (key in _COUNT_KNOBS or key == "waiting") and number < 0:
        raise ValueError(f"fault knob {key!r} needs a token count >= 0, got {number}")
    if key == "status" and not 400 <= number <= 599:
        raise ValueError(f"fault knob 'status' needs an HTTP error status 400..599, got {number}")
    if key in _FLAG_KNOBS:
        if number not in (0, 1):
            raise ValueError(f"fault knob {key!r} is 0 or 1, got {number}")
        return bool(number)
    return number


def parse_faults(spec: str) -> Faults:
    """Parse ``key=value;key=value`` (blank or ``none`` means no faults); ValueError if malformed."""
    values: dict[str, Any] = {}
    text = spec.strip()
    if text.lower() in ("", "none"):
        return NO_FAULTS
    for part in text.split(";"):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"fault {part!r} is not key=value (syntax: key=value;key=value)")
        values[key.strip()] = _coerce(key.strip(), value)
    return Faults(**values)


def faults_from_json(data: Any) -> Faults:
    """Faults from a JSON object of knobs, or ``{"spec": "key=value;..."}``; ValueError if bad."""
    if isinstance(data, str):
        return parse_faults(data)
    if not isinstance(data, dict):
        raise ValueError('faults must be a JSON object of knobs, e.g. {"drop_after": 3}')
    if set(data) == {"spec"} and isinstance(data["spec"], str):
        return parse_faults(data["spec"])
    values = {}
    for key, value in data.items():
        if value is None:
            continue
        values[key] = _coerce(key, value)
    return Faults(**values)
