"""Process limits for many concurrent streams."""

from __future__ import annotations

import resource


def raise_open_file_limit() -> tuple[int, int]:
    """Lift the soft open-files limit to the hard one and return (soft, hard).

    Each relayed stream holds two sockets (client and pod); thousands of streams pass the usual
    soft limit of 1024 long before the hard limit.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)
