"""A canary route for system tests: a stable and a canary pod simulator and the gateway config that
splits ``llama-8b`` between them, so each test states only what it varies."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from loadtest.podsim.launch import PodsimProcess

FAST = ["--ttft-ms", "5", "--itl-ms", "2"]


@contextmanager
def canary_pods(canary_ttft_ms: int = 5) -> Iterator[tuple[PodsimProcess, PodsimProcess]]:
    """A stable pod and a canary pod of ``llama-8b``; the canary as slow to its first token as asked."""
    canary = ["--ttft-ms", str(canary_ttft_ms), "--itl-ms", "2"]
    with PodsimProcess(["--model", "llama-8b", *FAST]) as stable, \
            PodsimProcess(["--model", "llama-8b", *canary]) as new:  # fmt: skip
        yield stable, new


def canary_config(
    stable_url: str,
    canary_url: str,
    rollout: dict[str, Any] | None = None,
    weights: tuple[int, int] = (50, 50),
    **extra: Any,
) -> dict[str, Any]:
    """The gateway config: both pods labelled by variant, ``llama-8b`` split by ``weights`` with
    sticky cohorts by ``user``, the ``rollout`` plan when given, and ``extra`` top-level keys."""
    route: dict[str, Any] = {"sticky": "user", "variants": {
        "stable": {"pods": {"variant": "stable"}, "weight": weights[0]},
        "canary": {"pods": {"variant": "canary"}, "weight": weights[1]},
    }}  # fmt: skip
    if rollout is not None:
        route["rollout"] = rollout
    return {
        "server": {"host": "127.0.0.1", "access_log": False},
        "pods": [
            {"name": "stable-1", "url": stable_url, "models": ["llama-8b"], "labels": {"variant": "stable"}},
            {"name": "canary-1", "url": canary_url, "models": ["llama-8b"], "labels": {"variant": "canary"}},
        ],
        "routes": {"llama-8b": route},
        **extra,
    }
