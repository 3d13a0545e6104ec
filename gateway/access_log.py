"""The access log's writer: one line per request, the lines of one event-loop turn in one write.

Through ``logging``, every request's line was a ``LogRecord``, a pass through the handler chain and
a flush of stderr of its own: ~7 % of a request's CPU with the access log on (cProfile, one stream
of short requests). Here a line is formatted once and queued; the first line of a loop turn
schedules the write for the end of that turn, so a burst of requests ending together is one write,
and no line waits longer than the turn it was made in (nginx's ``access_log ... buffer=``, without
its ``flush=`` delay). The lines are laid out by the same format as the other log lines (given to
``configure``), with the same time text (``LogTime``), and still follow the log level: under
``--log-level warning`` there are none.

Until ``configure`` is called (the gateway embedded, or in a test's own process) lines go through
``logging`` as any other record would.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import sys
import time

NAME = "sluicegate.access"
_logger = logging.getLogger(NAME)


class LogTime:
    """A log line's time, as ``logging`` writes it ("2026-11-24 08:13:04,319"), with the seconds'
    text made once a second, not once per line: ``time.localtime`` and ``strftime`` for each
    access-log line were ~3 % of the event loop's busy time with one stream of short requests."""

    def __init__(self) -> None:
        self._second = -1
        self._text = ""

    def __call__(self, created: float) -> str:
        second = int(created)
        if second != self._second:
            self._text = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second))
            self._second = second
        return f"{self._text},{int((created - second) * 1000):03d}"


class AccessLog:
    """Queues access-log lines and writes each loop turn's together (see module doc)."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._time = LogTime()
        self._layout: tuple[str, str, str] | None = None  # around the time and the message; None: logging

    def configure(self, fmt: str) -> None:
        """Write lines directly to stderr from now on, laid out by ``fmt``: the log's format, with
        ``%(asctime)s``, ``%(levelname)s``, ``%(name)s`` and ``%(message)s``."""
        marked = fmt % {"asctime": "\0", "levelname": "INFO", "name": NAME, "message": "\0"}
        before, between, after = marked.split("\0")
        self._layout = (before, between, after + "\n")
        atexit.register(self.flush)  # the last turn's lines, when the loop stops before writing them

    def write(self, message: str) -> None:
        """One request's line (without time, level and name: those are added here)."""
        layout = self._layout
        if layout is None:
            _logger.info("%s", message)
            return
        if not _logger.isEnabledFor(logging.INFO):
            return
        lines = self._lines
        if not lines:
            asyncio.get_running_loop().call_soon(self.flush)
        before, between, after = layout
        lines.append(f"{before}{self._time(time.time())}{between}{message}{after}")

    def flush(self) -> None:
        """Write the queued lines now (the loop does it at the end of each turn that made some)."""
        lines, self._lines = self._lines, []
        if lines:
            stream = sys.stderr
            try:
                stream.write("".join(lines))
                stream.flush()
            except (OSError, ValueError):  # stderr closed or gone: as logging, never fail a request
                pass


ACCESS = AccessLog()
