"""Session affinity: requests sharing a key go to one pod while it is fit, and yield to health.

Unit tests on the registry's choice (rendezvous order, bounded load) and on the key itself, then a
gateway process in front of three simulated pods, keyed on the OpenAI ``user`` field.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator

import openai
import pytest

from gateway.affinity import affinity_key
from gateway.config import AffinityConfig, Config, PodConfig
from gateway.metrics import GatewayMetrics
from gateway.pods.registry import PodRegistry
from gateway.request_head import HeadReader
from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from tests.conftest import FAST, pod_state, wait_for

NAMES = ("p0", "p1", "p2", "p3")


def registry(names: tuple[str, ...] = NAMES) -> PodRegistry:
    pods = [PodConfig(name=n, url=f"http://127.0.0.1:{i + 1}", models=("m",)) for i, n in enumerate(names)]
    return PodRegistry(pods, metrics=GatewayMetrics())


def home(reg: PodRegistry, key: str) -> str:
    pod = reg.pick("m", affinity=key)
    assert pod is not None
    return pod.name


def test_a_key_always_goes_to_the_same_pod_and_keys_spread_over_all_pods() -> None:
    reg = registry()
    assert {home(reg, "alice") for _ in range(20)} == {home(reg, "alice")}
    spread = Counter(home(reg, f"user-{i}") for i in range(400))
    assert set(spread) == set(NAMES)
    assert min(spread.values()) > 60  # 100 each on average
    # another gateway replica (a fresh registry) agrees on every key
    other = registry()
    assert all(home(reg, f"user-{i}") == home(other, f"user-{i}") for i in range(50))


def test_losing_a_pod_moves_only_its_own_keys() -> None:
    reg = registry()
    before = {f"user-{i}": home(reg, f"user-{i}") for i in range(200)}
    reg.get("p2").reachable = False
    after = {key: home(reg, key) for key in before}
    moved = {key for key in before if before[key] != after[key]}
    assert moved == {key for key, pod in before.items() if pod == "p2"}
    reg.get("p2").reachable = True
    assert {key: home(reg, key) for key in before} == before  # and they come back


def test_affinity_yields_to_breakers_and_to_a_pod_far_busier_than_the_rest() -> None:
    reg = registry()
    pod = reg.get(home(reg, "alice"))
    pod.pressure.open = True  # a full KV cache: critical traffic only
    now = time.monotonic()
    for p in reg.pods:
        p.load.scraped_at = now
    assert home(reg, "alice") != pod.name
    assert reg.pick("m", criticality="critical", affinity="alice") is pod
    pod.pressure.open = False
    assert home(reg, "alice") == pod.name
    for p in reg.pods:
        p.in_flight = 2
    pod.in_flight = 10  # mean in flight 4: the bound is 1.5 x 4 + 1 = 7
    assert home(reg, "alice") != pod.name
    pod.in_flight = 5  # mean 2.75, bound 5.1
    assert home(reg, "alice") == pod.name
    counts = {
        (s.labels["outcome"]): s.value
        for f in reg.metrics.registry.collect()
        if f.name == "sluicegate_affinity"
        for s in f.samples
        if s.name.endswith("_total")
    }
    assert counts["moved"] == 2 and counts["home"] >= 3


def test_keys_from_the_user_field_a_header_or_the_prompt_prefix() -> None:
    chat = {"model": "m", "user": "u-42", "messages": [{"role": "system", "content": "You are terse."}]}
    headers = [(b"x-session-id", b"s-7")]

    def header_value(config: AffinityConfig) -> bytes | None:  # as the relay reads it, with the others
        return HeadReader(Config(affinity=config)).read(headers).affinity

    assert affinity_key(AffinityConfig(key="user"), chat, None) == "u-42"
    assert affinity_key(AffinityConfig(key="user"), {"model": "m"}, None) is None
    session = AffinityConfig(key="header:x-session-id")
    assert affinity_key(session, chat, header_value(session)) == "s-7"
    other = AffinityConfig(key="header:x-other")
    assert affinity_key(other, chat, header_value(other)) is None
    prefix = AffinityConfig(key="prefix", prefix_chars=12)
    assert affinity_key(prefix, chat, None) == "system:You a"
    follow_up = {**chat, "messages": [*chat["messages"], {"role": "user", "content": "hi"}]}
    assert affinity_key(prefix, follow_up, None) == "system:You a"  # same prefix, same pod
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image"}]}]}
    assert affinity_key(AffinityConfig(key="prefix"), parts, None) == "user:look\n"
    assert affinity_key(AffinityConfig(key="prefix", prefix_chars=3), {"prompt": ["abcdef"]}, None) == "abc"
    with pytest.raises(ValueError):
        AffinityConfig(key="cookie")


# --- through a gateway ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[GatewayProcess, dict[str, PodsimProcess]]]:
    pods = {f"pod-{i}": PodsimProcess(["--model", "llama-8b", *FAST]) for i in range(3)}
    for pod in pods.values():
        pod.start()
    try:
        config = {
            "server": {"host": "127.0.0.1"},
            "discovery": {"refresh_interval_s": 30, "retry_interval_s": 0.2},
            "health": {"probe": {"interval_s": 0.1, "unhealthy_after": 1}},
            "affinity": {"key": "user"},
            "pods": [{"name": n, "url": p.url, "models": ["llama-8b"]} for n, p in pods.items()],
        }
        with GatewayProcess(config) as gw:
            yield gw, pods
    finally:
        for pod in pods.values():
            pod.stop()


def served_by(url: str, user: str | None) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="sk-none", max_retries=0)
    extra = {"user": user} if user else {}
    raw = client.chat.completions.with_raw_response.create(
        model="llama-8b", messages=[{"role": "user", "content": "hi"}], max_tokens=2, **extra
    )
    assert raw.parse().choices[0].message.content
    return raw.headers["x-sluicegate-pod"]


def test_a_users_requests_stay_on_one_pod_until_it_fails_then_move_to_one_other(
    gateway: tuple[GatewayProcess, dict[str, PodsimProcess]],
) -> None:
    gw, pods = gateway
    url = gw.url
    homes = {user: {served_by(url, user) for _ in range(6)} for user in ("alice", "bob", "carol", "dave")}
    assert all(len(pods_seen) == 1 for pods_seen in homes.values()), homes
    assert len(Counter(served_by(url, None) for _ in range(12))) > 1  # no key: load balancing
    alice = homes["alice"].pop()
    pods[alice].stop()  # alice's pod goes away
    assert wait_for(lambda: not pod_state(gw.admin_url, alice)["routable"])
    moved = {served_by(url, "alice") for _ in range(6)}
    assert len(moved) == 1 and alice not in moved
