"""``serve --workers N``: what a second worker process buys on this machine.

The gateway with every feature on (as the ``gateway`` target of ``loadtest.bench``), run with one
worker and with two, and the pod straight, in two setups. Nothing is pinned: the workers are meant
to use every core, and they share this 2-core machine with the pod and the load generator.

- **gateway-bound** (``--setup nginx``): the pod is nginx answering every request with one canned
  vLLM stream from a file (``loadtest/nginx_pod.py``) and the load is ``h2load --h1`` (C, one
  thread): neighbours that cost a fraction of the gateway per request, so the gateway is what runs
  out of CPU, as on a gateway pod with its own cores. h2load does not show bodies: one answer
  through the gateway is read whole (its tokens and ``[DONE]`` counted) before each load.
- **whole host** (``--setup podsim``): the pod simulator as fast as it goes and the Python load
  generator, streaming; they cost more per token than the gateway, so what a second worker can
  take is what they leave.

For each: tokens/s received by the load generator; the gateway's CPU per 1000 tokens (every process
of it: with two workers, the supervisor, both workers and the private ``redis-server`` that carries
their shared quota counters); the cores the gateway kept busy, and (gateway-bound) those the pod and
the load generator did, so the row says whether the machine was full. The whole-host rows also give
the gateway's memory once its load is over: the proportional set size (PSS) summed over every
process of it, which counts a page shared by k processes 1/k in each, so shared code is counted once
(RSS would count it in each), and the memory a worker holds alone (USS, the largest worker's).

    python -m loadtest.bench_workers [--setup nginx,podsim] [--workers 1,2] [--duration S]
        [--repeats 3] [--write-md FILE]

``--duration`` times the gateway-bound load instead of counting it; with more than two workers it
is the one to use, as a count ends early on workers the kernel handed fewer connections.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gateway.rlimits import raise_open_file_limit
from gateway.workers.template import NAME as TEMPLATE
from loadtest.bench import (
    MODEL,
    Scenario,
    auth_headers,
    cpu_delta_s,
    cpu_ticks,
    gateway_config,
    process_tree,
    run_loadgen,
    start_gateway,
    start_pod,
    stream_once,
    warm_up,
)
from loadtest.bench_h2 import H2LOAD, chat_body, parse_h2load
from loadtest.loadgen import count_tokens
from loadtest.nginx import nginx_binary
from loadtest.nginx_pod import NginxPod
from loadtest.procs import GatewayProcess
from loadtest.report import command_line, publish


def targets(workers: list[int]) -> dict[str, int]:
    """The rows: the pod straight, then the gateway with each worker count."""
    return {"direct": 0, **{f"{n} worker{'s' if n > 1 else ''}": n for n in workers}}

SETUPS = ("nginx", "podsim")


def _gateway(pod_url: str, workers: int, work: Path) -> tuple[GatewayProcess | None, str, dict[str, str]]:
    """The gateway in front of ``pod_url`` with ``workers`` (none for ``direct``): its URL and key."""
    if not workers:
        return None, pod_url, {}
    config, key = gateway_config(pod_url, work / "keys.yaml")
    gateway = start_gateway(pod_url, False, config, workers=workers)
    return gateway, gateway.url, auth_headers(key)


def _stop(gateway: GatewayProcess | None) -> None:
    if gateway is not None:
        gateway.__exit__(None, None, None)


def run_nginx_pod(target: str, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """The gateway-bound setup: nginx's canned answer, ``h2load --h1``; tokens/s and everyone's CPU."""
    workers = args.targets[target]
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        work = Path(tmp)
        pod = NginxPod(work / "pod", MODEL, args.tokens, workers=args.pod_workers).start()
        body = work / "body.json"
        body.write_bytes(chat_body(args.tokens))
        gateway, base, headers = _gateway(pod.url, workers, work)
        try:
            got = count_tokens(stream_once(base, args.tokens, headers))  # h2load shows no bodies
            if got != args.tokens:
                raise RuntimeError(f"an answer through {base} had {got} tokens, not {args.tokens}")
            argv = [H2LOAD, "--h1", "-c", str(args.clients), "-t", str(args.threads), "-d", str(body),
                    "-H", "content-type: application/json",
                    *(item for name, value in headers.items() for item in ("-H", f"{name}: {value}")),
                    base + "/v1/chat/completions"]
            warm = [*argv[:6], "-n", str(args.clients * 20), *argv[6:]]
            subprocess.run(warm, capture_output=True, check=False)
            # A fixed count gives each connection the same share, so a worker the kernel handed
            # fewer connections idles once they are done; a timed run keeps every one busy.
            amount = ["-D", str(args.duration)] if args.duration else ["-n", str(args.requests)]
            mine = process_tree(gateway.pid) if gateway else []
            before, pod_before = cpu_ticks(mine), cpu_ticks(process_tree(pod.pid))
            load_before = resource.getrusage(resource.RUSAGE_CHILDREN)
            started = time.monotonic()
            done = subprocess.run([*argv[:6], *amount, *argv[6:]],
                                  capture_output=True, text=True, timeout=600, check=False)
            wall = time.monotonic() - started
            load_after = resource.getrusage(resource.RUSAGE_CHILDREN)
            after = cpu_ticks(process_tree(gateway.pid) if gateway else [])
            user, system = cpu_delta_s(before, after)
            pod_user, pod_system = cpu_delta_s(pod_before, cpu_ticks(process_tree(pod.pid)))
            split = _split(gateway.pid, before, after, wall) if gateway else {}
        finally:
            _stop(gateway)
            pod.stop()
    load = parse_h2load(done.stdout + done.stderr)
    tokens = load["ok"] * args.tokens
    load_cpu = sum(getattr(load_after, f) - getattr(load_before, f) for f in ("ru_utime", "ru_stime"))
    return {
        "setup": "nginx", "target": target, "errors": load["errors"], "tokens_per_s": tokens / wall,
        "req_s": load["ok"] / wall,
        "cpu_ms_per_1k": (user + system) * 1e6 / tokens if workers and tokens else None,
        "cores": (user + system) / wall if workers else None,
        "others_cores": (pod_user + pod_system + load_cpu) / wall,
        **split,
    }


def _split(
    supervisor: int, before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]], wall: float
) -> dict[str, Any]:
    """Where the gateway's cores went: each worker's (lowest, highest), the supervisor's and its
    private redis-server's (none with one worker: the one process is the gateway)."""
    cores: dict[str, list[float]] = {"worker": [], "redis": [], "supervisor": []}
    for pid, ticks in after.items():
        user, system = cpu_delta_s(before, {pid: ticks})
        name = _name(pid)  # the worker template (gateway/workers/template.py) counts as the supervisor's
        if pid == supervisor or name == TEMPLATE:
            kind = "supervisor"
        else:
            kind = "redis" if "redis" in name else "worker"
        cores[kind].append((user + system) / wall)
    if not cores["worker"]:
        return {}
    return {"worker_cores": (min(cores["worker"]), max(cores["worker"])),
            "redis_cores": sum(cores["redis"]), "supervisor_cores": sum(cores["supervisor"])}


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def run_podsim(target: str, args: argparse.Namespace, scenario: Scenario, scratch: Path) -> dict[str, Any]:
    """The whole-host setup: a fresh pod simulator (and gateway), a warm-up, then the load."""
    workers = args.targets[target]
    with tempfile.TemporaryDirectory(dir=scratch) as work:
        pod = start_pod(scenario, pin=False)
        gateway = None
        try:
            gateway, base, headers = _gateway(pod.url, workers, Path(work))
            warm_up(base, headers=headers)
            url = base + "/v1/chat/completions"
            run_loadgen(url, scenario, False, requests=1, max_tokens=2, headers=headers)
            pids = process_tree(gateway.pid) if gateway else []
            before = cpu_ticks(pids)
            load = run_loadgen(url, scenario, False, headers=headers)
            pids = process_tree(gateway.pid) if gateway else []
            user, system = cpu_delta_s(before, cpu_ticks(pids))
            memory = _memory(gateway.pid, pids) if gateway else {}
        finally:
            _stop(gateway)
            pod.stop()
            pod.close()
    tokens, wall = load["tokens"], load["wall_s"] or 1.0
    return {
        "setup": "podsim", "target": target, "errors": load["errors"], "tokens_per_s": load["tokens_per_s"],
        "cpu_ms_per_1k": (user + system) * 1e6 / tokens if workers and tokens else None,
        "cores": (user + system) / wall if workers else None,
        **memory,
    }


def _rollup_kb(pid: int) -> dict[str, int]:
    """A process's ``/proc/PID/smaps_rollup`` totals, in KiB ({} once it has gone)."""
    try:
        lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]
    except OSError:
        return {}
    return {name: int(value.split()[0]) for name, value in (line.split(":", 1) for line in lines)}


def _memory(gateway_pid: int, pids: list[int]) -> dict[str, float]:
    """The gateway's PSS over all its processes, and the largest USS of a worker (of the gateway
    itself, with one worker), in MB."""
    rollups = {pid: _rollup_kb(pid) for pid in pids}
    pss = sum(r.get("Pss", 0) for r in rollups.values())
    serving = [pid for pid in pids if pid != gateway_pid and _name(pid) not in ("redis-server", TEMPLATE)]
    serving = serving or [gateway_pid]
    own = max(rollups[pid].get("Private_Clean", 0) + rollups[pid].get("Private_Dirty", 0) for pid in serving)
    return {"pss_mb": pss / 1024, "worker_uss_mb": own / 1024}


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def _cell(value: float | None, form: str) -> str:
    return "—" if value is None else format(value, form)


def _where(group: list[dict[str, Any]]) -> str:
    """The split of the group's first run that has one (a worker count's runs are alike)."""
    row = next((r for r in group if "worker_cores" in r), None)
    if row is None:
        return "—"
    low, high = row["worker_cores"]
    return f"{low:.2f}-{high:.2f}, {row['supervisor_cores']:.2f}, {row['redis_cores']:.2f}"


def render(rows: list[dict[str, Any]], args: argparse.Namespace, argv: list[str] | None) -> str:
    out = [f"Command: `{command_line('loadtest.bench_workers', argv)}`  ",
           f"Nothing pinned; medians of {args.repeats} interleaved runs.", ""]
    for setup in args.setups:
        mine = [r for r in rows if r["setup"] == setup]
        if not mine:
            continue
        if setup == "nginx":
            out += [
                f"**Gateway-bound**: nginx ({args.pod_workers} worker{'s' if args.pod_workers > 1 else ''}) "
                f"answering a canned {args.tokens}-token vLLM stream, `h2load --h1` with {args.clients} "
                f"connections on {args.threads} thread{'s' if args.threads > 1 else ''}, "
                + (f"for {args.duration} s." if args.duration else f"{args.requests} requests."),
                "",
                "| target | errors | requests/s | tokens/s | gateway CPU-ms per 1000 tokens "
                "| gateway cores busy | of which workers (lowest-highest), supervisor, Redis "
                "| pod + h2load cores busy |",
                "| --- | --- | --- | --- | --- | --- | --- | --- |",
            ]
        else:
            out += [
                f"**Whole host**: the pod simulator unpaced, {args.streams} concurrent streams of "
                f"{args.stream_tokens} tokens, {args.stream_requests} each, from the Python load generator.",
                "",
                "| target | errors | tokens/s | gateway CPU-ms per 1000 tokens | gateway cores busy "
                "| gateway memory, PSS MB (all processes) | a worker's own, USS MB |",
                "| --- | --- | --- | --- | --- | --- | --- |",
            ]
        for target in args.targets:
            group = [r for r in mine if r["target"] == target]
            if not group:
                continue
            cells = [target, str(sum(r["errors"] for r in group))]
            if setup == "nginx":
                cells.append(_cell(_median(group, "req_s"), ".0f"))
            cells += [_cell(_median(group, "tokens_per_s"), ".0f"),
                      _cell(_median(group, "cpu_ms_per_1k"), ".1f"), _cell(_median(group, "cores"), ".2f")]
            if setup == "nginx":
                cells.append(_where(group))
                cells.append(_cell(_median(group, "others_cores"), ".2f"))
            else:
                cells += [_cell(_median(group, "pss_mb"), ".0f"),
                          _cell(_median(group, "worker_uss_mb"), ".0f")]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out).rstrip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_workers", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--setup", default="nginx,podsim",
                        help="comma list of setups: nginx (gateway-bound), podsim (whole host)")
    parser.add_argument("--tokens", type=int, default=64, help="nginx setup: tokens in the canned answer")
    parser.add_argument("--clients", type=int, default=64, help="nginx setup: h2load's connections")
    parser.add_argument("--threads", type=int, default=1, help="nginx setup: h2load's threads (-t)")
    parser.add_argument("--pod-workers", type=int, default=1, help="nginx setup: the pod's nginx workers")
    parser.add_argument("--workers", default="1,2", help="comma list of gateway worker counts (1,2)")
    parser.add_argument("--requests", type=int, default=20000, help="nginx setup: requests in all")
    parser.add_argument("--duration", type=int, metavar="S",
                        help="nginx setup: load for S seconds (h2load -D) instead of --requests")
    parser.add_argument("--streams", type=int, default=256, help="podsim setup: concurrent streams")
    parser.add_argument("--stream-tokens", type=int, default=512, help="podsim setup: tokens a request")
    parser.add_argument("--stream-requests", type=int, default=2, help="podsim setup: requests a stream")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write-md", metavar="FILE")
    args = parser.parse_args(argv)
    args.setups = [s.strip() for s in args.setup.split(",") if s.strip()]
    try:
        counts = [int(n) for n in args.workers.split(",") if n.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        parser.error(f"--workers takes a comma list of counts of 1 or more, not {args.workers!r}")
    args.targets = targets(counts)
    unknown = [s for s in args.setups if s not in SETUPS]
    if unknown or not args.setups:
        parser.error(f"--setup takes {', '.join(SETUPS)}; not {', '.join(unknown) or 'nothing'}")
    if "nginx" in args.setups and (nginx_binary() is None or not Path(H2LOAD).exists()):
        print("bench_workers: the gateway-bound setup needs nginx and h2load (make bench-deps); skipped",
              file=sys.stderr)
        args.setups.remove("nginx")
    raise_open_file_limit()
    scenario = Scenario("w", "saturation", args.streams, args.stream_requests, args.stream_tokens, itl_ms=0.0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-workers-") as scratch:
        for repeat in range(args.repeats):
            for setup in args.setups:
                for target in args.targets:
                    if setup == "nginx":
                        row = run_nginx_pod(target, args, Path(scratch))
                    else:
                        row = run_podsim(target, args, scenario, Path(scratch))
                    print(f"bench_workers: {setup} {target} #{repeat + 1}: {row}", file=sys.stderr)
                    rows.append(row)
    publish(render(rows, args, argv), args.write_md, "workers")
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
