"""The admin listener's status page in a real browser, against a real gateway.

A gateway with auth on, three simulated pods on MIG slices of two GPUs (``stable-1`` and ``stable-2``
on one, ``canary-1`` on the other), a fake dcgm-exporter, and a canary rollout whose canary is slower
to its first token. Headless Chromium (Debian's ``chromium`` through Playwright; the tests skip,
saying why, when either is missing) opens ``/admin/status``, the operator pastes the admin key, and
the page must show what ``/admin/pods`` and ``/admin/rollouts`` say: the canary rolled back by its
judge, with the judge's reason, and the canary's pod unhealthy after an XID, with the XID as reason.

``SLUICEGATE_STATUS_SCREENSHOT=docs/status-page.png pytest tests/test_status_page.py`` also saves a
screenshot of that page (the one in the docs).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from loadtest.dcgmsim import DcgmsimProcess
from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from tests.conftest import GPU, MIG_A, MIG_B, wait_for
from tests.keys import auth_on, key_store

GPU_2 = "GPU-9b1c4d7e-2f3a-4b5c-8d6e-7f8091a2b3c4"
MIG_C = "MIG-4e5f6a7b-8c9d-5e0f-a1b2-c3d4e5f60718"
ODD_NAME = '<img src=x onerror="document.title=1">'  # a pod name that must stay text
_users = itertools.count()


@dataclass
class Fleet:
    gateway: GatewayProcess
    dcgm: DcgmsimProcess
    admin_key: str
    client_key: str

    def admin(self, path: str) -> Any:
        resp = httpx.get(self.gateway.admin_url + path, headers={"authorization": f"Bearer {self.admin_key}"})
        assert resp.status_code == 200, resp.text
        return resp.json()

    def stream(self) -> None:
        body = {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                "max_tokens": 4, "user": f"user-{next(_users)}"}  # fmt: skip
        headers = {"authorization": f"Bearer {self.client_key}"}
        resp = httpx.post(self.gateway.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
        assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n"), resp.text


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    store = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys = key_store(store, {"id": "ops", "rights": ["admin"]}, {"id": "app"})
    fast = ["--ttft-ms", "5", "--itl-ms", "2"]
    slow = ["--ttft-ms", "80", "--itl-ms", "2"]
    pods = {  # name: (GPU, MIG uuid, GPU instance id, profile, podsim timing)
        "stable-1": (GPU, MIG_A, 9, "1g.10gb", fast),
        "stable-2": (GPU, MIG_B, 3, "2g.20gb", fast),
        "canary-1": (GPU_2, MIG_C, 2, "3g.40gb", slow),
    }
    sims = {
        name: PodsimProcess(["--model", "llama-8b", "--gpu-uuid", gpu, "--mig-uuid", mig, *timing])
        for name, (gpu, mig, _gi, _profile, timing) in pods.items()
    }
    dcgm = DcgmsimProcess(["--gpu", f"{GPU}:1g.10gb@9,2g.20gb@3", "--gpu", f"{GPU_2}:3g.40gb@2"])
    with sims["stable-1"], sims["stable-2"], sims["canary-1"], dcgm:
        config = {
            "server": {"host": "127.0.0.1", "access_log": False},
            "auth": auth_on(store),
            "health": {"devices": {"dcgm_urls": [dcgm.url + "/metrics"], "interval_s": 0.1}},
            "pods": [
                {"name": name, "url": sims[name].url, "models": ["llama-8b"],
                 "labels": {"variant": name.split("-")[0]},
                 "mig": {"gpu_uuid": gpu, "mig_uuid": mig, "gpu_instance_id": gi, "profile": profile}}
                for name, (gpu, mig, gi, profile, _timing) in pods.items()
            ] + [{"name": ODD_NAME, "url": "http://127.0.0.1:9", "models": ["other"]}],
            "routes": {"llama-8b": {"sticky": "user", "variants": {
                "stable": {"pods": {"variant": "stable"}, "weight": 50},
                "canary": {"pods": {"variant": "canary"}, "weight": 50},
            }, "rollout": {"steps": [50, 100], "min_hold_s": 1, "min_samples": 20}}},
        }  # fmt: skip
        with GatewayProcess(config) as gateway:
            yield Fleet(gateway, dcgm, keys["ops"], keys["app"])


@pytest.fixture
def page(browser: Any, fleet: Fleet) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    errors: list[str] = []
    tab = context.new_page()
    tab.on("pageerror", lambda err: errors.append(str(err)))
    # HTTP errors (the 401s before the key, the favicon's 404) are logged too, and are no fault of the page.
    tab.on(
        "console",
        lambda msg: (
            errors.append(msg.text)
            if msg.type == "error" and not msg.text.startswith("Failed to load resource")
            else None
        ),
    )
    tab.goto(fleet.gateway.admin_url + "/admin/status")
    yield tab
    context.close()
    assert errors == []  # no script error, and no CSP violation ("Refused to ..." in Chromium's log)


def refreshed(page: Any, after: int) -> None:
    """Wait for the page's next completed refresh (it counts them on <body>)."""
    # A function, not an expression string: Playwright evals the latter, which the page's CSP forbids.
    page.wait_for_function(
        "after => Number(document.body.dataset.refreshed || 0) > after", arg=after, timeout=10_000
    )


def refreshes(page: Any) -> int:
    return int(page.evaluate("Number(document.body.dataset.refreshed || 0)"))


def use_key(page: Any, key: str) -> None:
    before = refreshes(page)
    page.fill("#key", key)
    page.click("button[type=submit]")
    refreshed(page, before)


def test_the_page_is_served_without_a_key_but_its_data_is_not(fleet: Fleet) -> None:
    resp = httpx.get(fleet.gateway.admin_url + "/admin/status")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/html")
    assert "script-src 'sha256-" in resp.headers["content-security-policy"]
    assert "connect-src 'self'" in resp.headers["content-security-policy"]
    assert httpx.get(fleet.gateway.admin_url + "/admin/pods").status_code == 401
    assert httpx.get(fleet.gateway.url + "/admin/status").status_code in (401, 404)  # not on the public port


def test_without_the_key_the_page_says_why_and_shows_nothing(page: Any, fleet: Fleet) -> None:
    refreshed(page, 0)
    assert "admin API needs an API key" in page.text_content("#refresh")
    assert page.query_selector("tr[data-pod]") is None
    use_key(page, "sk-not-a-key")
    assert "not valid" in page.text_content("#refresh")
    assert fleet.admin_key not in page.url and "sk-" not in page.url


def test_the_page_shows_a_rolled_back_canary_and_a_pod_out_after_an_xid(page: Any, fleet: Fleet) -> None:
    use_key(page, fleet.admin_key)
    assert page.evaluate("sessionStorage.getItem('sluicegate.adminKey')") == fleet.admin_key
    assert page.text_content("tr[data-pod='stable-1'] td:nth-child(3)") == "healthy"
    assert page.query_selector("section[data-rollout='llama-8b']") is not None

    # A canary slower to its first token: its judge rolls it back by itself.
    for sent in range(1, 2000):
        fleet.stream()
        if sent % 10 == 0 and fleet.admin("/admin/rollouts")["rollouts"][0]["state"] == "rolled_back":
            break
    rollout = fleet.admin("/admin/rollouts")["rollouts"][0]
    assert rollout["state"] == "rolled_back", rollout
    reason = rollout["history"][-1]["reason"]
    # Then the canary's GPU falls off the bus.
    xid = {"gpu_uuid": GPU_2, "gpu_instance_id": 2, "xid": 79}
    assert httpx.post(fleet.dcgm.url + "/faults", json=xid).status_code == 200
    assert wait_for(lambda: next(p for p in fleet.admin("/admin/pods")["pods"]
                                 if p["name"] == "canary-1")["state"]["health"] == "unhealthy")  # fmt: skip

    refreshed(page, refreshes(page))
    canary = "tr[data-pod='canary-1']"
    assert page.text_content(f"{canary} td:nth-child(3)") == "unhealthy"
    assert "XID 79" in page.text_content(f"{canary} td:nth-child(4)")
    assert "3g.40gb @ GI 2" in page.text_content(f"{canary} td:nth-child(1)")
    assert page.text_content("tr[data-pod='stable-2'] td:nth-child(3)") == "healthy"
    section = "section[data-rollout='llama-8b']"
    assert page.text_content(f"{section} .rollout-state") == "rolled_back"
    latest = page.query_selector(f"{section} tr.event")  # newest first
    assert "rolled_back" in latest.text_content() and reason in latest.text_content()
    assert "ttft" in page.text_content(section).lower()  # the judge's evidence, per metric
    # Every text from the gateway went in as text: the odd pod name is shown, not run.
    assert page.text_content(f"tr[data-pod='{ODD_NAME}'] td:nth-child(2)") == ODD_NAME
    assert page.query_selector("#pods img") is None and page.title() == "Sluicegate status"

    if shot := os.environ.get("SLUICEGATE_STATUS_SCREENSHOT"):
        page.screenshot(path=shot, full_page=True)
