"""The Locust scenario (loadtest/locustfile.py), run headless by the real ``locust`` command against a
real gateway with auth on, in front of simulated pods: one that answers fully, one that breaks every
stream after three tokens. Also the scenario's own microsecond histograms and SSE reading, which
are plain Python (importing Locust here would monkey-patch the test process with gevent).
"""

from __future__ import annotations

import csv
import json
import random
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from loadtest.locust_metrics import Histogram, Recorder, StreamTiming, Targets
from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from tests.keys import auth_on, key_store

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 12
FAST = ["--ttft-ms", "5", "--itl-ms", "2"]


@dataclass
class Target:
    url: str
    key: str


@dataclass
class Run:
    code: int
    output: str
    stats: dict[tuple[str, str], dict[str, str]]
    html: Path
    metrics: dict


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    store = tmp_path_factory.mktemp("locust-keys") / "keys.yaml"
    key = key_store(store, {"id": "load"})["load"]
    good = PodsimProcess(["--model", "llama-8b", *FAST])
    broken = PodsimProcess(["--model", "broken", *FAST, "--fault", "error_after=3"])
    with good, broken:
        config = {
            "server": {"host": "127.0.0.1", "access_log": False},
            "pods": [
                {"name": "good", "url": good.url, "models": ["llama-8b"]},
                {"name": "broken", "url": broken.url, "models": ["broken"]},
            ],
            "auth": auth_on(store),
        }
        with GatewayProcess(config) as gateway:
            yield Target(gateway.url, key)


def run_locust(target: Target, out: Path, *args: str, seconds: int = 4) -> Run:
    prefix, html, metrics = out / "locust", out / "report.html", out / "us.json"
    done = subprocess.run(
        [
            sys.executable, "-m", "locust", "-f", "loadtest/locustfile.py", "--headless",
            "-u", "5", "-r", "5", "-t", f"{seconds}s", "--host", target.url, "--api-key", target.key,
            "--max-tokens", str(MAX_TOKENS), "--csv", str(prefix), "--html", str(html),
            "--metrics-json", str(metrics), *args,
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    output = done.stdout + done.stderr
    stats = {}
    if prefix.with_name("locust_stats.csv").exists():
        with prefix.with_name("locust_stats.csv").open() as f:
            stats = {(row["Type"], row["Name"]): row for row in csv.DictReader(f)}
    data = json.loads(metrics.read_text()) if metrics.exists() else {}
    return Run(done.returncode, output, stats, html, data)


def test_a_headless_run_reports_streaming_metrics(target: Target, tmp_path: Path) -> None:
    run = run_locust(target, tmp_path)
    assert run.code == 0, run.output[-3000:]
    for kind in ("TTFT", "ITL", "TPOT", "E2E", "TOKENS"):
        row = run.stats[(kind, "llama-8b")]
        assert int(row["Request Count"]) > 0, kind
        assert int(row["Failure Count"]) == 0, kind
    assert int(run.stats[("POST", "/v1/chat/completions (headers)")]["Failure Count"]) == 0
    assert float(run.stats[("TOKENS", "llama-8b")]["Max Response Time"]) == MAX_TOKENS
    assert run.html.stat().st_size > 0

    m = run.metrics
    ok = m["requests"]["ok"]
    assert ok > 0 and m["requests"]["failed"] == 0
    ttft, e2e, itl = (m["latency_us"][k] for k in ("ttft", "e2e", "itl"))
    assert ttft["count"] == e2e["count"] == ok
    assert ttft["min"] > 0 and ttft["p50"] < e2e["p50"] and ttft["max"] < e2e["max"]
    assert itl["count"] == ok * (MAX_TOKENS - 1)  # every gap between content events, none lost
    tokens = m["output_tokens"]
    assert tokens["per_request"]["min"] == tokens["per_request"]["max"] == MAX_TOKENS
    assert tokens["total"] == ok * MAX_TOKENS
    assert tokens["requests_with_usage"] == ok and tokens["usage_mismatches"] == 0
    assert m["goodput"]["requests"] == ok  # no targets given: every complete answer counts
    assert "Sluicegate streaming metrics (microseconds)" in run.output


def test_broken_streams_are_failures_and_fail_the_run(target: Target, tmp_path: Path) -> None:
    run = run_locust(target, tmp_path, "--model", "broken", "--exit-code-on-error", "3", seconds=2)
    assert run.code == 3, run.output[-3000:]
    request = run.stats[("POST", "/v1/chat/completions (headers)")]
    assert int(request["Failure Count"]) == int(request["Request Count"]) > 0
    assert int(run.stats[("E2E", "broken")]["Failure Count"]) > 0
    assert ("TOKENS", "broken") not in run.stats  # no complete answer, so no token count
    assert run.metrics["requests"]["ok"] == 0 and run.metrics["requests"]["failed"] > 0
    assert run.metrics["latency_us"]["ttft"]["count"] > 0  # three tokens came before the error


def test_a_goodput_target_nobody_meets_counts_no_request(target: Target, tmp_path: Path) -> None:
    run = run_locust(target, tmp_path, "--goodput-ttft-ms", "0.001", seconds=2)
    assert run.code == 0, run.output[-3000:]
    assert run.metrics["requests"]["ok"] > 0
    assert run.metrics["goodput"] == {"targets": {"ttft_ms": 0.001, "tpot_ms": None, "e2e_ms": None},
                                      "requests": 0, "per_s": 0.0}  # fmt: skip


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [("--prompts", "/nonexistent/prompts.jsonl", "cannot read the prompts file"),
     ("--max-tokens", "-1", "--max-tokens must not be negative")],
)  # fmt: skip
def test_bad_options_get_one_line_and_exit_2(flag: str, value: str, message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "locust", "-f", "loadtest/locustfile.py", "--headless", "-t", "1s",
         "--host", "http://127.0.0.1:9", flag, value],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert f"locustfile: {message}" in done.stderr
    assert "Traceback" not in done.stderr


def test_histogram_percentiles_stay_within_its_precision() -> None:
    rng = random.Random(7)
    values = [int(rng.lognormvariate(9, 1.5)) for _ in range(20_000)]
    hist, halves = Histogram(), (Histogram(), Histogram())
    for i, v in enumerate(values):
        hist.add(v)
        halves[i % 2].add(v)
    ordered = sorted(values)
    for q in (50, 90, 99):
        exact = ordered[-(-len(ordered) * q // 100) - 1]
        assert abs(hist.percentile(q) - exact) <= max(1, exact / 2048), q
    merged = Histogram.from_wire(halves[0].to_wire())
    merged.merge(Histogram.from_wire(halves[1].to_wire()))
    assert merged.summary() == hist.summary()
    assert (hist.min, hist.max) == (min(values), max(values))


def test_histogram_is_exact_for_small_values() -> None:
    hist = Histogram()
    for v in (3, 1, 2, 2047):
        hist.add(v)
    assert (hist.percentile(50), hist.percentile(75), hist.percentile(100)) == (2, 3, 2047)


def chunk(delta: dict) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "delta": delta}]}).encode()


def test_first_token_is_the_first_content_not_the_role_chunk() -> None:
    stream = StreamTiming(sent=10.0)
    stream.feed(b": keep-alive", 10.1)
    stream.feed(chunk({"role": "assistant", "content": ""}), 10.2)
    stream.feed(chunk({"reasoning_content": "hmm"}), 10.5)
    stream.feed(b"", 10.5)
    stream.feed(chunk({"content": "Hi"}), 10.7)
    stream.feed(b'data: {"choices": [], "usage": {"completion_tokens": 3}}', 10.8)
    stream.feed(b"data: [DONE]", 11.0)
    assert stream.failure() is None
    assert stream.ttft_s == pytest.approx(0.5)
    assert stream.e2e_s == pytest.approx(1.0)
    assert stream.gaps_s() == [pytest.approx(0.2)]
    assert stream.tokens == 3 and stream.mismatch  # usage says 3, two content events were seen
    assert stream.tpot_s == pytest.approx(0.25)


def test_streams_that_do_not_finish_are_failures() -> None:
    cut = StreamTiming(sent=0.0)
    cut.feed(chunk({"content": "a"}), 0.1)
    assert cut.failure() == "the stream ended without data: [DONE]"
    errored = StreamTiming(sent=0.0)
    errored.feed(b'data: {"error": {"message": "boom"}}', 0.1)
    assert "boom" in (errored.failure() or "")
    recorder = Recorder()
    recorder.record(cut, Targets(), None)
    recorder.record(errored, Targets(), None)
    assert recorder.counters["failed"] == 2 and recorder.counters["ok"] == 0
