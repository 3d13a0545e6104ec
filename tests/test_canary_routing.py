"""The canary routing decision (gateway.canary.routing): shares, stickiness, moves, overrides, config."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from gateway.canary.routing import Router, cohort_key, routers
from gateway.config import ConfigError
from gateway.config_load import parse_config
from gateway.config_routes import RouteConfig

CALLERS = [f"caller-{i}" for i in range(20_000)]


def route(**variants: dict[str, Any]) -> RouteConfig:
    return RouteConfig.model_validate({"variants": variants})


def two(canary: float, stable: float | None = None) -> RouteConfig:
    stable = 100 - canary if stable is None else stable
    return route(
        stable={"pods": {"track": "stable"}, "weight": stable},
        canary={"pods": {"track": "canary"}, "model": "llama-next", "weight": canary},
    )


def within_4_sigma(count: int, n: int, p: float) -> None:
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(count - n * p) < 4 * sigma, f"{count} of {n}, expected {n * p:.0f} +- {4 * sigma:.0f}"


def assignment(router: Router) -> dict[str, str]:
    return {caller: router.choose(caller).variant for caller in CALLERS}


# -- shares --------------------------------------------------------------------------------------

@pytest.mark.parametrize("canary", [1, 5, 25, 50])
def test_distinct_callers_split_by_weight(canary: float) -> None:
    placed = assignment(Router("llama", two(canary), salt="rollout-1"))
    within_4_sigma(sum(v == "canary" for v in placed.values()), len(CALLERS), canary / 100)


def test_three_variants_split_by_weight_for_callers_and_random_requests() -> None:
    config = route(stable={"pods": {"t": "s"}, "weight": 60}, control={"pods": {"t": "a"}, "weight": 30},
                   canary={"pods": {"t": "c"}, "weight": 10})
    sticky = Router("llama", config, salt="r")
    rng = random.Random(1234)
    randomly = Router("llama", config, rng=rng.random)
    for placed in ([sticky.choose(c).variant for c in CALLERS],
                   [randomly.choose(None).variant for _ in range(20_000)]):
        for name, share in (("stable", 0.6), ("control", 0.3), ("canary", 0.1)):
            within_4_sigma(placed.count(name), 20_000, share)


def test_random_requests_split_by_weight_and_say_so() -> None:
    rng = random.Random(99)
    router = Router("llama", two(5), rng=rng.random)
    choices = [router.choose(None) for _ in range(20_000)]
    assert {choice.reason for choice in choices} == {"random"}
    within_4_sigma(sum(c.variant == "canary" for c in choices), 20_000, 0.05)


def test_random_requests_use_the_injected_rng() -> None:
    values = iter([0.0, 0.949, 0.951, 0.999999])
    router = Router("llama", two(5), rng=lambda: next(values))
    assert [router.choose(None).variant for _ in range(4)] == ["stable", "stable", "canary", "canary"]


# -- stickiness ------------------------------------------------------------------------------------

def test_a_sticky_caller_never_changes_variant_within_a_step() -> None:
    router = Router("llama", two(25), salt="r", rng=random.Random(5).random)
    first = assignment(router)
    for _ in range(3):
        assert assignment(router) == first
    assert {router.choose("caller-7").reason for _ in range(10)} == {"sticky"}


def test_replicas_agree_without_talking() -> None:
    """Two Routers built apart (two gateway processes) put every caller on the same variant."""
    assert assignment(Router("llama", two(25), salt="r")) == assignment(Router("llama", two(25), salt="r"))


def test_the_salt_and_the_route_pick_different_cohorts() -> None:
    base = assignment(Router("llama", two(25), salt="rollout-1"))
    for other in (Router("llama", two(25), salt="rollout-2"), Router("mistral", two(25), salt="rollout-1")):
        moved = sum(base[c] != v for c, v in assignment(other).items())
        # independent cohorts: a caller differs with probability 2 * 0.25 * 0.75
        within_4_sigma(moved, len(CALLERS), 2 * 0.25 * 0.75)


def test_with_salt_keeps_weights_but_changes_cohorts() -> None:
    router = Router("llama", two(1), salt="a").with_weights({"canary": 25, "stable": 75})
    resalted = router.with_salt("b")
    assert resalted.weights == router.weights and resalted.salt == "b"
    assert assignment(resalted) != assignment(router)


@pytest.mark.parametrize("steps", [[1, 5, 25, 50, 100], [0, 1, 2, 3, 10, 99, 100]])
def test_callers_only_move_into_the_canary_as_it_grows(steps: list[float]) -> None:
    router = Router("llama", two(steps[0]), salt="rollout-1")
    before = assignment(router)
    for canary in steps[1:]:
        router = router.with_weights({"canary": canary, "stable": 100 - canary})
        after = assignment(router)
        left = [c for c in CALLERS if before[c] == "canary" and after[c] != "canary"]
        assert not left, f"at {canary}%: {len(left)} callers left the canary, e.g. {left[:3]}"
        if 0 < canary < 100:
            within_4_sigma(sum(v == "canary" for v in after.values()), len(CALLERS), canary / 100)
        before = after
    assert set(before.values()) == {"canary"}


def test_growing_the_canary_moves_no_caller_between_the_other_variants() -> None:
    """With stable and control sharing the rest, a caller is on the canary or where it was."""
    def config(canary: float) -> dict[str, float]:
        return {"stable": (100 - canary) / 2, "control": (100 - canary) / 2, "canary": canary}

    base = route(stable={"pods": {"t": "s"}, "weight": 50}, control={"pods": {"t": "a"}, "weight": 50},
                 canary={"pods": {"t": "c"}, "weight": 0})
    router = Router("llama", base, salt="r")
    start = before = assignment(router)
    for canary in (1, 5, 25, 50, 99):
        router = router.with_weights(config(canary))
        after = assignment(router)
        for caller in CALLERS:
            assert after[caller] in ("canary", start[caller]), caller
            assert before[caller] != "canary" or after[caller] == "canary", caller
        before = after


def test_rollback_moves_the_whole_cohort_back_and_nobody_else() -> None:
    router = Router("llama", two(25), salt="r")
    during = assignment(router)
    rolled_back = router.with_weights({"canary": 0})
    after = {c: rolled_back.choose(c) for c in CALLERS}
    assert {choice.variant for choice in after.values()} == {"stable"}
    assert {choice.reason for choice in after.values()} == {"only"}
    # back to the same step (same salt): exactly the same cohort returns
    assert assignment(rolled_back.with_weights({"canary": 25})) == during


def test_rollback_with_a_third_variant_sends_each_caller_back_where_it_came_from() -> None:
    base = route(stable={"pods": {"t": "s"}, "weight": 50}, control={"pods": {"t": "a"}, "weight": 50},
                 canary={"pods": {"t": "c"}, "weight": 0})
    router = Router("llama", base, salt="r")
    start = assignment(router)
    back = assignment(router.with_weights({"canary": 10}).with_weights({"canary": 0}))
    assert back == start


def test_with_weights_is_a_new_router_and_the_old_one_is_untouched() -> None:
    old = Router("llama", two(5), salt="r")
    before = assignment(old)
    new = old.with_weights({"canary": 50, "stable": 50})
    assert new is not old
    assert dict(old.weights) == {"stable": 95, "canary": 5}
    assert dict(new.weights) == {"stable": 50, "canary": 50}
    assert assignment(old) == before
    with pytest.raises(TypeError):
        old.weights["canary"] = 7  # type: ignore[index]


@pytest.mark.parametrize(
    ("weights", "message"),
    [({"canari": 5}, "no variant named 'canari'"), ({"canary": -1}, "not negative: canary"),
     ({"canary": math.nan}, "finite"), ({"canary": 0, "stable": 0}, "at least one variant")],
)
def test_with_weights_refuses_bad_weights(weights: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Router("llama", two(5)).with_weights(weights)


# -- overrides ---------------------------------------------------------------------------------------

def test_a_permitted_override_wins_even_at_weight_zero() -> None:
    router = Router("llama", two(0))
    choice = router.choose("caller-1", override="canary", may_override=True)
    assert (choice.variant, choice.reason, choice.refused, choice.override_refused) == (
        "canary", "override", None, False)
    assert router.choose(None, override="stable", may_override=True).variant == "stable"


@pytest.mark.parametrize(
    ("override", "may", "refused"),
    [("canary", False, "not_permitted"), ("canari", True, "unknown_variant"),
     ("canari", False, "not_permitted")],
)
def test_a_refused_override_is_ignored_and_says_why(override: str, may: bool, refused: str) -> None:
    router = Router("llama", two(25), salt="r")
    for caller in CALLERS[:500]:
        plain = router.choose(caller)
        choice = router.choose(caller, override=override, may_override=may)
        assert (choice.variant, choice.reason, choice.refused) == (plain.variant, "sticky", refused)
        assert choice.override_refused


def test_no_override_header_is_not_a_refusal() -> None:
    router = Router("llama", two(25))
    assert router.choose("c", override=None, may_override=False).refused is None
    assert router.choose("c", override="", may_override=False).refused is None


# -- the choice's contents ---------------------------------------------------------------------------

def test_the_choice_names_the_upstream_model_and_the_pods() -> None:
    router = Router("llama", two(0, 100))
    stable = router.choose("c")
    assert (stable.route, stable.variant, stable.model, stable.reason) == ("llama", "stable", "llama", "only")
    canary = router.choose("c", override="canary", may_override=True)
    assert canary.model == "llama-next"
    assert canary.pods.matches({"track": "canary", "zone": "a"})
    assert not canary.pods.matches({"track": "stable"}) and not canary.pods.matches({})


def test_an_empty_selector_takes_the_pods_no_other_variant_selects() -> None:
    config = route(stable={"weight": 99}, canary={"pods": {"variant": "canary"}, "weight": 1})
    router = Router("llama", config)
    stable = router.choose(None, override="stable", may_override=True).pods
    assert stable.matches({}) and stable.matches({"variant": "old"})
    assert not stable.matches({"variant": "canary", "zone": "b"})


def test_routers_builds_one_per_public_model() -> None:
    config = parse_config({"routes": {"llama": {"variants": {"stable": {"weight": 1}}}}})
    built = routers(config.routes, salt="s")
    assert list(built) == ["llama"] and built["llama"].salt == "s"
    assert built["llama"].choose("x").reason == "only"


# -- cohort keys ---------------------------------------------------------------------------------------

def chat(*messages: tuple[str, Any], user: str | None = None) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": "llama", "messages": [{"role": r, "content": c} for r, c in messages]}
    if user is not None:
        payload["user"] = user
    return payload


def test_cohort_keys_by_key_user_and_header() -> None:
    payload = chat(("user", "hi"), user="alice")
    assert cohort_key("key", "key-1", payload, None) == "key-1"
    assert cohort_key("key", None, payload, None) is None
    assert cohort_key("user", "key-1", payload, None) == "alice"
    assert cohort_key("user", "key-1", chat(("user", "hi")), None) is None
    assert cohort_key("user", "key-1", {"user": 5}, None) is None
    assert cohort_key("header:x-tenant", None, payload, b"acme") == "acme"
    assert cohort_key("header:x-tenant", None, payload, "acme") == "acme"
    assert cohort_key("header:x-tenant", None, payload, b"") is None
    assert cohort_key("header:x-tenant", None, payload, None) is None
    with pytest.raises(ValueError, match="sticky"):
        cohort_key("ip", None, payload, None)


def test_a_conversation_keeps_its_key_from_turn_to_turn() -> None:
    system, question = ("system", "You are terse."), ("user", "What is MIG?")
    turn1 = cohort_key("conversation", None, chat(system, question), None)
    turn2 = cohort_key("conversation", None, chat(system, question, ("assistant", "A GPU split."),
                                                  ("user", "How many slices?")), None)
    assert turn1 is not None and turn1 == turn2
    # a conversation opened with the user's message alone: its reply is not part of the key
    alone1 = cohort_key("conversation", None, chat(question), None)
    alone2 = cohort_key("conversation", None, chat(question, ("assistant", "A GPU split."), ("user", "more")),
                        None)
    assert alone1 == alone2 != turn1
    other = cohort_key("conversation", None, chat(system, ("user", "What is MPS?")), None)
    assert other != turn1


def test_a_conversation_key_reads_role_and_text_of_the_first_n_messages() -> None:
    parts = [{"type": "text", "text": "What is "}, {"type": "image_url", "image_url": {"url": "x"}},
             {"type": "text", "text": "MIG?"}]
    as_parts = cohort_key("conversation", None, chat(("user", parts)), None)
    assert as_parts == cohort_key("conversation", None, chat(("user", "What is MIG?")), None)
    assert as_parts != cohort_key("conversation", None, chat(("system", "What is MIG?")), None)
    long = chat(("system", "a"), ("user", "b"), ("user", "c"))
    assert cohort_key("conversation", None, long, None, conversation_messages=2) == cohort_key(
        "conversation", None, chat(("system", "a"), ("user", "b")), None, conversation_messages=2)
    assert cohort_key("conversation", None, long, None, conversation_messages=3) != cohort_key(
        "conversation", None, long, None, conversation_messages=2)


def test_conversation_keys_for_prompts_odd_text_and_nothing() -> None:
    assert cohort_key("conversation", None, {"prompt": "Once"}, None) == cohort_key(
        "conversation", None, {"prompt": ["Once", "Twice"]}, None)
    assert cohort_key("conversation", None, {"prompt": ""}, None) is None
    assert cohort_key("conversation", None, {"messages": []}, None) is None
    assert cohort_key("conversation", None, {}, None) is None
    lone = cohort_key("conversation", None, chat(("user", "\ud800 lone surrogate")), None)  # JSON allows it
    assert lone is not None
    Router("llama", two(50)).choose("\udfff caller")  # a user field can carry one too


def test_router_cohort_key_uses_the_route_settings() -> None:
    config = RouteConfig.model_validate({"variants": {"stable": {"weight": 1}}, "sticky": "header:x-tenant"})
    router = Router("llama", config)
    assert router.header_name == "x-tenant" and router.override_header == "x-sluicegate-variant"
    assert router.cohort_key("key-1", {}, b"acme") == "acme"
    assert Router("llama", two(5)).header_name is None
    assert Router("llama", two(5)).cohort_key(None, chat(("user", "hi")), None) is not None


# -- config --------------------------------------------------------------------------------------------

def test_a_route_in_yaml_terms() -> None:
    config = parse_config({"routes": {"llama": {
        "variants": {"stable": {"pods": {"track": "stable"}, "weight": 99},
                     "canary": {"pods": {"variant": "canary"}, "model": "llama-next", "weight": 1}},
        "sticky": "user", "override_header": "x-variant", "conversation_messages": 3}}})
    llama = config.routes["llama"]
    assert llama.variants["canary"].model == "llama-next" and llama.variants["stable"].model is None
    assert (llama.sticky, llama.override_header, llama.conversation_messages) == ("user", "x-variant", 3)
    assert parse_config({}).routes == {}
    assert parse_config({"routes": {"m": {"variants": {"stable": {"weight": 1}}}}}).routes["m"].sticky == (
        "conversation")


@pytest.mark.parametrize(
    ("route_config", "message"),
    [
        ({"variants": {"canary": {"weight": 1}}},
         "'routes.llama.variants': a route needs a variant named 'stable' (the baseline); it has: canary"),
        ({"variants": {"stable": {"weight": 0}, "canary": {"pods": {"v": "c"}, "weight": 0}}},
         "at least one variant needs a weight above 0"),
        ({"variants": {"stable": {"weight": -1}}},
         "'routes.llama.variants.stable.weight': Input should be greater than or equal to 0"),
        ({"variants": {"stable": {"weight": 1}, "Canary 2": {"weight": 1}}},
         "variant name(s) 'Canary 2' must be lowercase letters, digits and '_'"),
        ({"variants": {"stable": {"weight": 1}, "canary": {"weight": 1}}},
         "variants stable, canary all have empty 'pods'; only one may"),
        ({"variants": {"stable": {"weight": 1}} | {f"v{i}": {"pods": {"v": str(i)}} for i in range(8)}},
         "at most 8 variants, not 9"),
        ({"variants": {"stable": {"weight": 1}}, "sticky": "ip"},
         "'routes.llama.sticky': String should match"),
        ({"variants": {"stable": {"weight": 1}}, "conversation_messages": 0},
         "'routes.llama.conversation_messages'"),
        ({"variants": {"stable": {"weight": 1, "colour": "blue"}}}, "'routes.llama.variants.stable.colour'"),
        ({"variants": {"stable": {"weight": math.inf}}}, "'routes.llama.variants.stable.weight'"),
    ],
)
def test_bad_routes_get_one_clear_message(route_config: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"routes": {"llama": route_config}}, "cfg.yaml")
    assert message in str(caught.value)
    assert str(caught.value).startswith("cfg.yaml has 1 problem")
