"""The pod registry: every pod's identity and live state, in one place.

Background loops (discovery now; health, pressure and breakers later) write it; the request path
only reads it to pick a pod and reports in-flight counts back. No other module keeps a pod list.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

from gateway.config import PodConfig


class Pod:
    """One pod: what it is (from config) and how it is doing now (mutated on the event loop)."""

    __slots__ = (
        "config",
        "host",
        "in_flight",
        "last_error",
        "last_probe",
        "models",
        "name",
        "port",
        "reachable",
        "tls",
        "url",
    )

    def __init__(self, config: PodConfig) -> None:
        self.config = config
        self.name = config.name
        self.url = config.url
        parts = urlsplit(config.url)
        self.host = parts.hostname or "127.0.0.1"
        self.tls = parts.scheme == "https"
        self.port = parts.port or (443 if self.tls else 80)
        self.models: frozenset[str] = frozenset(config.models)
        # Pods with configured models are routable until a probe says otherwise; pods whose
        # models must be discovered are not, until discovery has asked them.
        self.reachable = bool(config.models)
        self.in_flight = 0
        self.last_error: str | None = None
        self.last_probe: float | None = None

    @property
    def routable(self) -> bool:
        return self.reachable and bool(self.models)

    def snapshot(self) -> dict[str, Any]:
        mig = self.config.mig
        return {
            "name": self.name,
            "url": self.url,
            "models": sorted(self.models),
            "models_source": "config" if self.config.models else "discovered",
            "mig": mig.model_dump() if mig else None,
            "labels": dict(self.config.labels),
            "state": {
                "reachable": self.reachable,
                "routable": self.routable,
                "in_flight": self.in_flight,
                "last_error": self.last_error,
                "last_probe_age_s": None
                if self.last_probe is None
                else round(time.monotonic() - self.last_probe, 3),
            },
        }


class PodRegistry:
    """Holds the pods and answers "which pod should take this model's next request?"."""

    def __init__(self, pods: Iterable[PodConfig]) -> None:
        self.pods: tuple[Pod, ...] = tuple(Pod(p) for p in pods)
        self._by_model: dict[str, tuple[Pod, ...]] = {}
        self._tiebreak = itertools.count()
        self.reindex()

    def reindex(self) -> None:
        """Rebuild the model → pods index; call after any pod's models change."""
        index: dict[str, list[Pod]] = {}
        for pod in self.pods:
            for model in pod.models:
                index.setdefault(model, []).append(pod)
        self._by_model = {model: tuple(pods) for model, pods in index.items()}

    def knows(self, model: str) -> bool:
        return model in self._by_model

    def models(self) -> list[str]:
        """Every model some pod serves (reachable or not), sorted."""
        return sorted(self._by_model)

    def routable_models(self) -> list[str]:
        return sorted(m for m, pods in self._by_model.items() if any(p.routable for p in pods))

    def pick(self, model: str, exclude: tuple[Pod, ...] = ()) -> Pod | None:
        """The routable pod serving ``model`` with the fewest requests in flight.

        Ties rotate, so an idle fleet still spreads requests instead of piling onto the first pod.
        ``exclude`` holds pods this request already tried.
        """
        candidates = self._by_model.get(model)
        if not candidates:
            return None
        n = len(candidates)
        offset = next(self._tiebreak) % n
        best: Pod | None = None
        for i in range(n):
            pod = candidates[(offset + i) % n]
            if pod.reachable and pod not in exclude and (best is None or pod.in_flight < best.in_flight):
                best = pod
        return best

    def get(self, name: str) -> Pod | None:
        for pod in self.pods:
            if pod.name == name:
                return pod
        return None

    def ready(self) -> bool:
        return any(pod.routable for pod in self.pods)

    def snapshot(self) -> list[dict[str, Any]]:
        return [pod.snapshot() for pod in self.pods]
