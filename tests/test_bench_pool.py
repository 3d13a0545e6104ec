"""``make bench`` gives the gateway the upstream pool nginx has, so both reuse the warm-up's connections.

The bench warms every proxy with one request per stream at once, so that the measured load finds a
pod connection for each stream already open. nginx keeps 4096 idle (``keepalive``); the gateway,
left at its default of 512 a pod, closed the rest after the warm-up and opened them again under the
load: 1488 connects a run in scenario d that nginx did not make.
"""

from __future__ import annotations

from pathlib import Path

from gateway.config import UpstreamConfig
from loadtest.bench import Scenario, auth_headers, gateway_config, run_loadgen, start_gateway, start_pod
from tests.test_podsim import metric_value

DEFAULT_IDLE = UpstreamConfig().max_idle_per_pod  # 512
STREAMS = 600  # more than that


def _pod_connections(admin_url: str) -> float:
    return metric_value(admin_url, "sluicegate_upstream_connections", "sluicegate_upstream_connections")


def test_the_gateway_keeps_a_pod_connection_for_every_warm_up_stream(tmp_path: Path) -> None:
    # streams of half a second: all of them under way at once, each on a pod connection of its own
    scenario = Scenario("pool", "burst", STREAMS, 1, 10, itl_ms=50.0)
    pod = start_pod(scenario, pin=False)  # started, as the bench starts them; stopped below
    try:
        config, key = gateway_config(pod.url, tmp_path / "keys.yaml")
        gateway = start_gateway(pod.url, False, config)
        try:
            summary = run_loadgen(gateway.url + "/v1/chat/completions", scenario, False,
                                  headers=auth_headers(key))
            assert summary["ok"] == STREAMS, summary
            # The burst's connections went back to the pool, not culled to the default: the next
            # load reuses them. (Not exactly STREAMS: a stream may start on one another has just left.)
            assert _pod_connections(gateway.admin_url) > DEFAULT_IDLE
        finally:
            gateway.__exit__(None, None, None)
    finally:
        pod.stop()
        pod.close()
