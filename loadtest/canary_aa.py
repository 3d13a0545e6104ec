"""Seeded rollouts through real gateways: does a canary identical to stable ever roll back?

The judge's own simulations (tests/test_canary_judge.py) test the statistics; this tests the whole
loop: real pods, a real gateway feeding the judge from finished requests and ticking it once a
second, the weights swapped by the rollout, read back from ``GET /admin/rollouts``.

A *run* is one (scenario, seed): its own route (public model ``aa-<scenario>-<seed>``) with its own
rollout plan and so its own judge, and its own closed-loop load of short streams, each from a fresh
``user`` named by the seed, so the seed picks which requests land on the canary. A *batch* puts
``--per-gateway`` runs in one gateway process, over one stable pod simulator and one canary pod per
scenario in the batch, the pods drawing their time to first token with log-normal jitter
(``--ttft-jitter``) seeded from the batch's seeds. Runs share the gateway and the pods (so they are
cheap), never a judge (so their verdicts are separate trials). Real time makes a run reproducible in
its inputs, not to the millisecond.

Scenarios: ``aa`` (canary pod the same as stable), ``ttft`` (canary 2x slower to its first token),
``errors`` and ``stalls`` (5% of streams: as in ``loadtest.bench_canary``, one request in 20 asks
for 12 tokens where the rest ask for 4, and only the canary pod has the fault after 6 tokens).

    python -m loadtest.canary_aa [--runs 50] [--scenarios aa] [--per-gateway 10] [--json FILE]
                                 [--write-md docs/canary.md] [--section canary-aa]

Exit status 1 if any A/A run rolled back.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from gateway.rlimits import raise_open_file_limit
from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from loadtest.report import command_line, publish

TTFT_MS, ITL_MS, JITTER = 10, 2, 0.3
SHORT_TOKENS, LONG_TOKENS, FAULT_AT, FAULTY_EVERY = 4, 12, 6, 20
STALL_TIMEOUT_S = 2.0
POLL_S = 0.25
DONE = ("promoted", "rolled_back")
OVER = (*DONE, "unfinished")  # the run's callers stop
_POD_ARGS = ["--itl-ms", str(ITL_MS), "--itl-per-seq-ms", "0", "--ttft-jitter", str(JITTER),
             "--max-num-seqs", "1024", "--kv-blocks", "400000", "--log-level", "warning"]  # fmt: skip


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    canary_args: tuple[str, ...]
    bad: bool  # the judge should roll it back


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("aa", "A/A: canary same as stable", ("--ttft-ms", str(TTFT_MS)), False),
        Scenario("ttft", "canary 2x slower to first token", ("--ttft-ms", str(2 * TTFT_MS)), True),
        Scenario("errors", "canary fails 5% of streams",
                 ("--ttft-ms", str(TTFT_MS), "--fault", f"error_after={FAULT_AT}"), True),
        Scenario("stalls", "canary stalls 5% of streams",
                 ("--ttft-ms", str(TTFT_MS), "--fault", f"stall_after={FAULT_AT}"), True),
    )
}  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """The rollout plan every run's route gets: short holds and modest samples, so a run is quick."""

    steps: tuple[float, ...] = (5.0, 25.0, 50.0)
    min_hold_s: float = 2.0
    min_samples: int = 30

    def as_config(self) -> dict[str, Any]:
        return {"steps": list(self.steps), "min_hold_s": self.min_hold_s, "min_samples": self.min_samples}


@dataclass
class Result:
    """One run: what its rollout did, how long it took and how much traffic that needed."""

    scenario: str
    seed: int
    outcome: str = "progressing"
    seconds: float = 0.0
    requests: int = 0
    canary_requests: int = 0
    percent: float = 0.0  # the canary's weight at the end (for a rollback: the step it failed at)
    triggered: list[str] = field(default_factory=list)
    reason: str = ""

    @property
    def model(self) -> str:
        return f"aa-{self.scenario}-{self.seed}"


def gateway_config(results: Sequence[Result], stable_url: str, canary_urls: dict[str, str],
                   plan: Plan) -> dict[str, Any]:  # fmt: skip
    """One route per run, each splitting its model between the stable pod and its scenario's canary."""
    models = [r.model for r in results]
    pods = [{"name": "stable", "url": stable_url, "models": models, "labels": {"variant": "stable"}}]
    pods += [{"name": f"canary-{name}", "url": url, "models": models,
              "labels": {"variant": "canary", "scenario": name}}
             for name, url in canary_urls.items()]  # fmt: skip
    first = plan.steps[0]
    routes = {r.model: {"sticky": "user", "rollout": plan.as_config(), "variants": {
        "stable": {"pods": {"variant": "stable"}, "weight": 100 - first},
        "canary": {"pods": {"variant": "canary", "scenario": r.scenario}, "weight": first},
    }} for r in results}  # fmt: skip
    return {
        "server": {"host": "127.0.0.1", "access_log": False},
        "timeouts": {"stall_s": STALL_TIMEOUT_S},
        "pods": pods,
        "routes": routes,
    }


async def _caller(client: httpx.AsyncClient, url: str, run: Result, counter: Iterator[int]) -> None:
    """Short streams from fresh users, one after another, until the run's rollout is over."""
    while run.outcome not in OVER:
        n = next(counter)
        tokens = LONG_TOKENS if n % FAULTY_EVERY == FAULTY_EVERY - 1 else SHORT_TOKENS
        body = {"model": run.model, "messages": [{"role": "user", "content": "hi"}], "stream": True,
                "max_tokens": tokens, "user": f"seed{run.seed}-{n}"}  # fmt: skip
        try:
            async with client.stream("POST", url, json=body) as resp:
                if run.outcome in OVER:
                    break  # answered after the outcome was seen: not part of the run
                run.requests += 1
                run.canary_requests += resp.headers.get("x-sluicegate-pod", "").startswith("canary")
                async for _ in resp.aiter_bytes():
                    pass
        except httpx.HTTPError:
            pass  # the judge counts the failure; the run goes on


async def _watch(client: httpx.AsyncClient, admin_url: str, runs: dict[str, Result], started: float,
                 max_seconds: float) -> None:  # fmt: skip
    """Poll every rollout until each is promoted or rolled back, or the time is up."""
    while True:
        await asyncio.sleep(POLL_S)
        elapsed = time.monotonic() - started
        for status in (await client.get(admin_url + "/admin/rollouts")).json()["rollouts"]:
            run = runs[status["route"]]
            if run.outcome in DONE:
                continue
            run.percent, run.seconds = status["percent"], elapsed
            if status["state"] == "rolled_back":
                event = next(e for e in reversed(status["history"]) if e["what"] == "rolled_back")
                run.triggered, run.reason = event["triggered"], event["reason"]
                run.percent = status["steps"][event["step"]]  # the step it was rolled back at
            run.outcome = status["state"]
        if all(r.outcome in DONE for r in runs.values()) or elapsed >= max_seconds:
            for run in runs.values():
                if run.outcome not in DONE:
                    run.outcome = "unfinished"  # stops its callers
            return


async def _drive(gw: GatewayProcess, results: Sequence[Result], callers: int, max_seconds: float) -> None:
    limits = httpx.Limits(max_connections=callers * len(results) + 4)
    async with httpx.AsyncClient(timeout=STALL_TIMEOUT_S + 30, limits=limits) as client:
        started = time.monotonic()
        runs = {r.model: r for r in results}
        url = gw.url + "/v1/chat/completions"
        tasks = [asyncio.create_task(_caller(client, url, r, counter))
                 for r in results for counter in [itertools.count()] for _ in range(callers)]  # fmt: skip
        await _watch(client, gw.admin_url, runs, started, max_seconds)
        await asyncio.wait(tasks, timeout=STALL_TIMEOUT_S + 10)
        for task in tasks:
            task.cancel()


def run_batch(results: Sequence[Result], plan: Plan = Plan(), *, callers: int = 4,
              max_seconds: float = 120.0) -> list[Result]:  # fmt: skip
    """Run these (scenario, seed) results' rollouts in one gateway, filling them in; returns them."""
    seed = results[0].seed * 1000
    models = [arg for r in results for arg in ("--model", r.model)]
    scenarios = dict.fromkeys(r.scenario for r in results)
    with ExitStack() as stack:
        stable = stack.enter_context(PodsimProcess(
            [*models, *_POD_ARGS, "--ttft-ms", str(TTFT_MS), "--seed", str(seed)]))  # fmt: skip
        canaries = {
            name: stack.enter_context(PodsimProcess(
                [*models, *_POD_ARGS, *SCENARIOS[name].canary_args, "--seed", str(seed + 1 + i)]))
            for i, name in enumerate(scenarios)
        }  # fmt: skip
        urls = {name: pod.url for name, pod in canaries.items()}
        gw = stack.enter_context(GatewayProcess(gateway_config(results, stable.url, urls, plan)))
        asyncio.run(_drive(gw, results, callers, max_seconds))
    return list(results)


def run_all(specs: Sequence[tuple[str, int]], plan: Plan = Plan(), *, per_gateway: int = 10, callers: int = 4,
            max_seconds: float = 120.0, progress: bool = False) -> list[Result]:  # fmt: skip
    """Every (scenario, seed), ``per_gateway`` at a time."""
    done: list[Result] = []
    for start in range(0, len(specs), per_gateway):
        batch = [Result(name, seed) for name, seed in specs[start : start + per_gateway]]
        done += run_batch(batch, plan, callers=callers, max_seconds=max_seconds)
        if progress:
            print(f"{len(done)}/{len(specs)} runs: " + ", ".join(f"{r.model} {r.outcome}" for r in batch),
                  flush=True)  # fmt: skip
    return done


def summary(results: Sequence[Result]) -> list[dict[str, Any]]:
    """Per scenario: runs, outcomes, and the median time and requests to the outcome that happened."""
    rows = []
    for name in dict.fromkeys(r.scenario for r in results):
        mine = [r for r in results if r.scenario == name]
        row: dict[str, Any] = {"scenario": name, "what": SCENARIOS[name].what, "runs": len(mine)}
        for outcome in ("promoted", "rolled_back", "unfinished"):
            ended = [r for r in mine if r.outcome == outcome]
            row[outcome] = len(ended)
            row[f"{outcome}_median_s"] = statistics.median(r.seconds for r in ended) if ended else None
            requests = statistics.median(r.requests for r in ended) if ended else None
            row[f"{outcome}_median_requests"] = requests
        rows.append(row)
    return rows


def render(results: Sequence[Result], command: str, plan: Plan, callers: int, seconds: float) -> str:
    def cell(value: float | None, unit: str = "") -> str:
        return "-" if value is None else f"{value:.1f}{unit}" if unit else f"{value:.0f}"

    steps = " → ".join(f"{s:g}" for s in plan.steps)
    lines = [
        f"Command: `{command}` ({seconds:.0f} s in all)",
        "",
        f"Each run: its own route and judge, steps {steps} % then promoted, "
        f"`min_hold_s: {plan.min_hold_s:g}`, `min_samples: {plan.min_samples}`; {callers} closed-loop "
        f"callers sending {SHORT_TOKENS}-token streams from fresh users; pods at {TTFT_MS} ms TTFT with "
        f"log-normal jitter (sigma {JITTER}), {ITL_MS} ms ITL. Times from the batch's first request to "
        f"the first poll (every {POLL_S:g} s) showing the outcome.",
        "",
        "| scenario | runs | promoted | rolled back | unfinished | median s to promote | median requests to "
        "promote | median s to roll back | median requests to roll back |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in summary(results):
        lines.append(
            f"| {row['what']} | {row['runs']} | {row['promoted']} | {row['rolled_back']} "
            f"| {row['unfinished']} "
            f"| {cell(row['promoted_median_s'], ' s')} | {cell(row['promoted_median_requests'])} "
            f"| {cell(row['rolled_back_median_s'], ' s')} | {cell(row['rolled_back_median_requests'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.canary_aa",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("--runs", type=int, default=50, help="seeds per scenario (default 50)")
    parser.add_argument("--first-seed", type=int, default=1)
    parser.add_argument("--scenarios", default="aa", help=f"comma-separated, of: {', '.join(SCENARIOS)}")
    parser.add_argument("--per-gateway", type=int, default=10, help="runs sharing one gateway (default 10)")
    parser.add_argument("--callers", type=int, default=4, help="concurrent callers per run (default 4)")
    parser.add_argument("--max-seconds", type=float, default=120.0, help="cap per batch (default 120)")
    parser.add_argument(
        "--min-samples",
        type=int,
        default=Plan.min_samples,
        help=f"clean streams per variant per step (default {Plan.min_samples})",
    )
    parser.add_argument(
        "--min-hold-s",
        type=float,
        default=Plan.min_hold_s,
        help=f"seconds each step is held at least (default {Plan.min_hold_s:g})",
    )
    parser.add_argument("--json", metavar="FILE", help="write every run and the summary as JSON")
    parser.add_argument("--write-md", metavar="FILE")
    parser.add_argument("--section", default="canary-aa", help="the marked section of --write-md to replace")
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.scenarios.split(",") if name.strip()]
    unknown = [name for name in names if name not in SCENARIOS]
    if unknown or not names:
        parser.error(f"unknown scenario {', '.join(unknown) or '(none)'}; known: {', '.join(SCENARIOS)}")
    if args.runs < 1 or args.per_gateway < 1 or args.callers < 1 or args.max_seconds <= 0:
        parser.error("--runs, --per-gateway, --callers and --max-seconds must be positive")
    raise_open_file_limit()
    if args.min_samples < 1 or args.min_hold_s < 0:
        parser.error("--min-samples must be positive and --min-hold-s not negative")
    plan = Plan(min_hold_s=args.min_hold_s, min_samples=args.min_samples)
    specs = [(name, seed) for name in names for seed in range(args.first_seed, args.first_seed + args.runs)]
    began = time.monotonic()
    results = run_all(specs, plan, per_gateway=args.per_gateway, callers=args.callers,
                      max_seconds=args.max_seconds, progress=True)  # fmt: skip
    command = command_line("loadtest.canary_aa", argv)
    table = render(results, command, plan, args.callers, time.monotonic() - began)
    publish(table, args.write_md, args.section)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"command": command, "plan": asdict(plan), "summary": summary(results),
                       "runs": [asdict(r) for r in results]}, out, indent=1)  # fmt: skip
    false_alarms = [r.model for r in results if r.scenario == "aa" and r.outcome == "rolled_back"]
    if false_alarms:
        print(f"A/A runs rolled back: {', '.join(false_alarms)}")
    return 1 if false_alarms else 0


if __name__ == "__main__":
    raise SystemExit(main())
