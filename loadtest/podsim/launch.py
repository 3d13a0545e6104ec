"""The pod simulator as a real child process (tests, the demo, benchmarks)."""

from __future__ import annotations

from loadtest.announced import AnnouncedServer, StartError
from loadtest.podsim.server import READY_PREFIX


class PodsimStartError(StartError):
    """The simulator exited or stayed silent instead of announcing its address."""


class PodsimProcess(AnnouncedServer):
    """``python -m loadtest.podsim ARGS`` (see :class:`AnnouncedServer`)."""

    module = "loadtest.podsim"
    ready_prefix = READY_PREFIX
    start_error = PodsimStartError
