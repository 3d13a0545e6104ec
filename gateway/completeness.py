"""Was a relayed stream whole? The relay's end-of-stream verdict, kept off the per-token path.

A pod (or anything that speaks for it) can end a stream cleanly, at the HTTP level, long before
the answer was: a terminated chunked body after two tokens, a finish-less last chunk, a line of
garbage. An SDK reading such a stream sees a short answer and no error. The relay therefore
judges every stream once, at its end, from the last two pod reads it already keeps (see
``transports.sse.stream_incomplete``); per token it only splices bytes. Requests with ``n > 1``,
whose choices finish at different times, also note finish reasons as they pass, by a substring
test on each read (the JSON is parsed only for the few reads that carry one). A Responses API
stream has no ``[DONE]``: it is whole when its last event is ``response.completed`` (or the
terminal ``response.failed``/``response.incomplete``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transports import sse
from transports.pod_client import PodResponse

_MARK, _SPACED = sse.FINISH_MARKS


def choices_of(payload: dict[str, Any]) -> int:
    """How many choices the request asked for (``n``), each of which must finish."""
    n = payload.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


class FinishWatch:
    """The choice indices given a ``finish_reason`` so far (only for ``n > 1``)."""

    __slots__ = ("finished",)

    def __init__(self) -> None:
        self.finished: set[int] = set()

    def feed(self, body: bytes) -> None:
        if body.find(_MARK) != -1 or body.find(_SPACED) != -1:
            self.finished |= sse.finished_choices(body)

    def wrap(self, sink: Callable[[bytes], None]) -> Callable[[bytes], None]:
        return _WatchedSink(self, sink)


class _WatchedSink:
    """``FinishWatch.wrap``'s sink. A class, not a closure: compiled, a closure's variables live in
    an object that holds the closure itself, a cycle only the garbage collector frees."""

    __slots__ = ("sink", "watch")

    def __init__(self, watch: FinishWatch, sink: Callable[[bytes], None]) -> None:
        self.watch = watch
        self.sink = sink

    def __call__(self, body: bytes) -> None:
        self.watch.feed(body)
        self.sink(body)


def incomplete(
    resp: PodResponse, choices: int, watch: FinishWatch | None, route: str = "chat"
) -> str | None:
    """Why ``resp``'s stream was not a whole answer, or None when it was.

    ``route`` picks the stream's grammar: chat and completions end with ``[DONE]`` or a finish
    reason per choice; the Responses API ends with a terminal event (``response.completed``)."""
    if route == "responses":
        return sse.responses_incomplete(resp.previous + resp.last)
    finished = watch.finished if watch is not None else frozenset()
    return sse.stream_incomplete(resp.previous + resp.last, choices, finished)
