"""One ``/metrics`` for a host of workers: each worker's series once, with a ``worker`` label, and the
supervisor's host-level ones (pods, probes) as they are: only the supervisor measures pods, so a
worker's copies of those (fed from snapshots) would only repeat them."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

HOST_PREFIXES = ("sluicegate_pod_", "sluicegate_probe_", "sluicegate_worker")


def host_level(name: str) -> bool:
    return name.startswith(HOST_PREFIXES)


class _Merged:
    """A collector over families already gathered (prometheus_client renders them)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def merge(host: CollectorRegistry, workers: Iterable[tuple[int, str]]) -> bytes:
    """The supervisor's host-level families, then every other family of the workers' expositions
    (``(index, text)``), each family once with a ``worker`` label on its samples."""
    families: dict[str, Metric] = {}
    for family in host.collect():
        if host_level(family.name):
            families[family.name] = family
    for index, text in workers:
        label = str(index)
        for family in text_string_to_metric_families(text):
            if host_level(family.name):
                continue
            merged = families.get(family.name)
            if merged is None:
                merged = Metric(family.name, family.documentation, family.type, family.unit)
                families[family.name] = merged
            merged.samples.extend(
                Sample(s.name, {**s.labels, "worker": label}, s.value, s.timestamp, s.exemplar)
                for s in family.samples
            )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(list(families.values())))  # type: ignore[arg-type]
    return generate_latest(registry)
