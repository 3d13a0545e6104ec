"""Server-Sent Events as the client reads them: every event, named, however the reads split it.

Not transports/sse.py, which only peeks at complete events in the relay's buffer (see ``SSEDecoder``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SSEvent:
    """One dispatched Server-Sent Event: its ``event`` name (default "message") and joined data."""

    event: str
    data: str


class SSEDecoder:
    """Incremental SSE parser (WHATWG rules: LF, CR or CRLF line ends; ``data`` lines joined).

    transports/sse.py looks at complete events in a relay buffer (offsets, first-token test) and
    ignores ``event:`` names; a client needs every event, split across reads, with its name.
    """

    def __init__(self) -> None:
        self._buf = b""
        self._event = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[SSEvent]:
        """Events completed by ``chunk``."""
        buf = self._buf + chunk
        out: list[SSEvent] = []
        pos = 0
        n = len(buf)
        while pos < n:
            lf = buf.find(b"\n", pos)
            cr = buf.find(b"\r", pos)
            if cr != -1 and (lf == -1 or cr < lf):
                if cr == n - 1:
                    break  # a CR at the end may be half of a CRLF: wait for the next byte
                end, nxt = cr, cr + (2 if buf[cr + 1 : cr + 2] == b"\n" else 1)
            elif lf != -1:
                end, nxt = lf, lf + 1
            else:
                break
            self._line(buf[pos:end], out)
            pos = nxt
        self._buf = buf[pos:]
        return out

    def _line(self, line: bytes, out: list[SSEvent]) -> None:
        if not line:
            if self._data:
                out.append(SSEvent(self._event or "message", "\n".join(self._data)))
            self._event = ""
            self._data = []
            return
        if line.startswith(b":"):
            return
        name, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        if name == b"data":
            self._data.append(value.decode("utf-8", "replace"))
        elif name == b"event":
            self._event = value.decode("utf-8", "replace")
