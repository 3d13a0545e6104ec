"""``sluicegate loadtest`` against a real gateway and pod simulator: what it reports, and why open loop.

One pod paced at a known inter-token latency sits behind one gateway that listens for HTTP/1.1 and
h2c, for TLS, and for HTTP/3. The stall test switches a process fault on the pod (every new
request's first token 1.5 s late) while a closed-loop and then an open-loop run are under way: the
closed loop stops sending while stalled, so the stall is a handful of its samples; the open loop
keeps its schedule, so the stall shows as latency from the schedule and, behind an in-flight cap,
as dispatch delay.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtest.drive import Driver, Plan, Prompt, Record, arrival_offsets
from loadtest.loadgen import count_tokens
from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess, free_tcp_and_udp_port
from loadtest.results import summarize
from transports.tls import self_signed

MODEL = "llama-8b"
ITL_MS = 20.0  # the pod's pacing: time per output token is about this
TOKENS = 4
STALL_S = 1.5
PROMPTS = [Prompt("How does a sluice gate work?", TOKENS)]


@dataclass
class Setup:
    pod: PodsimProcess
    gateway: GatewayProcess
    https: str
    cert: Path


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    cert, key = self_signed(tmp_path_factory.mktemp("tls"))
    port = free_tcp_and_udp_port()
    with PodsimProcess(["--model", MODEL, "--ttft-ms", "5", "--itl-ms", str(ITL_MS)]) as pod:
        config = {
            "server": {
                "host": "127.0.0.1", "access_log": False,
                "tls": {"cert": str(cert), "key": str(key), "port": port},
            },
            "pods": [{"name": "pod-a", "url": pod.url, "models": [MODEL]}],
        }
        with GatewayProcess(config) as gateway:
            yield Setup(pod, gateway, f"https://localhost:{port}", cert)


def test_tokens_are_content_or_reasoning_events_not_the_role_chunk() -> None:
    def event(delta: dict[str, str]) -> bytes:
        return b"data: " + json.dumps({"choices": [{"index": 0, "delta": delta}]}).encode() + b"\n\n"

    role = event({"role": "assistant", "content": ""})
    assert count_tokens(role) == 0
    assert count_tokens(role + event({"reasoning_content": "hm"}) + event({"content": "Hi"})) == 2


def loadtest(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "loadtest", *argv],
        capture_output=True, text=True, timeout=120, check=False,
    )


def summary_of(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert done.returncode == 0, done.stderr + done.stdout[:2000]
    return json.loads(done.stdout)


def test_closed_loop_summary_and_raw_lines(setup: Setup, tmp_path: Path) -> None:
    raw = tmp_path / "raw.jsonl"
    out = tmp_path / "summary.json"
    done = loadtest(setup.gateway.url, "--model", MODEL, "--concurrency", "3", "--requests", "9",
                    "--max-tokens", str(TOKENS), "--raw", str(raw), "--json", str(out))
    assert done.returncode == 0, done.stderr + done.stdout[:2000]
    summary = json.loads(out.read_text())
    assert summary["schema"] == "sluicegate.loadtest/1" and summary["config"]["mode"] == "closed"
    assert summary["requests"] | {"error_kinds": None} == {
        "scheduled": 9, "sent": 9, "ok": 9, "errors": 0, "error_rate": 0.0, "error_kinds": None,
        "error_samples": [],
    }
    # the server's usage and the content events agree, request by request
    assert summary["tokens"] == {"output": 9 * TOKENS, "seen": 9 * TOKENS, "usage_mismatch_requests": 0,
                                 "usage_missing_requests": 0}
    ttft, e2e = summary["ttft_ms"], summary["e2e_ms"]
    assert ttft["count"] == e2e["count"] == 9 and 0 < ttft["p50"] <= ttft["p99"] <= e2e["p99"]
    assert summary["itl_ms"]["count"] == 9 * (TOKENS - 1)
    assert summary["loadgen"]["peak_inflight"] == 3
    assert summary["by_transport"]["h1"]["ok"] == 9 and summary["by_pod"]["pod-a"]["ok"] == 9
    assert summary["goodput"] is None
    lines = [json.loads(line) for line in raw.read_text().splitlines()]
    assert sorted(line["index"] for line in lines) == list(range(9))
    for line in lines:
        assert line["status"] == 200 and line["error"] is None and line["transport"] == "h1"
        assert line["output_tokens"] == line["tokens_seen"] == TOKENS and len(line["itl_ms"]) == TOKENS - 1
        assert line["pod"] == "pod-a" and line["variant"] is None  # the gateway names no variant here
        assert line["response_ms"] == pytest.approx(line["e2e_ms"] + line["dispatch_delay_ms"], abs=0.01)


def test_open_loop_poisson_sends_the_seeded_schedule(setup: Setup, tmp_path: Path) -> None:
    raw = tmp_path / "raw.jsonl"
    done = loadtest(setup.gateway.url, "--model", MODEL, "--rate", "40", "--arrivals", "poisson",
                    "--seed", "7", "--requests", "12", "--max-tokens", "2", "--raw", str(raw))
    summary = summary_of(done)
    assert summary["requests"]["scheduled"] == summary["requests"]["ok"] == 12
    assert summary["config"]["arrivals"] == "poisson" and summary["config"]["mode"] == "open"
    assert summary["dispatch_delay_ms"]["count"] == 12
    scheduled = sorted(json.loads(line)["scheduled_ms"] for line in raw.read_text().splitlines())
    expected = [round(at * 1000, 3) for at in islice(arrival_offsets(40, "poisson", 7), 12)]
    assert scheduled == pytest.approx(expected, abs=0.002)


@pytest.mark.parametrize(("target_ms", "fraction"), [(3 * ITL_MS, 1.0), (ITL_MS / 3, 0.0)])
def test_goodput_counts_requests_against_the_targets(setup: Setup, target_ms: float, fraction: float) -> None:
    done = loadtest(setup.gateway.url, "--model", MODEL, "--concurrency", "2", "--requests", "6",
                    "--max-tokens", "6", "--goodput", f"tpot_ms={target_ms},ttft_ms=60000")
    summary = summary_of(done)
    goodput = summary["goodput"]
    assert goodput["targets"] == {"tpot_ms": target_ms, "ttft_ms": 60000.0}
    assert goodput["fraction"] == fraction and goodput["requests"] == 6 * fraction
    assert goodput["per_s"] == pytest.approx(6 * fraction / summary["wall_s"], rel=0.01)


def test_a_sweep_runs_each_level_and_names_a_knee(setup: Setup) -> None:
    done = loadtest(setup.gateway.url, "--model", MODEL, "--concurrency", "1", "--sweep", "1,2",
                    "--requests", "4", "--max-tokens", "2")
    sweep = summary_of(done)
    assert sweep["schema"] == "sluicegate.loadtest.sweep/1" and sweep["stopped"] is None
    assert [level["config"]["concurrency"] for level in sweep["levels"]] == [1, 2]
    assert sweep["knee"] in (1, 2)


@pytest.mark.parametrize("transport", ["h2", "grpc-web", "h3"])
def test_each_transport_carries_a_few_requests(setup: Setup, transport: str) -> None:
    url = setup.https if transport == "h3" else setup.gateway.url
    done = loadtest(url, "--model", MODEL, "--concurrency", "2", "--requests", "4", "--max-tokens", "3",
                    "--transport", transport, "--cacert", str(setup.cert))
    summary = summary_of(done)
    assert summary["requests"]["ok"] == 4, summary["requests"]
    assert list(summary["by_transport"]) == [transport]
    assert summary["tokens"]["seen"] == 12 and summary["ttft_ms"]["count"] == 4


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", MODEL, "--concurrency", "2"], "--duration S or --requests N"),
        (["--model", MODEL, "--rate", "5", "--concurrency", "2", "--requests", "3"], "not allowed with"),
        (["--model", MODEL, "--rate", "-1", "--requests", "3"], "--rate"),
        (["--model", MODEL, "--rate", "5", "--requests", "3", "--goodput", "ttft=5"], "--goodput"),
        (["--model", MODEL, "--rate", "5", "--requests", "3", "--sweep", "1,x"], "--sweep"),
        (["--model", MODEL, "--concurrency", "2", "--requests", "3", "--arrivals", "poisson"], "--rate"),
        (["--model", MODEL, "--rate", "5", "--requests", "3", "--prompts", "/no/such.jsonl"], "--prompts"),
        (["--model", MODEL, "--rate", "5", "--requests", "3", "--transport", "h3"], "https://"),
    ],
)
def test_bad_flags_are_one_clear_error_and_exit_2(argv: list[str], message: str) -> None:
    done = loadtest("http://127.0.0.1:9", *argv)
    assert done.returncode == 2 and done.stdout == ""
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in done.stderr


# -- the stall: closed loop hides it, open loop reports it --------------------------------------------


async def run_with_stall(setup: Setup, plan: Plan, after: int) -> tuple[list[Record], float, float, Any]:
    """Run ``plan``; once ``after`` requests have ended, stall the pod for STALL_S.

    Returns the records, the stall window (perf_counter) and the run's result.
    """
    reached = asyncio.Event()

    def on_record(_record: Record) -> None:
        if len(driver.records) >= after:
            reached.set()

    driver = Driver(plan, on_record)
    window: list[float] = []

    async def stall() -> None:
        await reached.wait()
        async with httpx.AsyncClient() as http:
            await http.post(setup.pod.url + "/admin/faults", json={"first_token_delay_ms": STALL_S * 1000})
            window.append(time.perf_counter())
            await asyncio.sleep(STALL_S)  # the stall's length itself, not a wait for something
            window.append(time.perf_counter())
            await http.delete(setup.pod.url + "/admin/faults")

    staller = asyncio.create_task(stall())
    result = await driver.run()
    await staller
    return result.records, window[0], window[1], result


async def test_open_loop_reports_a_stall_that_closed_loop_hides(setup: Setup) -> None:
    base = {"base_url": setup.gateway.url, "model": MODEL, "prompts": PROMPTS, "requests": 60}
    closed_records, start, end, closed = await run_with_stall(setup, Plan(**base, concurrency=2), after=10)
    closed_summary = summarize(closed, {}, None)
    rate = 20.0
    open_records, o_start, o_end, opened = await run_with_stall(
        setup, Plan(**base, rate=rate, max_inflight=8), after=10
    )
    open_summary = summarize(opened, {}, None)
    assert closed_summary["requests"]["ok"] == open_summary["requests"]["ok"] == 60
    stall_ms = STALL_S * 1000

    # Closed loop: each worker has at most one request stalled and one more sent just before; the
    # stall is a few samples out of 60, so even its p90 stays far below it.
    sent_in_stall = sum(start <= r.sent <= end for r in closed_records)
    assert sent_in_stall <= 2 * 2
    assert closed_summary["response_ms"]["p90"] < stall_ms
    assert closed_summary["response_ms"]["count"] == 60

    # Open loop: the schedule went on through the stall...
    scheduled_in_stall = sum(o_start <= r.scheduled <= o_end for r in open_records)
    assert scheduled_in_stall >= rate * STALL_S / 2
    # ...so latency from the schedule shows it at the tail, and the requests the in-flight cap held
    # back show it as dispatch delay, which a generator timing from the real send would not see.
    assert open_summary["response_ms"]["p99"] >= 0.9 * stall_ms
    assert open_summary["dispatch_delay_ms"]["max"] >= stall_ms / 2
    assert open_summary["dispatch_delay_ms"]["p50"] > 0
