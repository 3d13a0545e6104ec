"""``sluicegate serve --workers N``: one supervisor process and N worker processes on one host.

The supervisor owns what is measured once per host (discovery, probes, scrapes, device health, the
breakers' verdicts) and the admin listener; each worker binds every public listener with
``SO_REUSEPORT`` and serves requests from a registry fed by the supervisor's snapshots
(``gateway.workers.feed``). What every replica must agree on (quotas, leases, the canary's step)
goes through Redis, as between replicas. See docs/operations.md.
"""

from __future__ import annotations

import os

READY_LINE = "sluicegate worker ready"  # a worker prints it once every listener is up


def worker_count(value: int) -> int:
    """``--workers``/``server.workers`` as a process count: 0 means one per CPU core."""
    return value if value > 0 else (os.cpu_count() or 1)
