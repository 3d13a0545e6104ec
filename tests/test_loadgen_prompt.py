"""``loadgen --prompt-chars`` and the bench's long-prompt scenario: load with prompts as long as real ones.

A gateway's memory per stream grows with the prompt it holds (``docs/benchmarks.md``, "Long
prompts"), so a load test must be able to send prompts of the size its users send; the pod
simulator counts the words it was given, as vLLM counts prompt tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from loadtest.bench import Row, check_targets
from loadtest.loadgen import long_prompt
from loadtest.podsim.launch import PodsimProcess
from tests.test_podsim import metric_value

MODEL = "prompt-model"


def _prompt_tokens(pod: PodsimProcess) -> float:
    return metric_value(pod.url, "vllm:prompt_tokens", "vllm:prompt_tokens_total")


@pytest.mark.parametrize("chars", [1, 5000])
def test_a_long_prompt_is_exactly_that_long(chars: int) -> None:
    prompt = long_prompt(chars)
    assert len(prompt) == chars
    assert prompt.split()[0] == "Sentence"[:chars]


def test_the_pod_is_sent_the_long_prompt() -> None:
    with PodsimProcess(["--model", MODEL, "--ttft-ms", "0", "--itl-ms", "1"]) as pod:
        before = _prompt_tokens(pod)
        done = subprocess.run(
            [sys.executable, "-m", "loadtest.loadgen", pod.url + "/v1/chat/completions", "--model", MODEL,
             "--streams", "2", "--max-tokens", "4", "--prompt-chars", "6400"],
            capture_output=True, text=True, timeout=60,
        )
        summary = json.loads(done.stdout.splitlines()[-1])
        assert summary["errors"] == 0 and summary["ok"] == 2, summary["error_samples"]
        # the simulator counts words, plus 2 for the chat and 4 for the message: 6400 characters are
        # 100 sentences of 12 words and the next one's first word
        per_request = (_prompt_tokens(pod) - before) / 2
        assert per_request == 2 + 4 + 100 * 12 + 1


def test_a_negative_prompt_size_is_one_clear_error() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "loadtest.loadgen", "http://127.0.0.1:9/v1/chat/completions", "--model", MODEL,
         "--prompt-chars", "-1"],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode != 0
    assert done.stderr.strip() == "loadgen: --prompt-chars must be 0 or more"


def _row(scenario: str, target: str, cpu: float, rss: float) -> Row:
    return Row(scenario, target, 1, 10, 10, 0, 10, 10, 1.0, 2.0, 100.0, cpu / 2, cpu / 2, rss, 0.2, [])


def test_the_long_prompt_scenario_reports_its_memory_and_is_no_cpu_target() -> None:
    lines = check_targets([
        _row("d", "gateway", 20.0, 110.0), _row("d", "nginx", 10.0, 50.0),
        _row("f", "gateway", 20.0, 125.0), _row("f", "nginx", 10.0, 62.5),
    ])
    assert "- MISSED: (d) CPU per 1000 tokens 20.0, nginx's 10.0: 2.00x (<= 1.5x)" in lines
    assert "- reported: (f) CPU per 1000 tokens 20.0, nginx's 10.0: 2.00x (<= 1.5x)" in lines
    assert "- reported: (f) peak RSS 125 MiB, nginx's 62 MiB: 2.00x" in lines
    assert "- MISSED: (d) peak RSS 110 MiB, nginx's 50 MiB: 2.20x (<= 1.2x)" in lines


def _ttft_row(target: str, ttft_p50: float) -> Row:
    row = _row("a", target, 30.0, 50.0)
    row.ttft_p50 = ttft_p50
    return row


def test_the_ttft_target_names_what_nginx_and_the_floor_added_in_the_same_run() -> None:
    """Added TTFT moves with the machine's wake-ups as much as with the gateway: the verdict line
    says what the same run's nginx and bare uvloop relay added, so an hour when even the floor
    misses 0.3 ms reads as such."""
    lines = check_targets([
        _ttft_row("direct", 0.41), _ttft_row("gateway", 0.82), _ttft_row("nginx", 0.49),
        _ttft_row("floor", 0.80),
    ])
    expected = "- MISSED: added TTFT p50 at 1 stream 0.41 ms (<= 0.3 ms)"
    assert f"{expected}; nginx +0.08, the floor +0.39 in the same run" in lines
    alone = check_targets([_ttft_row("direct", 0.41), _ttft_row("gateway", 0.62)])
    assert "- met: added TTFT p50 at 1 stream 0.21 ms (<= 0.3 ms)" in alone
