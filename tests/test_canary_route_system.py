"""A canary route through a real gateway: weights hold, cohorts stick, overrides need the right.

Two simulated pods serve the same model, one labelled stable and one canary; the route splits the
public model 80/20 with sticky cohorts by the OpenAI ``user`` field. Which variant served a request
is the pod the gateway names in ``x-sluicegate-pod``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from tests.conftest import FAST, counter_totals
from tests.keys import auth_on, key_store

CANARY_SHARE = 0.2


@dataclass
class Canary:
    gateway: GatewayProcess
    keys: dict[str, str]


@pytest.fixture(scope="module")
def canary(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Canary]:
    store: Path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys = key_store(store, {"id": "app"}, {"id": "tester", "rights": ["variant_override"]})
    with PodsimProcess(["--model", "llama-8b", *FAST]) as stable, \
            PodsimProcess(["--model", "llama-8b", *FAST]) as new:  # fmt: skip
        config = {
            "server": {"host": "127.0.0.1", "access_log": False},
            "auth": auth_on(store),
            "pods": [
                {"name": "stable-1", "url": stable.url, "models": ["llama-8b"],
                 "labels": {"variant": "stable"}},
                {"name": "canary-1", "url": new.url, "models": ["llama-8b"],
                 "labels": {"variant": "canary"}},
            ],
            "routes": {"llama-8b": {"sticky": "user", "variants": {
                "stable": {"pods": {"variant": "stable"}, "weight": 80},
                "canary": {"pods": {"variant": "canary"}, "weight": 20},
            }}},
        }  # fmt: skip
        with GatewayProcess(config) as gw:
            yield Canary(gw, keys)


def served_by(canary: Canary, user: str | None, key: str = "app", **headers: str) -> str:
    body = {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    if user is not None:
        body["user"] = user
    resp = httpx.post(canary.gateway.url + "/v1/chat/completions", json=body, timeout=30,
                      headers={"authorization": f"Bearer {canary.keys[key]}", **headers})  # fmt: skip
    assert resp.status_code == 200, resp.text
    return resp.headers["x-sluicegate-pod"]


def test_the_split_holds_over_many_callers(canary: Canary) -> None:
    n = 600
    seen = Counter(served_by(canary, f"user-{i}") for i in range(n))
    assert set(seen) <= {"stable-1", "canary-1"}
    sigma = math.sqrt(n * CANARY_SHARE * (1 - CANARY_SHARE))
    assert abs(seen["canary-1"] - n * CANARY_SHARE) < 4 * sigma, seen
    by_variant = counter_totals(canary.gateway.admin_url, "sluicegate_variant_requests", "variant")
    assert by_variant.get("canary", 0) >= seen["canary-1"] and by_variant.get("stable", 0) >= seen["stable-1"]


def test_a_caller_keeps_its_variant(canary: Canary) -> None:
    for user in ("alice", "bob", "carol", "dave"):
        assert len({served_by(canary, user) for _ in range(10)}) == 1


def test_the_override_header_needs_the_right(canary: Canary) -> None:
    on_stable = next(u for u in (f"u{i}" for i in range(200)) if served_by(canary, u) == "stable-1")
    force = {"x-sluicegate-variant": "canary"}
    assert served_by(canary, on_stable, "tester", **force) == "canary-1"
    assert served_by(canary, on_stable, "app", **force) == "stable-1"  # no right: its cohort's variant
