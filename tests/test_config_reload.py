"""Config reload through a real gateway process: its config file rewritten (the file watch) or
SIGHUP, while clients call it.

New callers split by new weights; a bad file is refused on one warning line and the old config
keeps serving; a change that needs a restart is named and kept; a rollout keeps its state across a
reload that leaves its route alone; and streams in flight through reloads, a promote and a
restarted rollout all finish whole. Each wait is for an event the gateway publishes (its reload
counter, its log, its rollout status), never a fixed sleep.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import yaml

from gateway.config import ConfigError
from gateway.config_load import load_config
from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from tests.canary import canary_config, canary_pods
from tests.conftest import counter_totals, wait_for

_users = itertools.count()
RELOAD = {"watch": True, "interval_s": 0.1}
GOLD = {"gold": {"timeouts": {"total_s": 120}}}


def write_config(gw: GatewayProcess, config: dict[str, Any], port: int = 0) -> None:
    """Replace the gateway's config file as an operator (or a ConfigMap update) does: whole, by a
    rename, with what ``GatewayProcess`` puts in for a test (any port, auth off)."""
    config = {**config, "server": {**config.get("server", {}), "port": port}}
    config.setdefault("auth", {"enabled": False})
    config["admin"] = {"port": 0, **config.get("admin", {})}
    path = gw.log_path.parent / "config.yaml"
    temporary = path.with_suffix(".new")
    temporary.write_text(yaml.safe_dump(config))
    os.replace(temporary, path)


def reloads(gw: GatewayProcess, outcome: str = "ok") -> float:
    totals = counter_totals(gw.admin_url, "sluicegate_config_reloads", "outcome", timeout_s=10)
    return totals.get(outcome, 0.0)


def reloaded(gw: GatewayProcess, before: float, outcome: str = "ok") -> bool:
    """Wait (on the gateway's own counter) for a reload after ``before`` of them."""
    return wait_for(lambda: reloads(gw, outcome) > before, timeout_s=30)


def answer(gw: GatewayProcess, **headers: str) -> httpx.Response:
    body = {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "user": f"user-{next(_users)}"}  # fmt: skip
    resp = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp


def canary_share(gw: GatewayProcess, calls: int = 300) -> float:
    """The share of ``calls`` new callers (one user each) that the canary pod served."""
    with httpx.Client(timeout=30) as client:
        pods = []
        for _ in range(calls):
            body = {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                    "user": f"user-{next(_users)}"}  # fmt: skip
            resp = client.post(gw.url + "/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text
            pods.append(resp.headers["x-sluicegate-pod"])
    return pods.count("canary-1") / calls


def test_new_callers_split_by_the_weights_of_a_rewritten_file() -> None:
    with canary_pods() as (stable, new):
        config = canary_config(stable.url, new.url, weights=(100, 1), reload=RELOAD)
        with GatewayProcess(config) as gw:
            assert canary_share(gw, 100) < 0.06
            before = reloads(gw)
            write_config(gw, canary_config(stable.url, new.url, weights=(20, 80), reload=RELOAD))
            assert reloaded(gw, before)
            share = canary_share(gw)
            assert 0.70 < share < 0.90, share  # 80 %, 300 callers: sd 2.3 points
            assert "config reloaded (file changed): routes.llama-8b" in gw.log()


def test_a_bad_file_is_refused_on_one_line_and_the_old_config_keeps_serving() -> None:
    with canary_pods() as (stable, new):
        config = canary_config(stable.url, new.url, weights=(1, 100), reload={"watch": False})
        with GatewayProcess(config) as gw:
            bad = canary_config(stable.url, new.url, weights=(0, 0), reload={"watch": False})
            write_config(gw, bad)
            path = gw.log_path.parent / "config.yaml"
            with pytest.raises(ConfigError) as refused:
                load_config(path)  # what start-up would have said of this file
            gw.proc.send_signal(signal.SIGHUP)
            assert reloaded(gw, 0, "error")
            lines = [line for line in gw.log().splitlines() if "config reload" in line]
            assert len(lines) == 1, lines
            assert "WARNING" in lines[0] and "refused; the running config stays" in lines[0]
            assert " ".join(str(refused.value).split()) in lines[0]
            assert "Traceback" not in gw.log()
            assert gw.proc.poll() is None
            assert answer(gw).headers["x-sluicegate-pod"] == "canary-1"  # the old weights, 1:100
            assert reloads(gw) == 0
            admin = httpx.get(gw.admin_url + "/admin/reload", timeout=10).json()
            assert admin["last"]["outcome"] == "error" and admin["last"]["why"] == "SIGHUP"


def test_a_change_that_needs_a_restart_is_named_and_kept() -> None:
    with canary_pods() as (stable, new):
        config = canary_config(stable.url, new.url, weights=(100, 1), reload=RELOAD)
        with GatewayProcess(config) as gw:
            before = reloads(gw)
            moved = canary_config(stable.url, new.url, weights=(1, 100), reload=RELOAD)
            moved["tier_header"] = "x-my-tier"
            write_config(gw, moved, port=8089)
            assert wait_for(lambda: "server.port changed" in gw.log(), timeout_s=30)
            assert reloads(gw) > before
            log = gw.log()
            assert "server.port changed: needs a restart; kept 0" in log
            assert "tier_header changed: needs a restart; kept 'x-sluicegate-tier'" in log
            # the port stays (the test reaches the gateway where it listened), the weights moved
            assert wait_for(lambda: answer(gw).headers["x-sluicegate-pod"] == "canary-1", timeout_s=30)
            last = httpx.post(gw.admin_url + "/admin/reload", timeout=10).json()
            assert last["outcome"] == "ok" and last["changed"] == []
            assert "server.port changed: needs a restart; kept 0" in last["kept"]


def _rollout(gw: GatewayProcess) -> dict[str, Any] | None:
    found = httpx.get(gw.admin_url + "/admin/rollouts", timeout=10).json()["rollouts"]
    return found[0] if found else None


def test_a_rollout_keeps_its_state_across_a_reload_that_leaves_its_route_alone() -> None:
    plan = {"steps": [5, 50], "min_hold_s": 3600, "min_samples": 10**6}
    with canary_pods() as (stable, new):
        config = canary_config(stable.url, new.url, plan, reload=RELOAD, tiers=GOLD)
        with GatewayProcess(config) as gw:
            steer = gw.admin_url + "/admin/rollouts/llama-8b/"
            assert httpx.post(steer + "pause?why=reload-test").json()["state"] == "paused"
            before = reloads(gw)
            tiers = {"gold": {"timeouts": {"total_s": 60}}}
            write_config(gw, canary_config(stable.url, new.url, plan, reload=RELOAD, tiers=tiers))
            assert reloaded(gw, before)
            kept = _rollout(gw)
            assert kept is not None and kept["state"] == "paused" and kept["step"] == 0
            assert [event["what"] for event in kept["history"]] == ["started", "paused"]
            # a changed plan starts over; a removed one stops and the config's weights rule again
            before = reloads(gw)
            changed = {**plan, "steps": [10, 50]}
            write_config(gw, canary_config(stable.url, new.url, changed, reload=RELOAD, tiers=tiers))
            assert reloaded(gw, before)
            restarted = _rollout(gw)
            assert restarted is not None and restarted["state"] == "progressing"
            assert restarted["weights"]["canary"] == 10
            assert "rollout llama-8b: its route changed: restarted at step 0 by a config reload" in gw.log()
            before = reloads(gw)
            write_config(gw, canary_config(stable.url, new.url, weights=(0, 1), reload=RELOAD, tiers=tiers))
            assert reloaded(gw, before)
            assert _rollout(gw) is None
            assert {answer(gw).headers["x-sluicegate-pod"] for _ in range(10)} == {"canary-1"}


@contextmanager
def slow_pods() -> Iterator[tuple[PodsimProcess, PodsimProcess]]:
    """Stable and canary pods that pace their tokens, so streams are in flight for seconds."""
    paced = ["--model", "llama-8b", "--ttft-ms", "5", "--itl-ms", "15"]
    with PodsimProcess(paced) as stable, PodsimProcess(paced) as new:
        yield stable, new


class Streams:
    """``count`` streaming callers, each asking for ``tokens`` tokens and keeping what it got."""

    def __init__(self, gw: GatewayProcess, count: int, tokens: int) -> None:
        self.gw, self.tokens = gw, tokens
        self.results: list[tuple[int, str]] = []
        self.failures: list[str] = []
        self.started = threading.Barrier(count + 1)
        self.threads = [threading.Thread(target=self._one) for _ in range(count)]

    def __enter__(self) -> Streams:
        for thread in self.threads:
            thread.start()
        self.started.wait(60)  # every stream has its first bytes
        return self

    def __exit__(self, *_exc: object) -> None:
        for thread in self.threads:
            thread.join(120)

    def _one(self) -> None:
        body = {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                "max_tokens": self.tokens, "user": f"user-{next(_users)}",
                "stream_options": {"include_usage": True}}  # fmt: skip
        try:
            with httpx.stream("POST", self.gw.url + "/v1/chat/completions", json=body,
                              headers={"x-sluicegate-tier": "gold"}, timeout=60) as resp:  # fmt: skip
                chunks = resp.iter_bytes()
                first = next(chunks)
                self.started.wait(60)
                self.results.append((resp.status_code, (first + b"".join(chunks)).decode()))
        except Exception as exc:
            self.failures.append(repr(exc))
            self.started.abort()

    def check(self, count: int) -> None:
        """Every stream whole: 200, every token, no error event, ``[DONE]`` last."""
        assert self.failures == []
        assert len(self.results) == count
        for status, text in self.results:
            assert status == 200
            assert text.endswith("data: [DONE]\n\n"), text[-200:]
            events = [json.loads(line[6:]) for line in text.splitlines()
                      if line.startswith("data: {")]  # fmt: skip
            assert not any("error" in event for event in events), text[-300:]
            usage = [event["usage"] for event in events if event.get("usage")]
            assert usage and usage[-1]["completion_tokens"] == self.tokens


def test_reloads_under_load_drop_no_stream() -> None:
    with slow_pods() as (stable, new):
        def config(weights: tuple[int, int], total_s: int) -> dict[str, Any]:
            tiers = {"gold": {"timeouts": {"total_s": total_s}}}
            return canary_config(stable.url, new.url, weights=weights, reload=RELOAD, tiers=tiers)

        with GatewayProcess(config((50, 50), 120)) as gw:
            with Streams(gw, 30, 200) as streams:
                changes = [((90, 10), 100), ((10, 90), 90), ((50, 50), 80)]
                for weights, total_s in changes:
                    before = reloads(gw)
                    write_config(gw, config(weights, total_s))
                    assert reloaded(gw, before)
                    before = reloads(gw)
                    gw.proc.send_signal(signal.SIGHUP)
                    assert reloaded(gw, before)
                in_flight = [t for t in streams.threads if t.is_alive()]
                assert in_flight, "every stream ended before the reloads: make them longer"
            streams.check(30)
            assert gw.proc.poll() is None
            assert "Traceback" not in gw.log()


def test_a_promote_and_a_restarted_rollout_under_load_drop_no_stream() -> None:
    plan = {"steps": [5, 50], "min_hold_s": 3600, "min_samples": 10**6}
    with slow_pods() as (stable, new):
        config = canary_config(stable.url, new.url, plan, reload=RELOAD, tiers=GOLD)
        with GatewayProcess(config) as gw:
            with Streams(gw, 20, 200) as streams:
                promoted = httpx.post(gw.admin_url + "/admin/rollouts/llama-8b/promote", timeout=10).json()
                assert promoted["state"] == "promoted" and promoted["weights"]["canary"] == 100
                before = reloads(gw)
                again = {**plan, "steps": [1, 50]}
                write_config(gw, canary_config(stable.url, new.url, again, reload=RELOAD, tiers=GOLD))
                assert reloaded(gw, before)
                restarted = _rollout(gw)
                assert restarted is not None and restarted["weights"]["canary"] == 1
                aborted = httpx.post(gw.admin_url + "/admin/rollouts/llama-8b/abort", timeout=10).json()
                assert aborted["state"] == "rolled_back"
                assert any(t.is_alive() for t in streams.threads)
            streams.check(20)
            assert "Traceback" not in gw.log()


def test_static_pods_are_added_and_removed_by_a_reload() -> None:
    with PodsimProcess(["--model", "llama-8b", "--ttft-ms", "5", "--itl-ms", "2"]) as first, \
            PodsimProcess(["--model", "llama-8b", "--ttft-ms", "5", "--itl-ms", "2"]) as second:  # fmt: skip
        def config(*pods: tuple[str, str]) -> dict[str, Any]:
            listed = [{"name": name, "url": url, "models": ["llama-8b"]} for name, url in pods]
            return {"server": {"host": "127.0.0.1", "access_log": False}, "reload": RELOAD, "pods": listed}

        with GatewayProcess(config(("pod-a", first.url))) as gw:
            before = reloads(gw)
            write_config(gw, config(("pod-b", second.url)))
            assert reloaded(gw, before)
            assert wait_for(lambda: answer(gw).headers["x-sluicegate-pod"] == "pod-b", timeout_s=30)
            pods = httpx.get(gw.admin_url + "/admin/pods", timeout=10).json()["pods"]
            assert [pod["name"] for pod in pods] == ["pod-b"]


def test_without_a_config_file_a_reload_says_there_is_nothing_to_reload(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from gateway.app import Gateway
    from gateway.config_load import parse_config

    pods = [{"name": "a", "url": "http://127.0.0.1:9"}]
    gateway = Gateway(parse_config({"pods": pods, "auth": {"enabled": False}}))
    with caplog.at_level("WARNING", "sluicegate.reload"):
        outcome = asyncio.run(gateway.reloader.reload("SIGHUP"))
    assert outcome["outcome"] == "none"
    assert "runs without a config file; nothing to reload" in caplog.text
