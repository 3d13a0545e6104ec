"""``sluicegate loadtest``: closed- or open-loop streaming load, a sweep to saturation, JSON out.

Modes: ``--concurrency N`` (closed loop: N requests in flight, the next sent when one ends),
``--rate R`` (open loop: R requests/s on a fixed schedule, ``--arrivals poisson`` for seeded
exponential gaps), ``--sweep L1,L2,...`` (the rates or concurrencies in turn, stopping once the
error rate or goodput collapses, and naming the knee). See docs/load-testing.md.

Summary JSON (stdout, or ``--json FILE``), schema ``sluicegate.loadtest/1``; all times in ms, each
latency as ``{p50, p90, p99, max, mean, count}``:

- ``config``: mode ("closed"/"open"), concurrency, rate, arrivals, seed, duration_s, requests,
  transport, url, model, max_tokens (override or null), prompts (file), max_inflight
- ``wall_s``; ``requests``: scheduled, sent, ok, errors, error_rate, error_kinds, error_samples
- ``throughput``: requests_per_s (successful), output_tokens_per_s (usage), tokens_seen_per_s
- ``tokens``: output, seen, usage_mismatch_requests, usage_missing_requests
- ``ttft_ms``, ``itl_ms``, ``tpot_ms``, ``e2e_ms``: service latencies, from the real send
- ``ttft_from_schedule_ms``, ``response_ms``: from the scheduled send (open loop: coordinated
  omission corrected); ``dispatch_delay_ms``: real send minus scheduled send
- ``goodput``: null, or {targets, requests, fraction, per_s} (TTFT and e2e from the schedule)
- ``by_transport``, ``by_variant``, ``by_pod``: per value {requests, ok, requests_per_s} plus the
  six latency blocks above ("None" when the gateway sent no such header)
- ``loadgen``: cpu_percent, cpu_user_s, cpu_sys_s, loop_lag_ms, peak_inflight
A sweep prints ``{"schema": "sluicegate.loadtest.sweep/1", "levels": [summary, ...], "knee": level
or null, "stopped": reason or null}``.

``--raw FILE.jsonl``: one line per request (drive.Record.raw), with ``level`` in a sweep.
Exit status: 0 when the run completed with at least one successful request, 1 when none
succeeded, 2 for bad flags or an unreadable prompts file (one line on stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
from pathlib import Path
from typing import IO, Any

DEFAULT_PROMPTS = Path(__file__).with_name("prompts") / "synthetic.jsonl"
TRANSPORT_CHOICES = ("h1", "h2", "h3", "grpc-web")

DESCRIPTION = __doc__.split("\n\n")[1] if __doc__ else ""


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a whole number above 0, not {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``sluicegate loadtest`` (also ``python -m loadtest.loadtest_cli``)."""
    parser.add_argument("url", help="the gateway's (or any OpenAI-compatible server's) base URL, "
                        "e.g. http://127.0.0.1:8080")
    parser.add_argument("--model", required=True, help="model name to request")
    shape = parser.add_mutually_exclusive_group(required=True)
    shape.add_argument("--concurrency", type=_positive_int, help="closed loop: requests in flight")
    shape.add_argument("--rate", type=_positive_float, help="open loop: requests per second")
    parser.add_argument("--arrivals", choices=("constant", "poisson"), default="constant",
                        help="open loop: evenly spaced or Poisson arrivals (default constant)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals (default 0)")
    parser.add_argument("--duration", type=_positive_float, metavar="S",
                        help="stop scheduling after S seconds")
    parser.add_argument("--requests", type=_positive_int, metavar="N", help="stop after N requests")
    parser.add_argument("--sweep", metavar="L1,L2,...",
                        help="run each rate (with --rate) or concurrency (with --concurrency) in turn; "
                        "the flag's own value is ignored")
    parser.add_argument("--prompts", metavar="FILE.jsonl", default=str(DEFAULT_PROMPTS),
                        help="prompts, one JSON object a line with 'prompt' and 'max_tokens' "
                        "(default: the shipped synthetic set)")
    parser.add_argument("--max-tokens", type=_positive_int, help="max_tokens for every request, "
                        "instead of each prompt's")
    parser.add_argument("--transport", choices=TRANSPORT_CHOICES, default="h1",
                        help="h1 (lean client), h2, h3 (https only) or grpc-web (default h1)")
    parser.add_argument("--api-key", default=os.environ.get("SLUICEGATE_API_KEY"),
                        help="Bearer key (default: $SLUICEGATE_API_KEY)")
    parser.add_argument("--cacert", metavar="PEM", help="CA file to verify an https:// server with")
    parser.add_argument("--goodput", metavar="ttft_ms=..,tpot_ms=..,e2e_ms=..",
                        help="targets a request must all meet to count as goodput")
    parser.add_argument("--max-inflight", type=_positive_int, default=None,
                        help="open loop: hold requests back beyond this many in flight (shows as "
                        "dispatch delay; default no cap)")
    parser.add_argument("--timeout-s", type=_positive_float, default=300.0,
                        help="per-request limit (default 300)")
    parser.add_argument("--raw", metavar="FILE.jsonl", help="write one JSON line per request")
    parser.add_argument("--json", metavar="FILE", help="write the summary here instead of stdout")
    parser.add_argument("--pretty", action="store_true", help="indent the summary")


def load_prompts(path: str) -> list[Any]:
    """The prompts file as ``drive.Prompt``s; ValueError with the line at fault."""
    from loadtest.drive import Prompt

    prompts = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompts.append(Prompt(str(row["prompt"]), int(row.get("max_tokens", 64))))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a prompt line ({exc})") from None
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def _levels(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[float]:
    if not args.sweep:
        return [args.rate or args.concurrency]
    try:
        levels = [float(part) for part in args.sweep.split(",") if part.strip()]
    except ValueError:
        parser.error(f"--sweep {args.sweep!r}: expected numbers separated by commas")
    if not levels or any(level <= 0 for level in levels):
        parser.error("--sweep needs levels above 0")
    if args.concurrency and any(level != int(level) for level in levels):
        parser.error("--sweep with --concurrency needs whole numbers")
    return levels


def check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[list[float], Any, list[Any]]:
    """Flags that argparse cannot check alone; each problem is one ``parser.error`` (exit 2)."""
    from loadtest.results import parse_goodput

    if not (args.duration or args.requests):
        parser.error("give --duration S or --requests N (or both): a load test needs an end")
    if args.concurrency and (args.arrivals != "constant" or args.max_inflight):
        parser.error("--arrivals and --max-inflight shape open-loop load; use them with --rate")
    if not args.url.startswith(("http://", "https://")):
        parser.error(f"url must start with http:// or https://, not {args.url!r}")
    if args.transport == "h3" and not args.url.startswith("https://"):
        parser.error("--transport h3 needs an https:// URL (QUIC is always encrypted)")
    targets = None
    if args.goodput:
        try:
            targets = parse_goodput(args.goodput)
        except ValueError as exc:
            parser.error(f"--goodput: {exc}")
    try:
        prompts = load_prompts(args.prompts)
    except (OSError, ValueError) as exc:
        parser.error(f"--prompts: {exc}")
    return _levels(args, parser), targets, prompts


async def _run_level(args: argparse.Namespace, level: float, prompts: list[Any], targets: Any,
                     raw: IO[str] | None, sweep: bool) -> dict[str, Any]:
    from loadtest.drive import Driver, Plan
    from loadtest.results import summarize

    plan = Plan(
        base_url=args.url, model=args.model, prompts=prompts,
        concurrency=int(level) if args.concurrency else 0, rate=level if args.rate else 0.0,
        arrivals=args.arrivals, seed=args.seed, duration_s=args.duration or 0.0,
        requests=args.requests or 0, max_tokens=args.max_tokens, transport=args.transport,
        api_key=args.api_key, cacert=args.cacert, timeout_s=args.timeout_s,
        max_inflight=args.max_inflight or 0,
    )
    result = await Driver(plan).run()
    config = {
        "mode": "open" if plan.open_loop else "closed", "concurrency": plan.concurrency or None,
        "rate": plan.rate or None, "arrivals": plan.arrivals if plan.open_loop else None,
        "seed": plan.seed, "duration_s": args.duration, "requests": args.requests,
        "transport": plan.transport, "url": plan.base_url, "model": plan.model,
        "max_tokens": plan.max_tokens, "prompts": args.prompts, "max_inflight": args.max_inflight,
    }
    if raw is not None:
        extra = {"level": level} if sweep else {}
        for record in result.records:
            raw.write(json.dumps(record.raw(result.started, **extra), separators=(",", ":")) + "\n")
    return summarize(result, config, targets)


async def _run(args: argparse.Namespace, levels: list[float], prompts: list[Any], targets: Any,
               raw: IO[str] | None) -> dict[str, Any]:
    from loadtest.results import collapsed, knee, sweep_metric

    if not args.sweep:
        return await _run_level(args, levels[0], prompts, targets, raw, False)
    summaries: list[dict[str, Any]] = []
    stopped = None
    for level in levels:
        summary = await _run_level(args, level, prompts, targets, raw, True)
        summaries.append(summary)
        best = max(sweep_metric(s) for s in summaries[:-1]) if len(summaries) > 1 else 0.0
        stopped = collapsed(summary, best)
        print(f"sluicegate loadtest: level {level:g}: {sweep_metric(summary):g}/s"
              + (f"; stopping: {stopped}" if stopped else ""), file=sys.stderr)
        if stopped:
            break
    metrics = [sweep_metric(s) for s in summaries]
    return {
        "schema": "sluicegate.loadtest.sweep/1",
        "levels": summaries,
        "knee": knee(levels[: len(summaries)], metrics),
        "stopped": stopped,
    }


def run(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    """Run ``sluicegate loadtest`` from parsed flags; the exit status."""
    from gateway.rlimits import raise_open_file_limit

    parser = parser or build_parser()
    levels, targets, prompts = check(args, parser)
    raise_open_file_limit()
    runner: Any = asyncio.run
    if args.transport == "h1":  # the lean path; aioquic's UDP endpoint does not run on uvloop
        try:
            import uvloop

            runner = uvloop.run
        except ImportError:  # pragma: no cover - uvloop is a project dependency on Linux
            pass
    gc.freeze()  # a short-lived process: keep the collector out of the per-token path
    try:
        raw = open(args.raw, "w", encoding="utf-8") if args.raw else None  # noqa: SIM115
    except OSError as exc:
        parser.error(f"--raw: {exc}")
    try:
        summary = runner(_run(args, levels, prompts, targets, raw))
    except OSError as exc:
        print(f"sluicegate loadtest: {exc}", file=sys.stderr)
        return 1
    finally:
        if raw is not None:
            raw.close()
    text = json.dumps(summary, indent=2 if args.pretty else None)
    if args.json:
        Path(args.json).write_text(text + "\n")
    else:
        print(text, flush=True)
    levels_out = summary.get("levels", [summary])
    return 0 if any(s["requests"]["ok"] for s in levels_out) else 1


def build_parser() -> argparse.ArgumentParser:
    """A stand-alone parser (``python -m loadtest.loadtest_cli``), the same flags as the subcommand."""
    parser = argparse.ArgumentParser(prog="sluicegate loadtest", description=DESCRIPTION)
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    return run(parser.parse_args(argv), parser)


if __name__ == "__main__":
    sys.exit(main())
