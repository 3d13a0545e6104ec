"""How fast a bad canary is stopped: a rollout at 5% through a real gateway, timed to its rollback.

Each scenario starts a fresh stable pod, canary pod and gateway, whose route ``bench-model`` has a
rollout plan (steps 5 → 25 → 50 → 100 %, each held 30 s and 100 clean samples per variant). An
open-loop generator sends short streams at a fixed rate, each from a fresh ``user``, so the split is
by weight, not by a few sticky callers. The rollout is read where an operator reads it,
``GET /admin/rollouts``, every 0.5 s; the clock runs from the first request to the poll that sees
``rolled_back`` (or ``promoted``, or the end of ``--duration``).

Scenarios (the stable pod is the same in each):

- ``aa``: the canary is the same as stable. No rollback is expected.
- ``ttft``: the canary is 2x slower to its first token (podsim ``--ttft-ms``).
- ``errors``: 5% of streams fail on the canary. podsim's faults are per process or per request, and
  the generator cannot know which variant a fresh user lands on, so the canary pod carries the
  process fault ``error_after=6`` (vLLM's mid-stream error event after 6 tokens), and 5% of all
  requests ask for 12 tokens where the rest ask for 4: exactly those fail, on the canary only.
- ``stalls``: the same, with ``stall_after=6`` (silence, connection open) and the gateway's stall
  timeout at 2 s.

    python -m loadtest.bench_canary [--duration 180] [--rate 50] [--weight 5] [--scenarios ttft,errors]
                                    [--write-md docs/benchmarks.md] [--section canary]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from gateway.rlimits import raise_open_file_limit
from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from loadtest.report import command_line, publish

MODEL = "bench-model"
STABLE_TTFT_MS = 20
SHORT_TOKENS, LONG_TOKENS, FAULT_AT = 4, 12, 6
FAULTY_EVERY = 20  # one request in 20 (5%) asks for LONG_TOKENS and so reaches the canary's fault
STALL_TIMEOUT_S = 2.0
POLL_S = 0.5
_POD_ARGS = ["--model", MODEL, "--itl-ms", "5", "--itl-per-seq-ms", "0", "--max-num-seqs", "1024",
             "--kv-blocks", "400000", "--log-level", "warning"]  # fmt: skip


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    canary_args: tuple[str, ...]


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("aa", "A/A: canary same as stable", ("--ttft-ms", str(STABLE_TTFT_MS))),
        Scenario("ttft", "canary 2x slower to first token", ("--ttft-ms", str(2 * STABLE_TTFT_MS))),
        Scenario("errors", "canary fails 5% of streams",
                 ("--ttft-ms", str(STABLE_TTFT_MS), "--fault", f"error_after={FAULT_AT}")),
        Scenario("stalls", "canary stalls 5% of streams",
                 ("--ttft-ms", str(STABLE_TTFT_MS), "--fault", f"stall_after={FAULT_AT}")),
    )
}  # fmt: skip


@dataclass
class Run:
    """One scenario's requests (send time, pod that served it) and what the rollout did."""

    scenario: Scenario
    sent: list[tuple[float, str | None]] = field(default_factory=list)
    outcome: str = "progressing"
    ended_at: float = 0.0
    triggered: list[str] = field(default_factory=list)
    reason: str = ""
    step_percent: float = 0.0


def gateway_config(stable_url: str, canary_url: str, weight: float) -> dict[str, Any]:
    steps = [weight, *(s for s in (25, 50, 100) if s > weight)]
    return {
        "server": {"host": "127.0.0.1", "access_log": False},
        "timeouts": {"stall_s": STALL_TIMEOUT_S},
        "pods": [
            {"name": "stable-1", "url": stable_url, "models": [MODEL], "labels": {"variant": "stable"}},
            {"name": "canary-1", "url": canary_url, "models": [MODEL], "labels": {"variant": "canary"}},
        ],
        "routes": {MODEL: {"sticky": "user", "variants": {
            "stable": {"pods": {"variant": "stable"}, "weight": 100 - weight},
            "canary": {"pods": {"variant": "canary"}, "weight": weight},
        }, "rollout": {"steps": steps, "min_hold_s": 30, "min_samples": 100}}},
    }  # fmt: skip


async def _one(client: httpx.AsyncClient, url: str, n: int, run: Run, started: float) -> None:
    tokens = LONG_TOKENS if n % FAULTY_EVERY == FAULTY_EVERY - 1 else SHORT_TOKENS
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "max_tokens": tokens, "user": f"bench-{n}"}  # fmt: skip
    index = len(run.sent)
    run.sent.append((time.monotonic() - started, None))
    try:
        async with client.stream("POST", url, json=body) as resp:
            run.sent[index] = (run.sent[index][0], resp.headers.get("x-sluicegate-pod"))
            async for _ in resp.aiter_bytes():
                pass
    except httpx.HTTPError:
        pass  # the pod header, if it came, is what counts here; the judge counts the failure


async def _watch(
    client: httpx.AsyncClient, admin_url: str, run: Run, started: float, duration: float
) -> None:
    """Poll the rollout until it is rolled back or promoted, or the time is up."""
    while True:
        await asyncio.sleep(POLL_S)
        elapsed = time.monotonic() - started
        status = (await client.get(admin_url + "/admin/rollouts")).json()["rollouts"][0]
        run.outcome, run.ended_at, run.step_percent = status["state"], elapsed, status["percent"]
        if status["state"] in ("rolled_back", "promoted") or elapsed >= duration:
            if status["state"] == "rolled_back":
                event = next(e for e in reversed(status["history"]) if e["what"] == "rolled_back")
                run.triggered, run.reason, run.step_percent = (
                    event["triggered"],
                    event["reason"],
                    event["percent"],
                )
            return


async def drive(gw: GatewayProcess, run: Run, rate: float, duration: float) -> None:
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        started = time.monotonic()
        watcher = asyncio.create_task(_watch(client, gw.admin_url, run, started, duration))
        tasks: list[asyncio.Task[None]] = []
        url = gw.url + "/v1/chat/completions"
        for n in itertools.count():
            delay = started + n / rate - time.monotonic()
            if delay > 0:
                await asyncio.wait([watcher], timeout=delay)
            if watcher.done():
                break
            tasks.append(asyncio.create_task(_one(client, url, n, run, started)))
        await watcher
        if tasks:
            await asyncio.wait(tasks, timeout=STALL_TIMEOUT_S + 10)
        for task in tasks:
            task.cancel()


def run_scenario(scenario: Scenario, rate: float, weight: float, duration: float) -> Run:
    run = Run(scenario)
    with PodsimProcess([*_POD_ARGS, "--ttft-ms", str(STABLE_TTFT_MS)]) as stable, \
            PodsimProcess([*_POD_ARGS, *scenario.canary_args]) as canary, \
            GatewayProcess(gateway_config(stable.url, canary.url, weight)) as gw:  # fmt: skip
        asyncio.run(drive(gw, run, rate, duration))
    return run


def render(runs: list[Run], command: str, rate: float, weight: float) -> str:
    lines = [
        f"Command: `{command}`",
        "",
        f"{rate:g} requests/s of {SHORT_TOKENS}-token streams from fresh users, canary at {weight:g}% "
        f"(steps held 30 s and 100 clean samples per variant); time from the first request to the "
        f"admin API's first poll (every {POLL_S:g} s) showing the outcome.",
        "",
        "| scenario | outcome | seconds | canary requests | total requests | triggered | reason |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in runs:
        by_then = [pod for at, pod in r.sent if at <= r.ended_at]
        canary = sum(pod == "canary-1" for pod in by_then)
        outcome = r.outcome if r.outcome != "progressing" else f"progressing (at {r.step_percent:g}%)"
        if r.outcome == "rolled_back":
            outcome = f"rolled back at {r.step_percent:g}%"
        triggered = ", ".join(r.triggered) or "-"
        reason = (r.reason or "-").replace("|", "/")
        lines.append(
            f"| {r.scenario.what} | {outcome} | {r.ended_at:.1f} | {canary} | {len(by_then)} | {triggered} "
            f"| {reason} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_canary",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("--duration", type=float, default=180.0, help="seconds at most per scenario")
    parser.add_argument("--rate", type=float, default=50.0, help="requests per second")
    parser.add_argument("--weight", type=float, default=5.0, help="the canary's first step, in percent")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"comma-separated, of: {', '.join(SCENARIOS)}")  # fmt: skip
    parser.add_argument("--write-md", metavar="FILE")
    parser.add_argument("--section", default="canary", help="the marked section of --write-md to replace")
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.scenarios.split(",") if name.strip()]
    unknown = [name for name in names if name not in SCENARIOS]
    if unknown or not names:
        parser.error(f"unknown scenario {', '.join(unknown) or '(none)'}; known: {', '.join(SCENARIOS)}")
    if not (0 < args.weight < 100 and args.rate > 0 and args.duration > 0):
        parser.error("--weight must be in (0, 100), --rate and --duration positive")
    raise_open_file_limit()
    runs = [run_scenario(SCENARIOS[name], args.rate, args.weight, args.duration) for name in names]
    publish(render(runs, command_line("loadtest.bench_canary", argv), args.rate, args.weight), args.write_md,
            args.section)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
