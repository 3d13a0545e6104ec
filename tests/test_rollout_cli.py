"""``sluicegate rollout`` against a real gateway process: status as an operator reads it, the four
controls, and every refusal (unknown model, a control the state forbids, no key, a key without the
admin right, no gateway at all) as one line and exit status 2.

The gateway runs with auth on (a key store holding an admin key and an ordinary one) and a rollout
whose hold is too long to advance by itself, so only the CLI moves it.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.cli import main
from loadtest.procs import GatewayProcess
from tests.canary import canary_config, canary_pods
from tests.conftest import wait_for
from tests.keys import auth_on, key_store


class Gateway:
    def __init__(self, gw: GatewayProcess, keys: dict[str, str]) -> None:
        self.gw = gw
        self.admin = keys["ops"]
        self.user = keys["alice"]

    def cli(self, *argv: str, key: str | None = "admin") -> list[str]:
        chosen = {"admin": self.admin, "user": self.user}.get(key or "")
        return ["rollout", *argv, "--admin-url", self.gw.admin_url, *(["--key", chosen] if chosen else [])]


@pytest.fixture
def gateway(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Gateway]:
    monkeypatch.delenv("SLUICEGATE_ADMIN_KEY", raising=False)
    keys = key_store(tmp_path / "keys.yaml", {"id": "ops", "rights": ["admin"]}, {"id": "alice"})
    with canary_pods() as (stable, new):
        plan = {"steps": [25, 100], "min_hold_s": 3600, "min_samples": 10**6}
        config = canary_config(stable.url, new.url, plan, auth=auth_on(tmp_path / "keys.yaml"))
        with GatewayProcess(config) as gw:
            yield Gateway(gw, keys)


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_status_summarises_each_rollout_and_json_is_the_apis(
    gateway: Gateway, capsys: pytest.CaptureFixture[str]
) -> None:
    body = {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    auth = {"Authorization": f"Bearer {gateway.user}"}
    for n in range(6):
        resp = httpx.post(
            gateway.gw.url + "/v1/chat/completions", json={**body, "user": f"u{n}"}, headers=auth
        )
        assert resp.status_code == 200, resp.text
    admin = {"Authorization": f"Bearer {gateway.admin}"}

    def api() -> dict:
        return httpx.get(gateway.gw.admin_url + "/admin/rollouts", headers=admin).json()["rollouts"][0]

    assert sum(sum(v.values()) for v in api()["samples"].values()) == 6  # each stream reached the judge
    assert wait_for(lambda: api()["verdict"] is not None)  # the once-a-second tick has judged

    code, out, err = run(gateway.cli("status"), capsys)
    assert (code, err) == (0, "")
    assert out.startswith("llama-8b: progressing\n"), out
    assert "step      1 of 2 (25% -> 100%)" in out
    assert "weights   canary 25%, stable 75%" in out
    assert "need 1000000 clean per variant" in out
    assert "verdict   continue: inconclusive" in out, out
    assert "last      started" in out

    code, out, _ = run(gateway.cli("status", "llama-8b", "--json"), capsys)
    status = json.loads(out)["rollouts"][0]
    assert code == 0 and status["route"] == "llama-8b" and status["weights"] == {"stable": 75, "canary": 25}
    assert sum(sum(v.values()) for v in status["samples"].values()) == 6


def test_the_controls_steer_and_refusals_are_one_line_and_exit_2(
    gateway: Gateway, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(gateway.cli("pause", "llama-8b", "--why", "watching TTFT"), capsys)
    assert code == 0 and out.startswith("llama-8b: paused\n")
    assert "last      paused: watching TTFT" in out
    code, out, _ = run(gateway.cli("resume", "llama-8b"), capsys)
    assert code == 0 and out.startswith("llama-8b: progressing\n")

    code, out, err = run(gateway.cli("resume", "llama-8b"), capsys)  # not paused: 409
    assert (code, out) == (2, "") and err.startswith("sluicegate rollout: 409: ") and err.count("\n") == 1
    code, out, err = run(gateway.cli("abort", "nope"), capsys)
    assert code == 2 and err == "sluicegate rollout: 404: No rollout for that model.\n"
    code, _, err = run(gateway.cli("status", "nope"), capsys)
    assert code == 2 and err == "sluicegate rollout: no rollout for model 'nope'\n"
    code, _, err = run(gateway.cli("abort"), capsys)
    assert code == 2 and err == "sluicegate rollout: abort needs a MODEL\n"

    code, out, _ = run(gateway.cli("abort", "llama-8b", "--why", "bad smell", "--json"), capsys)
    aborted = json.loads(out)
    assert code == 0 and aborted["state"] == "rolled_back" and aborted["weights"]["canary"] == 0
    assert aborted["history"][-1]["reason"] == "bad smell"
    code, out, _ = run(gateway.cli("status"), capsys)
    assert out.startswith("llama-8b: rolled_back\n") and "weights   canary 0%, stable 100%" in out
    code, _, err = run(gateway.cli("promote", "llama-8b"), capsys)  # nothing after a rollback
    assert code == 2 and err.startswith("sluicegate rollout: 409: ")


def test_keys_are_checked_and_the_environment_supplies_one(
    gateway: Gateway, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, err = run(gateway.cli("status", key=None), capsys)
    assert (code, out) == (2, "") and err.startswith("sluicegate rollout: 401: ") and err.count("\n") == 1
    code, _, err = run(gateway.cli("pause", "llama-8b", key="user"), capsys)
    assert code == 2 and err.startswith("sluicegate rollout: 403: ") and "admin" in err
    assert httpx.get(gateway.gw.admin_url + "/admin/rollouts",
                     headers={"Authorization": f"Bearer {gateway.admin}"}).json()["rollouts"][0]["state"] \
        == "progressing"  # fmt: skip  # the refused pause changed nothing
    monkeypatch.setenv("SLUICEGATE_ADMIN_KEY", gateway.admin)
    code, out, _ = run(gateway.cli("pause", "llama-8b", key=None), capsys)
    assert code == 0 and out.startswith("llama-8b: paused\n")


def test_no_gateway_at_the_admin_url_is_one_line_and_exit_2() -> None:
    with socket.socket() as bound:  # bound, never listening: connections to it are refused
        bound.bind(("127.0.0.1", 0))
        port = bound.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "gateway.cli",
                "rollout",
                "status",
                "--admin-url",
                f"http://127.0.0.1:{port}",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(
        f"sluicegate rollout: cannot reach the admin API at http://127.0.0.1:{port}: "
    )
    assert done.stderr.count("\n") == 1
