"""Shadow traffic through a real gateway: copies of stable's requests go to the canary, and no client
ever waits for one, sees one, pays for one, or leaves one running behind it.

The canary serves ``llama-8b-next`` (podsim's words depend on the model name), so an answer that
came from the canary instead of stable would differ, and a pod's own metrics (``/metrics`` of the
simulator) show what the copies did there: running, finished, aborted.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import ConfigError
from gateway.config_load import parse_config
from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from tests.conftest import counter_totals, pod_arrivals, wait_for
from tests.keys import auth_on, key_store

CANARY_TTFT_MS = 3000  # a copy's answer starts this late: far later than any client's stream ends


@dataclass
class Shadowed:
    gateway: GatewayProcess
    stable: PodsimProcess
    canary: PodsimProcess


def route(shadow: dict[str, Any], rollout: dict[str, Any] | None = None, canary_weight: float = 0) -> dict:
    """``llama-8b``: stable takes every caller (unless ``canary_weight``), the canary its copies."""
    config: dict[str, Any] = {
        "sticky": "user",
        "variants": {
            "stable": {"pods": {"variant": "stable"}, "weight": 100 - canary_weight},
            "canary": {"pods": {"variant": "canary"}, "model": "llama-8b-next", "weight": canary_weight},
        },
        "shadow": shadow,
    }
    if rollout is not None:
        config["rollout"] = rollout
    return config


def gateway_config(stable: PodsimProcess, canary: PodsimProcess, route: dict, **extra: Any) -> dict:
    return {
        "server": {"host": "127.0.0.1", "access_log": False},
        "pods": [
            {"name": "stable-1", "url": stable.url, "models": ["llama-8b"], "labels": {"variant": "stable"}},
            {
                "name": "canary-1",
                "url": canary.url,
                "models": ["llama-8b-next"],
                "labels": {"variant": "canary"},
            },
        ],
        "routes": {"llama-8b": route},
        **extra,
    }


@pytest.fixture(scope="module")
def slow_canary() -> Iterator[Shadowed]:
    """Every request copied to a canary that takes CANARY_TTFT_MS to its first token."""
    slow = ["--ttft-ms", str(CANARY_TTFT_MS), "--itl-ms", "2"]
    with PodsimProcess(["--model", "llama-8b", "--ttft-ms", "5", "--itl-ms", "5"]) as stable, \
            PodsimProcess(["--model", "llama-8b-next", *slow]) as canary, \
            GatewayProcess(gateway_config(stable, canary, route({"percent": 100}))) as gw:  # fmt: skip
        yield Shadowed(gw, stable, canary)


def body(max_tokens: int = 16, stream: bool = True, user: str = "alice") -> dict[str, Any]:
    return {
        "model": "llama-8b", "messages": [{"role": "user", "content": "say something"}],
        "max_tokens": max_tokens, "stream": stream, "user": user,
    }  # fmt: skip


def stream_text(url: str, payload: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[str, str]:
    """The streamed answer's text and the pod the gateway named (``-`` straight from a pod)."""
    text: list[str] = []
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json=payload, headers=headers, timeout=60
    ) as resp:
        assert resp.status_code == 200, resp.read()
        done = False
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                assert chunk["model"] == payload["model"]
                for choice in chunk["choices"]:
                    text.append(choice["delta"].get("content") or "")
        assert done
        return "".join(text), resp.headers.get("x-sluicegate-pod", "-")


def shadows(gw: GatewayProcess, **where: str) -> dict[str, float]:
    return counter_totals(gw.admin_url, "sluicegate_shadow_requests", "outcome", **where)


def pod_metric(pod: PodsimProcess, family: str) -> float:
    """A simulator's gauge or counter, summed over its labels (a counter: its ``_total`` samples)."""
    for fam in text_string_to_metric_families(httpx.get(pod.url + "/metrics").text):
        if fam.name == family:
            return sum(s.value for s in fam.samples if s.name in (family, family + "_total"))
    return 0.0


def pod_busy(pod: PodsimProcess) -> float:
    return pod_metric(pod, "vllm:num_requests_running") + pod_metric(pod, "vllm:num_requests_waiting")


def test_clients_never_wait_for_their_shadow(slow_canary: Shadowed) -> None:
    gw, canary = slow_canary.gateway, slow_canary.canary
    before = shadows(gw).get("ok", 0.0)
    arrived = pod_arrivals(canary.url)
    n = 6
    with ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(lambda i: stream_text(gw.url, body(user=f"u{i}")), range(n)))
    # Every client's stream is whole, from stable, while every copy is still waiting at the canary
    # for a first token it gets only CANARY_TTFT_MS after it was sent.
    assert {pod for _, pod in answers} == {"stable-1"}
    assert shadows(gw).get("ok", 0.0) == before
    assert wait_for(lambda: pod_arrivals(canary.url) == arrived + n, 10)  # every copy reached the canary
    # ... and then each copy ends by itself, answered and discarded, with its own metrics
    assert wait_for(lambda: shadows(gw).get("ok", 0.0) == before + n, 30), shadows(gw)
    assert pod_busy(canary) == 0
    assert observed_above(gw, "sluicegate_shadow_time_to_first_token_seconds", "2.5") == n
    assert observed_above(gw, "sluicegate_shadow_duration_seconds", "2.5") == n
    # the clients' own first tokens, from stable, were far earlier
    assert observed_above(gw, "sluicegate_variant_time_to_first_token_seconds", "1.0") == 0


def observed_above(gw: GatewayProcess, family: str, bound: str) -> float:
    """How many observations of a histogram were above its bucket bound ``bound`` (e.g. "2.5")."""
    total = at_bound = 0.0
    for fam in text_string_to_metric_families(httpx.get(gw.admin_url + "/metrics").text):
        if fam.name == family:
            for sample in fam.samples:
                if sample.name.endswith("_bucket"):
                    if sample.labels["le"] == "+Inf":
                        total += sample.value
                    elif float(sample.labels["le"]) == float(bound):
                        at_bound += sample.value
    return total - at_bound


def test_the_client_gets_stables_answer_only(slow_canary: Shadowed) -> None:
    gw = slow_canary.gateway
    through_gateway, pod = stream_text(gw.url, body(max_tokens=12))
    from_stable, _ = stream_text(slow_canary.stable.url, body(max_tokens=12))
    from_canary, _ = stream_text(slow_canary.canary.url, {**body(max_tokens=12), "model": "llama-8b-next"})
    assert pod == "stable-1"
    assert through_gateway == from_stable
    assert from_canary != from_stable  # a canary's answer would have shown
    whole = httpx.post(gw.url + "/v1/chat/completions", json=body(max_tokens=12, stream=False), timeout=60)
    assert whole.status_code == 200
    assert whole.json()["model"] == "llama-8b"
    assert whole.json()["choices"][0]["message"]["content"] == from_stable


def test_a_client_that_leaves_takes_its_shadow_with_it(slow_canary: Shadowed) -> None:
    gw, canary = slow_canary.gateway, slow_canary.canary
    assert wait_for(lambda: pod_busy(canary) == 0, 30)  # copies of the other tests are over
    aborts = pod_metric(canary, "podsim:aborts")
    gone = shadows(gw).get("client_gone", 0.0)
    # a long stream (1000 tokens at 5 ms): the client leaves after its first content, mid-stream
    with httpx.stream(
        "POST", gw.url + "/v1/chat/completions", json=body(max_tokens=1000), timeout=60
    ) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert next(line for line in lines if '"content"' in line)
        # its copy has reached the canary (it waits there for its first token) when the client goes
        assert wait_for(lambda: pod_busy(canary) == 1, 10)
    # the canary sees the copy's connection close, and the copy is counted as gone with its client
    assert wait_for(lambda: pod_metric(canary, "podsim:aborts") == aborts + 1, 10)
    assert wait_for(lambda: shadows(gw).get("client_gone", 0.0) == gone + 1, 10)
    assert pod_busy(canary) == 0


@pytest.fixture(scope="module")
def fast_pods() -> Iterator[tuple[PodsimProcess, PodsimProcess]]:
    fast = ["--ttft-ms", "1", "--itl-ms", "1"]
    with PodsimProcess(["--model", "llama-8b", *fast]) as stable, \
            PodsimProcess(["--model", "llama-8b-next", *fast]) as canary:  # fmt: skip
        yield stable, canary


def test_the_shadow_share_holds(fast_pods: tuple[PodsimProcess, PodsimProcess]) -> None:
    stable, canary = fast_pods
    share, n = 0.3, 400
    with GatewayProcess(gateway_config(stable, canary, route({"percent": share * 100}))) as gw, \
            httpx.Client(timeout=30) as client:  # fmt: skip
        for i in range(n):
            resp = client.post(
                gw.url + "/v1/chat/completions", json=body(max_tokens=1, stream=False, user=str(i))
            )
            assert resp.status_code == 200 and resp.headers["x-sluicegate-pod"] == "stable-1"

        def settled() -> bool:  # every copy ended, and each one the canary finished was counted ok
            return pod_busy(canary) == 0 and shadows(gw).get("ok", 0.0) == pod_metric(
                canary, "vllm:request_success"
            )

        assert wait_for(settled, 30)
        counted = shadows(gw)
        copies = sum(counted.values())
        assert counted.get("ok", 0.0) == copies, counted  # none skipped, none failed
        sigma = math.sqrt(n * share * (1 - share))
        assert abs(copies - n * share) < 4 * sigma, copies


def test_shadows_cost_no_quota_and_are_not_judged(
    fast_pods: tuple[PodsimProcess, PodsimProcess], tmp_path: Path
) -> None:
    stable, canary = fast_pods
    store = tmp_path / "keys.yaml"
    keys = key_store(
        store, {"id": "app", "quota": {"requests_per_minute": 4}}, {"id": "ops", "rights": ["admin"]}
    )
    rollout = {"steps": [1, 50], "min_hold_s": 3600}
    config = gateway_config(stable, canary, route({"percent": 100}, rollout), auth=auth_on(store))
    with GatewayProcess(config) as gw:
        before = pod_metric(canary, "vllm:request_success")
        auth = {"authorization": f"Bearer {keys['app']}"}
        served = []
        for i in range(4):  # the key's whole quota, each request copied to the canary
            _, pod = stream_text(gw.url, body(max_tokens=4, user=f"user-{i}"), headers=auth)
            served.append(pod)
        refused = httpx.post(gw.url + "/v1/chat/completions", json=body(), headers=auth, timeout=30)
        assert refused.status_code == 429  # the quota is real: the fifth request is over it
        on_stable = served.count("stable-1")
        assert on_stable >= 1  # at the first step 99 % of callers are stable's
        assert wait_for(lambda: shadows(gw).get("ok", 0.0) == on_stable, 30), shadows(gw)
        assert wait_for(lambda: pod_metric(canary, "vllm:request_success") - before >= on_stable, 10)
        # the judge saw what callers were served, not the copies
        status = httpx.get(
            gw.admin_url + "/admin/rollouts", headers={"authorization": f"Bearer {keys['ops']}"}
        )
        samples = status.json()["rollouts"][0]["samples"]
        assert sum(samples["stable"].values()) == on_stable
        assert sum(samples["canary"].values()) == len(served) - on_stable


def test_a_shadow_needs_another_variant_to_copy_from() -> None:
    stable = {"stable": {"weight": 1}}
    both = {**stable, "canary": {"pods": {"v": "c"}}}
    for shadow, variants in (({"variant": "nope"}, both), ({"variant": "stable"}, stable)):
        with pytest.raises(ConfigError) as info:
            parse_config({"routes": {"m": {"variants": variants, "shadow": shadow}}})
        assert f"shadow.variant {shadow['variant']!r} must be one of this route's variants" in str(info.value)
    with pytest.raises(ConfigError, match="percent"):
        parse_config({"routes": {"m": {"variants": both, "shadow": {"percent": 101}}}})
