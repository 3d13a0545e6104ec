"""The access log's writer: one line per request, the lines of one event-loop turn in one write.

Through ``logging``, every request's line was a ``LogRecord``, a pass through the handler chain and
a flush of stderr of its own: ~7 % of a request's CPU with the access log on (cProfile, one stream
of short requests). Here a line is formatted once and queued; the first line of a loop turn
schedules the write for the end of that turn, so a burst of requests ending together is one write,
and no line waits longer than the turn it was made in (nginx's ``access_log ... buffer=``, without
its ``flush=`` delay). The lines look exactly like the other log lines (``gateway.server``'s
format: time, level, logger name) and still follow the log level: under ``--log-level warning``
there are none.

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


class AccessLog:
    """Queues access-log lines and writes each loop turn's together (see module doc)."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._tag = ""  # "INFO sluicegate.access: " once configured; "" sends lines through logging
        self._second = -1
        self._time = ""

    def configure(self, process: str | None = None) -> None:
        """Write lines directly to stderr from now on, tagged like the other lines of ``process``."""
        name = NAME if process is None else f"{process} {NAME}"
        self._tag = f"INFO {name}: "
        atexit.register(self.flush)  # the last turn's lines, when the loop stops before writing them

    def write(self, message: str) -> None:
        """One request's line (without time, level and name: those are added here)."""
        if not self._tag:
            _logger.info("%s", message)
            return
        if not _logger.isEnabledFor(logging.INFO):
            return
        now = time.time()
        second = int(now)
        if second != self._second:
            self._time = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second))
            self._second = second
        lines = self._lines
        if not lines:
            asyncio.get_running_loop().call_soon(self.flush)
        lines.append(f"{self._time},{int((now - second) * 1000):03d} {self._tag}{message}\n")

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
