"""Pod selection: fewest in flight, ties spread, unreachable pods skipped."""

from collections import Counter

from gateway.config import PodConfig
from gateway.pods.registry import PodRegistry


def _registry() -> PodRegistry:
    return PodRegistry(
        [
            PodConfig(name="a", url="http://127.0.0.1:1", models=("m",)),
            PodConfig(name="b", url="http://127.0.0.1:2", models=("m", "n")),
            PodConfig(name="c", url="http://127.0.0.1:3", models=("n",)),
        ]
    )


def test_pick_prefers_the_pod_with_fewest_requests_in_flight() -> None:
    reg = _registry()
    reg.get("a").in_flight = 3
    reg.get("b").in_flight = 1
    assert {reg.pick("m").name for _ in range(10)} == {"b"}


def test_ties_are_spread_across_pods() -> None:
    reg = _registry()
    picks = Counter(reg.pick("m").name for _ in range(100))
    assert picks == {"a": 50, "b": 50}


def test_unreachable_pods_get_nothing_and_unknown_models_are_known_as_such() -> None:
    reg = _registry()
    reg.get("b").reachable = False
    assert {reg.pick("m").name for _ in range(5)} == {"a"}
    reg.get("a").reachable = False
    assert reg.pick("m") is None
    assert reg.knows("m") and not reg.knows("zzz")
    assert reg.routable_models() == ["n"]
    assert reg.models() == ["m", "n"]


def test_discovered_models_need_a_reindex_and_a_reachable_pod() -> None:
    reg = PodRegistry([PodConfig(name="d", url="http://127.0.0.1:4")])
    pod = reg.get("d")
    assert not pod.routable and not reg.ready()
    pod.models = frozenset({"x"})
    pod.reachable = True
    reg.reindex()
    assert reg.pick("x") is pod and reg.ready()
