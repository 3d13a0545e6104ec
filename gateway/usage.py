"""Usage accounting: how many tokens a stream really cost, for token quotas and the token metrics.

A token quota reserves at admission and settles when the answer ends, from the pod's own ``usage``.
vLLM reports usage on a stream only when asked (``stream_options.include_usage``), so the gateway
asks on the client's behalf (``ask_for_usage``) and takes the usage event out of what that client
sees (``UsageTap``): its bytes are then exactly what vLLM would have sent it without the option.
The usage event is vLLM's last one before ``data: [DONE]`` (``"choices":[]`` and ``usage``; token
chunks carry no usage key), so finding it costs one ``bytes.find`` per pod read, and only streams
under a quota pay even that. A client that leaves early is charged for the content events it got
(``tokens_relayed``), counted with ``bytes.count`` per read: no JSON per token; a stream that may be
resumed skips that count, since its recorder keeps what was sent, and is counted from it once, only
when no usage arrives.

Streams under no quota get no tap and cost nothing more per read: their tokens relayed are the
content events of the head plus the pod reads after it (the pod connection counts those anyway; a
paced vLLM stream writes one event per token, one read each), or, for a stream that may be resumed,
the content events of what the recorder already keeps, counted once per pod. When the pod's usage
never arrives (the client left, a timeout, a broken stream, usage not asked for), the finish phase
takes those and the prompt's estimate as the request's usage (``relayed_usage``), so the token
metrics and the access log count every ending. Reads that hold several events (a gateway behind
on a fast pod) make that figure low; the pod's own usage, whenever it arrives, is exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.admit import InferenceRequest, encode_body
from gateway.exchange import Exchange
from gateway.metrics import GatewayMetrics
from transports import json_bytes, sse
from transports.pod_client import PodResponse
from transports.sse import USAGE_MARK

_NOT_USAGE = b'"choices":[{'  # an event with a choice in it is a token chunk
_ROLE_ONLY = b'"delta":{"role":"assistant","content":""}'  # chat's opening chunk: no token
_DONE = b"data: [DONE]"
_EVENT = b"data: "


def content_events(data: bytes | bytearray) -> int:
    """The token events in ``data``: events less ``[DONE]``, usage, chat's role-only and error events
    (vLLM's and podsim's compact JSON), by byte counts, no JSON."""
    return max(
        0,
        data.count(_EVENT) - data.count(_DONE) - data.count(USAGE_MARK) - data.count(_ROLE_ONLY)
        - data.count(sse.ERROR_EVENT),
    )  # fmt: skip


def trailing_reads(resp: PodResponse) -> int:
    """How many of a pod answer's last reads (at most two: usage, ``[DONE]``) hold no token."""
    if not resp.last or content_events(resp.last):
        return 0
    return 1 if not resp.previous or content_events(resp.previous) else 2


def relayed_usage(ex: Exchange, metrics: GatewayMetrics) -> None:
    """A stream that relayed tokens but got no usage from its pods: ``ex.usage`` becomes the prompt's
    estimate and the content events relayed, counted in the token metrics as the pods' would be."""
    req = ex.req
    if ex.usage is not None or ex.ttft is None or req is None or not req.stream or ex.degraded is not None:
        return
    ex.usage = (ex.prompt_estimate, ex.tokens_relayed)
    for kind, value in zip(("prompt", "completion"), ex.usage, strict=True):
        if value:
            metrics.child(metrics.tokens, ex.model_label, kind).inc(value)


_ASK_USAGE = b'{"stream_options":{"include_usage":true},'


def ask_for_usage(req: InferenceRequest) -> tuple[InferenceRequest, bool]:
    """The request as the pod should get it so that it reports usage, and whether the usage must be
    stripped from the client's answer (it did not ask for it).

    Only streaming requests need asking: a whole answer always carries usage. A ``stream_options``
    that is not an object, or an ``include_usage`` that is not a boolean, is left for the pod to
    judge (vLLM refuses or coerces it; either way it is the client's own choice).
    """
    if not req.stream:
        return req, False
    options = req.payload.get("stream_options")
    if options is not None and not isinstance(options, dict):
        return req, False
    options = dict(options or {})
    asked = options.get("include_usage")
    if asked is True or (asked is not None and asked is not False):
        return req, False
    options["include_usage"] = True
    # vLLM honours continuous_usage_stats only with include_usage: left in, every chunk would grow a
    # usage key the client never saw before; without include_usage it meant nothing, so drop it.
    options.pop("continuous_usage_stats", None)
    payload = {**req.payload, "stream_options": options}
    body = req.body
    if "stream_options" not in req.payload and body[:1] == b"{" and body[1:2] not in (b"\x00", b"}"):
        # The common case, no stream_options at all: the key goes in front of the client's own bytes
        # rather than the whole body being encoded again (~25 µs a request for a short chat).
        body = _ASK_USAGE + body[1:]
    else:
        body = encode_body(payload)
    return InferenceRequest(req.route, req.model, req.stream, body, payload), True


def wants_usage(payload: dict[str, Any]) -> bool:
    """Whether a streaming request's pod will end its stream with a usage event."""
    options = payload.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


def tokens_of(usage: Any) -> tuple[int, int] | None:
    """``(prompt, completion)`` from a usage object, or None when it is not one a counter can take."""
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if type(prompt) is not int or type(completion) is not int:
        return None
    return (prompt, completion) if 0 <= prompt < 1 << 53 and 0 <= completion < 1 << 53 else None


def whole_answer_usage(ex: Exchange, answer: dict[str, Any]) -> dict[str, Any] | None:
    """Record a whole (non-streaming) answer's usage on the exchange; returns the usage object."""
    usage = answer.get("usage")
    # the Responses API names them input_tokens / output_tokens
    ex.usage = tokens_of(sse.responses_usage(usage) if ex.route == "responses" else usage)
    return usage if isinstance(usage, dict) else None


class UsageTap:
    """Watches one stream's bytes on their way to the client: records the usage event, counts the
    content events passed on (``ex.tokens_relayed``) and, when the gateway asked for usage the
    client did not want, takes the usage event out.

    Installed only for streams under a quota (``metered``); everything else skips it entirely.
    """

    __slots__ = ("ex", "held", "strip", "usage")

    def __init__(self, ex: Exchange) -> None:
        self.ex = ex
        self.strip = ex.usage_injected
        self.held = b""  # the start of an event that may be the usage event, awaiting its end
        self.usage: dict[str, Any] | None = None

    @staticmethod
    def metered(ex: Exchange) -> bool:
        """Whether this stream's usage matters for a quota (and so is worth a tap)."""
        return ex.usage_injected or ex.admission is not None

    def head(self, body: bytes) -> bytes:
        """The stream's opening bytes: as ``feed``, but chat's role-only chunk is not a token."""
        out = self.feed(body)
        if out.find(_ROLE_ONLY) != -1:
            self.ex.tokens_relayed -= out.count(_ROLE_ONLY)
        return out

    def feed(self, body: bytes) -> bytes:
        """One pod read in; what the client gets of it out."""
        if self.held:
            body = self.held + body
            self.held = b""
        at = body.find(USAGE_MARK)
        if at != -1:
            body = self._take(body, at)
        if self.strip and body and not body.endswith(b"\n\n"):
            body = self._hold_partial(body)
        if body:
            self.ex.tokens_relayed += body.count(_EVENT)
        return body

    def end(self, tail: bytes) -> None:
        """The pod's answer is over (``tail``: its last reads): its ``[DONE]`` was no token."""
        if tail.find(_DONE) != -1:
            self.ex.tokens_relayed -= 1

    def flush(self) -> bytes:
        """What is still held when the pod's answer ends (a partial event: the client gets it as sent)."""
        held, self.held = self.held, b""
        return held

    def wrap(self, sink: Callable[[bytes], None], count: bool = True) -> Callable[[bytes], None]:
        """A splice sink that feeds every read through the tap first.

        It runs once per pod read of every stream under a quota, so the common read (whole events,
        no usage event, nothing held) costs one ``find``, one ``count`` and the write; only the others
        take ``feed``'s way (measured: ``docs/benchmarks.md``, "Admission: keys and quotas").
        ``count=False``: a stream whose recorder keeps what was sent skips the ``count``; its tokens
        relayed are counted from that record once, and only when no usage arrives (``stream_relay``).

        ``find``, never ``in``, on bytes in the per-read paths: Python 3.11's ``x in some_bytes``
        first tries ``x`` as an integer, so a bytes ``x`` raises, formats and clears a TypeError
        each time (this check: 240 ns with ``in``, 156 with ``find``, on a token's read)."""
        return _TappedSink(self, sink, count)

    def _take(self, body: bytes, at: int) -> bytes:
        """Record the usage event at ``at`` and, when stripping, cut it out of ``body``."""
        start = body.rfind(_EVENT, 0, at)
        end = body.find(b"\n\n", at)
        if start == -1:
            return body  # not an event we understand: pass it on untouched
        if end == -1:  # the event goes on in the next read: it is the stream's last but [DONE], so wait
            self.held = body[start:]
            return body[:start]
        try:
            usage = json_bytes.loads(body[start + len(_EVENT) : end]).get("usage")
        except (ValueError, AttributeError, RecursionError):
            usage = None
        if isinstance(usage, dict):
            self.usage = usage
        if self.strip:
            return body[:start] + body[end + 2 :]
        self.ex.tokens_relayed -= 1  # passed on, but not a token
        return body

    def _hold_partial(self, body: bytes) -> bytes:
        """Keep back a trailing partial event that could still turn out to be the usage event."""
        cut = body.rfind(b"\n\n")
        start = 0 if cut == -1 else cut + 2
        if body.find(_NOT_USAGE, start) != -1:
            return body
        self.held = body[start:] + self.held
        return body[:start]


class _TappedSink:
    """``UsageTap.wrap``'s sink (see there). A class, not a closure: compiled, a closure's variables
    live in an object that holds the closure itself, a cycle only the garbage collector frees, and
    with it the whole request."""

    __slots__ = ("count", "ex", "sink", "tap")

    def __init__(self, tap: UsageTap, sink: Callable[[bytes], None], count: bool) -> None:
        self.tap = tap
        self.ex = tap.ex
        self.sink = sink
        self.count = count

    def __call__(self, body: bytes) -> None:
        tap = self.tap
        if tap.held or body.find(USAGE_MARK) != -1 or body[-1] != 10:
            body = tap.feed(body)
            if body:
                self.sink(body)
            return
        if self.count:
            self.ex.tokens_relayed += body.count(_EVENT)
        self.sink(body)
