"""Machine instructions per request and per token: the gateway's own Python, counted, not timed.

CPU time on this VM moves with the machine by up to 5x in a day (``docs/benchmarks.md``, "What is
left"), so a change worth 5 % cannot be seen in ``make bench``'s tables. Valgrind's callgrind counts
the instructions a process runs in user mode, whatever else the machine does: the same load gives
the same count within ~1-2 %. It sees nothing of the kernel (system calls, which the gateway and
nginx pay alike) and little of caches, so it measures exactly the part of the cost that is ours.

The proxy runs under callgrind with counting off; it is switched on (``callgrind_control``) only
around each of the loads below, which all last the same time (so the probes, scrapes and timers
running beside them cost the same in each). Three are of one stream:

- A: 10 requests of 32 tokens at 20 ms a token,
- B: 40 requests of 8 tokens at 20 ms a token (30 requests more, the same tokens and time),
- C: 10 requests of 160 tokens at 4 ms a token (1280 tokens more, the same requests and time),

so a request costs (B - A) / 30 instructions and a token (C - A) / 1280. Those requests share one
kept-alive client connection and one pooled pod connection. Scenario d's do not: each of its 2000
streams opens its own client connection, and the pod pool has to open as many pod connections. Two
more loads count that case, every request on a connection of its own (the client connections opened
together as the load starts, the pod connections as their requests go out; both counted):

- D: 10 connections of one request of 32 tokens at 20 ms a token,
- E: 40 connections of one request of 8 tokens at 80 ms a token (the same tokens and time: the
  requests run at once, so each load lasts one request's time),

so a request on new connections costs (E - D) / 30. Targets: ``gateway``
(every feature on, as ``make bench``'s, with probes, scrapes and file checks once a minute: they
cancel out of both figures, and at their usual second or two they only added noise) and ``floor``
(``loadtest/floor.py``: what a uvloop relay costs at the least). Under callgrind a process runs
~50x slower; the pacing keeps each token a read of its own.

    python -m loadtest.bench_instructions [--target gateway,floor] [--write-md FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from loadtest import bench
from loadtest.floor import FloorProcess
from loadtest.procs import GatewayProcess
from loadtest.report import command_line, publish

# connections, requests on each, tokens, ms a token
LOADS = {
    "A": (1, 10, 32, 20.0), "B": (1, 40, 8, 20.0), "C": (1, 10, 160, 4.0),
    "D": (10, 1, 32, 20.0), "E": (40, 1, 8, 80.0),
}
TARGETS = ("gateway", "floor")
QUIET_S = 60.0  # probes, scrapes and file checks during a load: none after the first


def _callgrind(out: Path) -> list[str]:
    return ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]


def _control(pid: int, option: str) -> None:
    """Tell the callgrind running ``pid`` to count (``--instr=on``), stop, or write its counts."""
    subprocess.run(["callgrind_control", option, str(pid)], check=True, capture_output=True)


def callgrind_total(dump: Path) -> int:
    """The instructions a callgrind dump counted (its ``totals:`` line)."""
    for line in dump.read_text().splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {dump}")


def _start(target: str, pod_url: str, scratch: Path, out: Path) -> tuple[Any, dict[str, str]]:
    """The proxy under callgrind (counting off), ready; and the headers the load sends."""
    if target == "floor":
        floor = FloorProcess([pod_url], command_prefix=_callgrind(out))
        floor.startup_timeout_s = 300.0
        return floor.start(), {}
    config, key = bench.gateway_config(pod_url, scratch / "keys.yaml")
    # Every feature on, but the periodic work beside the load once a minute: it costs each load the
    # same, so it cancels out, but its ~20 M instructions a load were most of the runs' spread.
    config["health"] = {"probe": {"interval_s": QUIET_S}, "scrape": {"interval_s": QUIET_S}}
    config["auth"]["reload_interval_s"] = QUIET_S
    config["reload"] = {"interval_s": QUIET_S}
    gateway = GatewayProcess(config, startup_timeout_s=300.0, command_prefix=_callgrind(out))
    gateway.start()
    bench.wait_ready(gateway, timeout_s=300.0)
    return gateway, bench.auth_headers(key)


def count(target: str, load: str) -> int:
    """Instructions the proxy ran during one load."""
    streams, requests, tokens, itl_ms = LOADS[load]
    scenario = dataclasses.replace(
        bench.SCENARIOS["a"], streams=streams, requests=requests, max_tokens=tokens, itl_ms=itl_ms
    )
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        out = scratch / "callgrind.out"
        pod = bench.start_pod(scenario, pin=False)
        try:
            proxy, headers = _start(target, pod.url, scratch, out)
            try:
                bench.warm_up(proxy.url, headers=headers)
                _control(proxy.pid, "--instr=on")
                result = bench.run_loadgen(proxy.url, scenario, pin=False, headers=headers)
                _control(proxy.pid, "--instr=off")
                _control(proxy.pid, "--dump")
            finally:
                proxy.stop()
        finally:
            pod.stop()
        if result["errors"] or result["ok"] != _requests(load):
            samples = result.get("error_samples")
            raise RuntimeError(f"{target} load {load}: {result['ok']}/{_requests(load)} ok ({samples})")
        dumps = sorted(scratch.glob("callgrind.out.*"), key=lambda p: int(p.suffix[1:]))
        return callgrind_total(dumps[0])


def _requests(load: str) -> int:
    return LOADS[load][0] * LOADS[load][1]


def _tokens(load: str) -> int:
    return _requests(load) * LOADS[load][2]


def measure(target: str) -> dict[str, float]:
    a, b, c, d, e = (count(target, load) for load in "ABCDE")
    return {
        "A": a, "B": b, "C": c, "D": d, "E": e,
        "per_request": (b - a) / (_requests("B") - _requests("A")),
        "per_token": (c - a) / (_tokens("C") - _tokens("A")),
        "per_new_request": (e - d) / (_requests("E") - _requests("D")),
    }


def render(rows: dict[str, dict[str, float]], command: str) -> str:
    lines = [
        f"Command: `{command}`  ",
        "Instructions the proxy ran in user mode (callgrind); per request from loads A and B (one "
        "kept-alive connection), per token from A and C, per request on new client and pod connections "
        "from D and E (see the module doc).",
        "",
        "| target | load A | load B | load C | load D | load E | per request | per token "
        "| per request, new connections |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for target, r in rows.items():
        loads = " | ".join(f"{r[load] / 1e6:.1f} M" for load in "ABCDE")
        lines.append(
            f"| {target} | {loads} | {r['per_request'] / 1e3:,.0f} k | {r['per_token'] / 1e3:.1f} k "
            f"| {r['per_new_request'] / 1e3:,.0f} k |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_instructions", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--target", default=",".join(TARGETS), help="comma-separated: gateway, floor")
    parser.add_argument("--write-md", metavar="FILE")
    args = parser.parse_args(argv)
    targets = [t.strip() for t in args.target.split(",") if t.strip()]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        parser.error(f"unknown target {unknown[0]!r}; choose from {', '.join(TARGETS)}")
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("bench_instructions: valgrind is not installed (Debian: valgrind); skipped", file=sys.stderr)
        return 0
    os.environ.setdefault("PYTHONHASHSEED", "0")  # the same dict layouts run to run
    rows = {t: measure(t) for t in targets}
    publish(render(rows, command_line("loadtest.bench_instructions", argv)), args.write_md, "instructions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
