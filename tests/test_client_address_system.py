"""The client address in a real gateway's access log: ``X-Forwarded-For`` believed only from the
proxies in ``server.trusted_proxies``.

Two gateway processes before one simulated pod, with auth on (the log names the caller's key id):
one trusting the loopback hop the test's requests come from (and a private range standing for a
second proxy tier), one trusting nobody. Each request carries its own ``x-request-id`` so its log
line is found by id.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from tests.conftest import FAST, wait_for
from tests.keys import auth_on, key_store

CHAT = {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@dataclass
class Gateways:
    behind_proxy: GatewayProcess  # trusts 127.0.0.1/32 and 10.0.0.0/8
    exposed: GatewayProcess  # trusts nobody
    key: str


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateways]:
    store = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys = key_store(store, {"id": "edge-client"})
    with PodsimProcess(["--model", "llama-8b", *FAST]) as pod:
        base = {
            "auth": auth_on(store),
            "pods": [{"name": "pod", "url": pod.url, "models": ["llama-8b"]}],
        }
        server = {"host": "127.0.0.1", "access_log": True}
        trusting = {**base, "server": {**server, "trusted_proxies": ["127.0.0.1/32", "10.0.0.0/8"]}}
        with GatewayProcess(trusting) as behind, GatewayProcess({**base, "server": server}) as exposed:
            yield Gateways(behind, exposed, keys["edge-client"])


def logged_client(gateway: GatewayProcess, key: str, forwarded_for: list[str] | None) -> str:
    """Send one request (each ``forwarded_for`` entry one header line, as proxies may append) and
    return the ``client=`` of its access-log line."""
    rid = uuid.uuid4().hex
    headers = [("authorization", f"Bearer {key}"), ("x-request-id", rid)]
    headers += [("x-forwarded-for", value) for value in forwarded_for or []]
    resp = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT, headers=headers)
    assert resp.status_code == 200, resp.text

    def line() -> str | None:
        return next((ln for ln in gateway.log().splitlines() if f"rid={rid} " in ln), None)

    assert wait_for(lambda: line() is not None), f"no access-log line for {rid}"
    found = line()
    assert found is not None and "key=edge-client " in found and key not in found
    match = re.search(r" client=(\S+) ", found)
    assert match, found
    return match.group(1)


@pytest.mark.parametrize(
    ("forwarded_for", "client"),
    [
        (None, "127.0.0.1"),  # no proxy header: the TCP peer
        (["203.0.113.7"], "203.0.113.7"),  # one trusted hop reports its client
        (["6.6.6.6, 1.2.3.4"], "1.2.3.4"),  # the client forged 6.6.6.6; the hop saw 1.2.3.4
        (["6.6.6.6, 1.2.3.4, 10.1.2.3"], "1.2.3.4"),  # through two trusted tiers
        (["6.6.6.6", "1.2.3.4"], "1.2.3.4"),  # the same list split over two header lines
        (["10.9.9.9"], "10.9.9.9"),  # only trusted hops: the leftmost is as far as they vouch
        (["1.2.3.4, not-an-address"], "127.0.0.1"),  # the trusted hop reported garbage: itself
    ],
)
def test_a_trusted_proxy_s_forwarded_for_names_the_client(
    gateways: Gateways, forwarded_for: list[str] | None, client: str
) -> None:
    assert logged_client(gateways.behind_proxy, gateways.key, forwarded_for) == client


@pytest.mark.parametrize("forwarded_for", [["203.0.113.7"], ["6.6.6.6, 1.2.3.4"], ["10.1.2.3"]])
def test_without_trusted_proxies_the_header_is_ignored(gateways: Gateways, forwarded_for: list[str]) -> None:
    assert logged_client(gateways.exposed, gateways.key, forwarded_for) == "127.0.0.1"
