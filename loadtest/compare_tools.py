"""``make compare-tools``: the same open-loop load from k6, Locust and ``sluicegate loadtest``, one
after another, against a demo-like gateway, and how their numbers agree.

Why: the three tools measure the same streams in different ways (k6 sees only the first byte and the
whole body; Locust reads the stream in Python; our generator reads it with a lean client), so a user
switching tools should know which differences are real. Each tool is also checked against the
gateway's own view of the same requests (its ``/metrics`` histograms, read before and after each
run), which no client overhead touches.

The setup is ``sluicegate demo``'s (config/demo.yaml: auth on with a fresh demo key, the demo tier's
quota, three simulated pods on MIG slices), except that the pods run at a fixed pace (no jitter, no
prefill cost per prompt token, no slow-down per running sequence) so that every tool should see the
same time to first token and the same gaps, and that nothing listens on the demo's fixed ports. The
gateway runs alone on core 1; the pods, the tools and this harness on core 0 (as ``make bench``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from loadtest.bench import LOAD_CORE, PROXY_CORE, can_pin, cpu_model, pin_prefix

ROOT = Path(__file__).resolve().parent.parent
DEMO_CONFIG = ROOT / "config" / "demo.yaml"
PROMPTS = ROOT / "loadtest" / "prompts" / "synthetic.jsonl"
K6 = Path(sys.executable).parent / "k6"
K6_SCRIPT = ROOT / "loadtest" / "k6" / "steady.js"
TOOLS = ("k6", "locust", "loadtest")
TOOL_NAMES = {
    "k6": "k6 (`steady.js`)",
    "locust": "Locust (`locustfile.py`)",
    "loadtest": "`sluicegate loadtest`",
}
MODEL = "llama-8b"
SECTION = "tools"


@dataclass(frozen=True)
class Load:
    """The one load every tool offers, and the pods' fixed pace."""

    rate: int  # requests/s (k6's constant-arrival-rate takes whole numbers)
    duration_s: int
    max_tokens: int
    ttft_ms: float
    itl_ms: float

    @property
    def expected_e2e_s(self) -> float:
        return (self.ttft_ms + (self.max_tokens - 1) * self.itl_ms) / 1000

    @property
    def requests(self) -> int:
        return self.rate * self.duration_s


@dataclass
class Row:
    """One tool's numbers (ms; None where the tool cannot measure it), or the gateway's for that run."""

    source: str
    ok: int = 0
    failed: int = 0
    ttft_mean: float | None = None
    ttft_p50: float | None = None
    ttft_p90: float | None = None
    ttft_p99: float | None = None
    itl_p50: float | None = None
    itl_p99: float | None = None
    tpot_p50: float | None = None
    tpot_mean: float | None = None
    e2e_p50: float | None = None
    e2e_mean: float | None = None
    tokens_per_request: float | None = None
    tokens_per_s: float | None = None
    late: str = ""  # how far the tool fell behind its schedule
    note: str = ""


@dataclass
class ToolRun:
    tool: str
    row: Row
    gateway: Row
    wall_s: float
    command: list[str]
    summary: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


class CompareError(Exception):
    """Why the comparison cannot be made, in one line."""


# --------------------------------------------------------------------------- the setup


def pod_speeds(load: Load) -> list[str]:
    """A fixed pace: the same TTFT for every prompt length and the same gaps at any concurrency."""
    return [
        "--ttft-ms", f"{load.ttft_ms:g}", "--itl-ms", f"{load.itl_ms:g}", "--ttft-jitter", "0",
        "--prefill-ms-per-token", "0", "--itl-per-seq-ms", "0",
    ]  # fmt: skip


@dataclass
class Setup:
    url: str
    admin_url: str
    key: str


@contextlib.contextmanager
def demo_setup(load: Load, pin: bool, scratch: Path) -> Iterator[Setup]:
    """config/demo.yaml's gateway and pods (auth on, a fresh demo key), on free ports, at ``load``'s pace."""
    from gateway.config_load import parse_config
    from gateway.demo import podsim_args, write_demo_keys
    from loadtest.podsim.launch import PodsimProcess, PodsimStartError
    from loadtest.procs import GatewayProcess

    raw = yaml.safe_load(DEMO_CONFIG.read_text())
    raw["server"].pop("tls", None)  # no certificate to make, no fixed port 8443
    raw["admin"] = {**raw.get("admin", {}), "port": 0}
    raw["auth"] = {**raw.get("auth", {}), "keys_file": str(scratch / "keys.yaml")}
    demo = parse_config(raw, str(DEMO_CONFIG))
    with contextlib.ExitStack() as stack:
        pods = []
        for pod in demo.pods:  # the demo's own simulator flags, then a free port and the fixed pace
            sim = PodsimProcess([*podsim_args(pod), "--port", "0", *pod_speeds(load)],
                                command_prefix=pin_prefix(LOAD_CORE, pin))  # fmt: skip
            try:
                stack.enter_context(sim)
            except PodsimStartError as exc:
                raise CompareError(f"simulated pod {pod.name} did not start: {exc}") from None
            pods.append({**next(p for p in raw["pods"] if p["name"] == pod.name), "url": sim.url})
        raw["pods"] = pods
        keys = write_demo_keys(parse_config(raw, str(DEMO_CONFIG)))
        if keys is None:
            raise CompareError(f"{DEMO_CONFIG} has auth off; the comparison runs with auth on, as the demo")
        gateway = GatewayProcess(raw, cpu=PROXY_CORE if pin else None)
        try:
            stack.enter_context(gateway)
        except RuntimeError as exc:
            raise CompareError(str(exc).splitlines()[0]) from None
        yield Setup(gateway.url, gateway.admin_url, keys.demo)


def warm_up(setup: Setup, count: int = 4) -> None:
    """A few short requests, so that no tool pays for the gateway's first connections to the pods."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "warm up"}],
                       "max_tokens": 2, "stream": True}).encode()  # fmt: skip
    for _ in range(count):
        request = urllib.request.Request(
            setup.url + "/v1/chat/completions", data=body, method="POST",
            headers={"content-type": "application/json", "authorization": f"Bearer {setup.key}"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()


# --------------------------------------------------------------------------- the gateway's view

GATEWAY_SERIES = {
    "sluicegate_time_to_first_token_seconds_sum": "ttft_sum",
    "sluicegate_time_to_first_token_seconds_count": "ttft_count",
    "sluicegate_time_per_output_token_seconds_sum": "tpot_sum",
    "sluicegate_time_per_output_token_seconds_count": "tpot_count",
    "sluicegate_request_duration_seconds_sum": "e2e_sum",
    "sluicegate_request_duration_seconds_count": "e2e_count",
}


def parse_gateway_metrics(text: str) -> dict[str, float]:
    """The sums and counts this comparison reads from a Prometheus exposition, summed over labels."""
    from prometheus_client.parser import text_string_to_metric_families

    out = dict.fromkeys([*GATEWAY_SERIES.values(), "requests_ok", "completion_tokens"], 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in GATEWAY_SERIES:
                out[GATEWAY_SERIES[sample.name]] += sample.value
            elif sample.name == "sluicegate_requests_total" and sample.labels.get("status") == "200":
                out["requests_ok"] += sample.value
            elif sample.name == "sluicegate_tokens_total" and sample.labels.get("kind") == "completion":
                out["completion_tokens"] += sample.value
    return out


def scrape(admin_url: str) -> dict[str, float]:
    with urllib.request.urlopen(admin_url + "/metrics", timeout=10) as response:
        return parse_gateway_metrics(response.read().decode())


def gateway_row(before: dict[str, float], after: dict[str, float], load: Load) -> Row:
    """What the gateway saw during one run: means only (its histogram buckets, 100 ms then 250 ms
    around a 200 ms TTFT, are too coarse for percentiles); time from the request's arrival."""
    d = {name: after[name] - before[name] for name in after}

    def mean_ms(name: str) -> float | None:
        return d[f"{name}_sum"] / d[f"{name}_count"] * 1000 if d[f"{name}_count"] else None

    ok = int(d["requests_ok"])
    return Row(
        source="gateway `/metrics`", ok=ok, ttft_mean=mean_ms("ttft"), tpot_mean=mean_ms("tpot"),
        e2e_mean=mean_ms("e2e"), tokens_per_request=d["completion_tokens"] / ok if ok else None,
        tokens_per_s=d["completion_tokens"] / load.duration_s,
    )  # fmt: skip


# --------------------------------------------------------------------------- the tools


def locust_plan(load: Load) -> tuple[int, float, int]:
    """Users, requests/s per user and spawn rate that give ``load.rate`` requests/s on a schedule.

    Each user's period is at least twice the expected stream, so no user is still busy when its next
    send is due. Locust spawns ``floor(spawn rate)`` users at a time, once a second here, so its
    arrivals come ``rate`` at a time each second rather than evenly spaced; the rate is the same.
    """
    period = max(1, math.ceil(2 * load.expected_e2e_s))
    users = load.rate * period
    return users, load.rate / users, load.rate


def tool_command(
    tool: str, load: Load, setup: Setup, out: Path, pin: bool
) -> tuple[list[str], dict[str, str]]:
    """The command line (and extra environment) that runs ``load`` with ``tool``."""
    prefix = pin_prefix(LOAD_CORE, pin)
    if tool == "k6":
        env = {
            "BASE_URL": setup.url, "API_KEY": setup.key, "MODEL": MODEL, "RATE": str(load.rate),
            "DURATION": f"{load.duration_s}s", "MAX_TOKENS": str(load.max_tokens),
            "PROMPTS_FILE": str(PROMPTS), "SUMMARY_JSON": str(out), "K6_NO_USAGE_REPORT": "true",
            "TTFT_P95_MS": "off",
        }  # fmt: skip
        return [*prefix, str(K6), "run", "--quiet", str(K6_SCRIPT)], env
    if tool == "locust":
        users, per_user, spawn = locust_plan(load)
        stop_s = math.ceil(3 * load.expected_e2e_s) + 5
        return [
            *prefix, sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locustfile.py"),
            "--headless", "-u", str(users), "-r", str(spawn), "-t", f"{load.duration_s}s",
            "--stop-timeout", str(stop_s), "--host", setup.url, "--api-key", setup.key, "--model", MODEL,
            "--max-tokens", str(load.max_tokens), "--ignore-eos", "--prompts", str(PROMPTS),
            "--rate-per-user", f"{per_user:.6g}",
            "--metrics-json", str(out), "--only-summary", "--loglevel", "WARNING",
        ], {}  # fmt: skip
    if tool == "loadtest":
        return [
            *prefix, sys.executable, "-m", "gateway.cli", "loadtest", setup.url, "--model", MODEL,
            "--rate", str(load.rate), "--duration", str(load.duration_s),
            "--max-tokens", str(load.max_tokens), "--prompts", str(PROMPTS), "--api-key", setup.key,
            "--json", str(out),
        ], {}  # fmt: skip
    raise ValueError(tool)


def _ms(value: float | None, scale: float = 1.0) -> float | None:
    return None if value is None else value * scale


def k6_row(s: dict[str, Any]) -> Row:
    m = s["metrics"]

    def trend(name: str, stat: str) -> float | None:
        return m[name]["values"].get(stat) if name in m else None

    ok = int(m["stream_ok"]["values"].get("passes", 0)) if "stream_ok" in m else 0
    tokens = m["output_tokens"]["values"]
    return Row(
        source=TOOL_NAMES["k6"], ok=ok, failed=int(m["iterations"]["values"]["count"]) - ok,
        ttft_mean=trend("ttft", "avg"), ttft_p50=trend("ttft", "med"), ttft_p90=trend("ttft", "p(90)"),
        ttft_p99=trend("ttft", "p(99)"), tpot_p50=trend("tpot", "med"), tpot_mean=trend("tpot", "avg"),
        e2e_p50=trend("e2e", "med"), e2e_mean=trend("e2e", "avg"),
        tokens_per_request=tokens["count"] / ok if ok else None, tokens_per_s=tokens["rate"],
        late=f"{int(m['dropped_iterations']['values']['count'])} dropped",
        note="ttft = time to first byte; no ITL (k6 buffers the body)",
    )  # fmt: skip


def locust_row(s: dict[str, Any]) -> Row:
    lat, tokens = s["latency_us"], s["output_tokens"]
    ok = int(s["requests"]["ok"])
    us = 1 / 1000

    def stat(name: str, key: str) -> float | None:
        block = lat.get(name) or {}
        return _ms(block.get(key), us) if block.get("count") else None

    delay = stat("dispatch_delay", "p99")
    return Row(
        source=TOOL_NAMES["locust"], ok=ok, failed=int(s["requests"]["failed"]),
        ttft_mean=stat("ttft", "mean"), ttft_p50=stat("ttft", "p50"), ttft_p90=stat("ttft", "p90"),
        ttft_p99=stat("ttft", "p99"), itl_p50=stat("itl", "p50"), itl_p99=stat("itl", "p99"),
        tpot_p50=stat("tpot", "p50"), tpot_mean=stat("tpot", "mean"), e2e_p50=stat("e2e", "p50"),
        e2e_mean=stat("e2e", "mean"), tokens_per_request=tokens["total"] / ok if ok else None,
        tokens_per_s=tokens.get("per_s"), late="" if delay is None else f"dispatch p99 {delay:.1f} ms",
    )  # fmt: skip


def loadtest_row(s: dict[str, Any]) -> Row:
    ok = int(s["requests"]["ok"])

    def stat(name: str, key: str) -> float | None:
        block = s.get(name) or {}
        return block.get(key) if block.get("count") else None

    delay = stat("dispatch_delay_ms", "p99")
    return Row(
        source=TOOL_NAMES["loadtest"], ok=ok, failed=int(s["requests"]["errors"]),
        ttft_mean=stat("ttft_ms", "mean"), ttft_p50=stat("ttft_ms", "p50"), ttft_p90=stat("ttft_ms", "p90"),
        ttft_p99=stat("ttft_ms", "p99"), itl_p50=stat("itl_ms", "p50"), itl_p99=stat("itl_ms", "p99"),
        tpot_p50=stat("tpot_ms", "p50"), tpot_mean=stat("tpot_ms", "mean"), e2e_p50=stat("e2e_ms", "p50"),
        e2e_mean=stat("e2e_ms", "mean"), tokens_per_request=s["tokens"]["output"] / ok if ok else None,
        tokens_per_s=s["throughput"]["output_tokens_per_s"],
        late="" if delay is None else f"dispatch p99 {delay:.1f} ms",
    )  # fmt: skip


ROW_OF = {"k6": k6_row, "locust": locust_row, "loadtest": loadtest_row}


def run_tool(tool: str, load: Load, setup: Setup, scratch: Path, pin: bool) -> ToolRun:
    """One tool's run of ``load``, with the gateway's metrics read just before and just after."""
    out = scratch / f"{tool}.json"
    command, env = tool_command(tool, load, setup, out, pin)
    before = scrape(setup.admin_url)
    started = time.monotonic()
    try:
        done = subprocess.run(command, env={**os.environ, **env}, cwd=scratch, capture_output=True, text=True,
                              timeout=load.duration_s + 3 * load.expected_e2e_s + 120)  # fmt: skip
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        code, output = None, f"timed out after {exc.timeout:.0f} s"
    wall = time.monotonic() - started
    gateway = gateway_row(before, scrape(setup.admin_url), load)
    shown = [part if part != setup.key else "$KEY" for part in command]
    summary: dict[str, Any] = {}
    error = None
    if out.exists():
        summary = json.loads(out.read_text())
    if not summary or code not in (0, 99 if tool == "k6" else 0):  # k6: 99 = a threshold crossed
        tail = " | ".join(line for line in output.strip().splitlines()[-3:])
        error = f"{tool} exited {code}: {tail}"[:400]
    row = ROW_OF[tool](summary) if summary else Row(source=TOOL_NAMES[tool], note="no summary")
    if error:
        row.note = error
    return ToolRun(tool, row, gateway, round(wall, 2), shown, summary, error)


# --------------------------------------------------------------------------- the report


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


HEADER = (
    "| measured by | ok / failed | TTFT mean | TTFT p50 | p90 | p99 | ITL p50 | ITL p99 | TPOT p50 (mean) "
    "| e2e p50 (mean) | tokens / request | tokens/s | behind schedule |"
)


def table_row(row: Row) -> str:
    tpot = (
        f"{_f(row.tpot_p50)} ({_f(row.tpot_mean)})" if row.tpot_p50 is not None else f"({_f(row.tpot_mean)})"
    )
    e2e = f"{_f(row.e2e_p50)} ({_f(row.e2e_mean)})" if row.e2e_p50 is not None else f"({_f(row.e2e_mean)})"
    failed = str(row.failed) if not row.source.startswith("↳") else "-"
    return (
        f"| {row.source} | {row.ok} / {failed} | {_f(row.ttft_mean)} | {_f(row.ttft_p50)} "
        f"| {_f(row.ttft_p90)} | {_f(row.ttft_p99)} | {_f(row.itl_p50)} | {_f(row.itl_p99)} | {tpot} | {e2e} "
        f"| {_f(row.tokens_per_request, 2)} | {_f(row.tokens_per_s, 0)} | {row.late or '-'} |"
    )


def _spread(values: dict[str, float | None]) -> str:
    known = {k: v for k, v in values.items() if v is not None}
    if len(known) < 2:
        return "-"
    return f"{max(known.values()) - min(known.values()):.1f} ms"


def agreement(runs: list[ToolRun], load: Load) -> list[str]:
    """How closely the tools agree, in numbers (the prose reading of them is in the docs)."""
    good = [r for r in runs if r.error is None]
    names = {r.tool: r.row for r in good}
    lines = []
    ttft = {t: r.ttft_p50 for t, r in names.items()}
    lines.append(
        "- TTFT p50: "
        + ", ".join(f"{t} {_f(v)}" for t, v in ttft.items())
        + f" ms: spread {_spread(ttft)} against the pods' {load.ttft_ms:g} ms."
    )
    over = [f"{r.tool} {r.row.ttft_mean - r.gateway.ttft_mean:+.1f} ms" for r in good
            if r.row.ttft_mean is not None and r.gateway.ttft_mean is not None]  # fmt: skip
    if over:
        lines.append("- TTFT mean minus the gateway's own for the same requests (what the client, its "
                     "send and loopback add): " + ", ".join(over) + ".")  # fmt: skip
    tpot = {t: r.tpot_p50 for t, r in names.items()}
    lines.append(
        "- TPOT p50: "
        + ", ".join(f"{t} {_f(v, 2)}" for t, v in tpot.items())
        + f" ms (spread {_spread(tpot)}); gateway means "
        + ", ".join(f"{_f(r.gateway.tpot_mean, 2)}" for r in good)
        + f" ms; the pods' pace {load.itl_ms:g} ms."
    )
    itl = {t: r.itl_p50 for t, r in names.items() if r.itl_p50 is not None}
    if itl:
        lines.append("- ITL p50: " + ", ".join(f"{t} {_f(v, 2)}" for t, v in itl.items())
                     + " ms (k6 cannot see the gaps).")  # fmt: skip
    offered = load.rate * load.max_tokens
    lines.append(
        "- tokens/s (each tool's own figure, over its own window): "
        + ", ".join(f"{t} {_f(r.tokens_per_s, 0)}" for t, r in names.items())
        + f"; offered {offered} (= {load.rate} req/s x {load.max_tokens}); the gateway counted "
        + ", ".join(f"{_f(r.gateway.tokens_per_s, 0)}" for r in good)
        + " over the scheduled "
        + f"{load.duration_s} s."
    )
    return lines


def render(runs: list[ToolRun], load: Load, meta: dict[str, Any]) -> str:
    users, per_user, _ = locust_plan(load)
    lines = [
        f"Generated by `{meta['command']}` in {meta['elapsed_s']:.0f} s on {meta['machine']}.",
        "",
        f"Load: {load.rate} requests/s for {load.duration_s} s, open loop, `max_tokens` {load.max_tokens}, "
        f"prompts `loadtest/prompts/synthetic.jsonl`; k6 `constant-arrival-rate`, Locust {users} users at "
        f"`--rate-per-user {per_user:.4g}`, `sluicegate loadtest --rate {load.rate}`, one after another. "
        f"Gateway and pods as `make run` (config/demo.yaml, auth on, demo key), the pods at a fixed "
        f"{load.ttft_ms:g} ms to first token and {load.itl_ms:g} ms a token. Times in ms; each ↳ row is the "
        "gateway's own `/metrics` during the run above it (means: its histogram buckets are too coarse "
        "for percentiles).",
        "",
        HEADER,
        "|" + "---|" * HEADER.count(" | ") + "---|",
    ]
    for run in runs:
        lines.append(table_row(run.row))
        lines.append(table_row(Row(**{**asdict(run.gateway), "source": "↳ gateway `/metrics`"})))
    lines.append("")
    lines += agreement(runs, load)
    notes = [f"- {TOOL_NAMES[r.tool]}: {r.row.note}" for r in runs if r.error]
    notes += [f"- {note}" for note in meta.get("notes", [])]
    return "\n".join(lines + notes) + "\n"


def machine(pin: bool) -> str:
    cpu = cpu_model()
    pinning = (f"gateway alone on core {PROXY_CORE}, pods and tools on core {LOAD_CORE}" if pin
               else "no CPU pinning")  # fmt: skip
    return (f"{os.cpu_count()} cores ({cpu}), Linux {platform.release()}, "
            f"Python {platform.python_version()}; {pinning}; "
            f"1-min load average at start {os.getloadavg()[0]:.2f}")  # fmt: skip


# --------------------------------------------------------------------------- CLI


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, not {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, not {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
    return value


def _tools(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in TOOLS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(TOOLS)}, not {text!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.compare_tools", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rate", type=_positive_int, default=4, help="requests per second (default 4)")
    parser.add_argument(
        "--duration", type=_positive_int, default=20, help="seconds of load per tool (default 20)"
    )
    parser.add_argument(
        "--max-tokens", type=_positive_int, default=64, help="max_tokens of every request (64)"
    )
    parser.add_argument(
        "--ttft-ms", type=_positive_float, default=200.0, help="the pods' time to first token"
    )
    parser.add_argument("--itl-ms", type=_positive_float, default=20.0, help="the pods' time between tokens")
    parser.add_argument(
        "--tools", type=_tools, default=list(TOOLS), help="in this order (default k6,locust,loadtest)"
    )
    parser.add_argument("--json", metavar="FILE", help="write the rows and each tool's own summary here")
    parser.add_argument("--write-md", metavar="FILE", help=f"put the table in FILE's bench:{SECTION} section")
    parser.add_argument("--no-pin", action="store_true", help="do not pin anything to cores (taskset)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run each tool in turn, print (and publish) the table; 1 if a tool or the setup failed."""
    from loadtest.report import publish

    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    load = Load(args.rate, args.duration, args.max_tokens, args.ttft_ms, args.itl_ms)
    pin = not args.no_pin and can_pin()
    notes = []
    if pin:
        os.sched_setaffinity(0, {LOAD_CORE})  # this harness stays off the gateway's core
    elif not args.no_pin:
        notes.append("taskset or cores 0-1 are unavailable: nothing is pinned.")
    tools = list(args.tools)
    if "k6" in tools and not K6.exists():
        tools.remove("k6")
        notes.append(f"k6 is not installed at {K6} (`make test` installs it): its row is skipped.")
    meta: dict[str, Any] = {
        "command": shlex.join([".venv/bin/python", "-m", "loadtest.compare_tools", *argv]),
        "machine": machine(pin), "notes": notes,
    }  # fmt: skip
    started = time.monotonic()
    runs: list[ToolRun] = []
    try:
        with tempfile.TemporaryDirectory(prefix="sluicegate-compare-") as tmp:
            scratch = Path(tmp)
            with demo_setup(load, pin, scratch) as setup:
                warm_up(setup)
                for tool in tools:
                    print(
                        f"compare-tools: {tool}, {load.rate} req/s for {load.duration_s} s ...",
                        file=sys.stderr,
                    )
                    runs.append(run_tool(tool, load, setup, scratch, pin))
    except (CompareError, OSError) as exc:
        print(f"compare-tools: {exc}", file=sys.stderr)
        return 1
    meta["elapsed_s"] = time.monotonic() - started
    section = render(runs, load, meta)
    failed = [r for r in runs if r.error]
    publish(section, None if failed else args.write_md, SECTION)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "schema": "sluicegate.compare_tools/1", **meta, "load": asdict(load),
            "runs": [{**asdict(r), "row": asdict(r.row), "gateway": asdict(r.gateway)} for r in runs],
        }, indent=2) + "\n")  # fmt: skip
    for run in failed:
        print(f"compare-tools: {run.error}", file=sys.stderr)
    if failed and args.write_md:
        print(f"compare-tools: {args.write_md} left as it was", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
