"""Event-loop lag: how late a periodic timer fires in the gateway's loop, as a histogram.

Every stream the gateway relays shares one event loop, so when the loop is busy every token waits;
the lag of a timer is the most direct measure of that wait, and the scale benchmark reads its p99
(``sluicegate_event_loop_lag_seconds``). One timer every 50 ms costs nothing measurable.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Histogram

PERIOD_S = 0.05
BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class LoopLag:
    """A 50-ms timer whose lateness is observed into a histogram while ``run`` is awaited."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.histogram = Histogram(
            "sluicegate_event_loop_lag_seconds",
            "How late a 50-ms timer fires in the gateway's event loop (time every stream waits behind "
            "other work).",
            buckets=BUCKETS,
            registry=registry,
        )

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        observe = self.histogram.observe
        while True:
            due = loop.time() + PERIOD_S
            await asyncio.sleep(PERIOD_S)
            observe(max(0.0, loop.time() - due))
