"""The request path's metric children (``GatewayMetrics.child``) write prometheus_client's values
directly: what a scrape then shows must be exactly what prometheus_client's own children give for
the same updates (this also pins the internals they rely on, should an upgrade change them)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.metrics import GatewayMetrics, fast_child


def _exposition(metrics: GatewayMetrics) -> list[str]:
    """The gateway's own series, without the creation and reload timestamps (they differ by run)."""
    return sorted(
        line
        for line in metrics.render().decode().splitlines()
        if line.startswith("sluicegate_") and "_created" not in line and "timestamp" not in line
    )


values = st.one_of(
    st.floats(min_value=0, max_value=200, allow_nan=False),
    st.sampled_from([0.0, 0.001, 0.0025, 0.1, 1.0, 2.0, 120.0, 1e9, math.inf, math.nan]),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["counter", "gauge+", "gauge-", "gauge=", "histogram"]), values)))
def test_fast_children_show_what_prometheus_client_children_show(ops: list[tuple[str, float]]) -> None:
    fast, reference = GatewayMetrics(), GatewayMetrics()
    for metrics, child in ((fast, fast.child), (reference, lambda metric, *labels: metric.labels(*labels))):
        for op, value in ops:
            if op == "counter" and not math.isnan(value):
                child(metrics.requests, "chat", "m", "200", "h1").inc(value)
            elif op == "gauge+":
                child(metrics.in_flight, "pod-a").inc(value)
            elif op == "gauge-":
                child(metrics.in_flight, "pod-a").dec(value)
            elif op == "gauge=":
                child(metrics.in_flight, "pod-b").set(value)
            elif op == "histogram":
                child(metrics.request_duration, "chat", "m").observe(value)
                child(metrics.time_per_output_token, "m", "none", "h1").observe(value)
    assert _exposition(fast) == _exposition(reference)


def test_the_request_path_gets_fast_children_and_counters_still_refuse_to_go_down() -> None:
    metrics = GatewayMetrics()
    counter = metrics.child(metrics.requests, "chat", "m", "200", "h1")
    assert counter is metrics.child(metrics.requests, "chat", "m", "200", "h1")  # resolved once
    assert type(counter).__name__ == "_FastCounter"
    assert type(metrics.child(metrics.request_duration, "chat", "m")).__name__ == "_FastHistogram"
    assert type(metrics.child(metrics.in_flight, "pod-a")).__name__ == "_FastGauge"
    with pytest.raises(ValueError):
        counter.inc(-1)


def test_a_child_of_a_kind_it_does_not_know_is_left_as_it_is() -> None:
    class Other:
        _value = 0.0

    other = Other()
    assert fast_child(other) is other
