"""``make report``: run the benchmarks with JSON outputs, then draw their charts into the benchmark page.

Tables alone hide shapes: a TTFT tail, where CPU per token bends with concurrency, where goodput
falls off. This runs every ``make bench`` step (each rewrites its own ``bench:NAME`` section of
``docs/benchmarks.md``), the scale curve (``loadtest.bench_scale``) and the goodput sweep
(``loadtest.bench_goodput``), keeping the JSON of those that have one in ``--dir``; then it draws
PNG charts with matplotlib (Agg: no display needed) into ``docs/img/`` and writes the
``bench:charts`` section that shows them. ``--from-json DIR`` runs nothing: it re-renders the JSON
sections and the charts from an earlier run's directory.

Inputs per chart (a chart whose input is missing is left out, saying so):

- ``bench.json`` (``loadtest.bench --json``): TTFT percentiles per scenario; CPU and RSS per scenario
- ``goodput.json`` (``loadtest.bench_goodput``): goodput against offered load; the TTFT distribution
  of its lowest level's requests
- the ``bench:transports`` section's table in the Markdown file: per-transport TTFT and CPU
- ``scale.json`` (``loadtest.bench_scale``): memory, CPU, loop lag and TTFT against streams

    python -m loadtest.make_report [--dir .bench/report] [--write-md docs/benchmarks.md] [--img-dir docs/img]
    python -m loadtest.make_report --from-json .bench/report
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loadtest.report import publish

CHART_FILES = {
    "ttft": "bench-ttft.png",
    "ttft_cdf": "bench-ttft-cdf.png",
    "cpu_rss": "bench-cpu-rss.png",
    "goodput": "bench-goodput.png",
    "transports": "bench-transports.png",
    "scale": "bench-scale.png",
}
ALT_TEXT = {
    "ttft": "TTFT percentiles per scenario",
    "ttft_cdf": "TTFT distribution below saturation",
    "cpu_rss": "CPU per 1,000 tokens and RSS against concurrency",
    "goodput": "Goodput against offered load",
    "transports": "Added TTFT and CPU per transport",
    "scale": "Scale curve",
}
COLORS = {"direct": "#4c72b0", "gateway": "#dd8452", "nginx": "#55a868"}
# The make bench steps, in its order, then the two that only the report runs. {dir}/{md} are filled in.
STEPS: list[tuple[str, list[str]]] = [
    ("bench", ["loadtest.bench", "--json", "{dir}/bench.json", "--write-md", "{md}"]),
    ("instructions", ["loadtest.bench_instructions", "--write-md", "{md}"]),
    ("disconnects", ["loadtest.bench_disconnects", "--write-md", "{md}"]),
    ("resume", ["loadtest.bench_resume", "--write-md", "{md}"]),
    ("shed", ["loadtest.bench_shed", "--write-md", "{md}"]),
    ("reaction", ["loadtest.bench_reaction", "--write-md", "{md}"]),
    ("transports", ["loadtest.bench_transports", "--write-md", "{md}"]),
    ("h2", ["loadtest.bench_h2", "--write-md", "{md}"]),
    ("workers", ["loadtest.bench_workers", "--write-md", "docs/operations.md"]),
    ("overload", ["loadtest.bench_overload", "--write-md", "{md}"]),
    ("overload-slow-health", ["loadtest.bench_overload", "--health-delay-ms", "1500",
                              "--section", "overload-slow-health", "--write-md", "{md}"]),
    ("attacks", ["loadtest.bench_attacks", "--write-md", "{md}"]),
    ("admission", ["loadtest.bench_admission", "--write-md", "{md}"]),
    ("canary", ["loadtest.bench_canary", "--write-md", "{md}"]),
    ("scale", ["loadtest.bench_scale", "--json", "{dir}/scale.json", "--write-md", "{md}"]),
    ("goodput", ["loadtest.bench_goodput", "--json", "{dir}/goodput.json", "--write-md", "{md}"]),
]
# Re-rendering from JSON: the steps whose sections come from a file in the directory.
RERENDER = {"bench": "bench.json", "scale": "scale.json", "goodput": "goodput.json"}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plain_log(ax: Any, axis: str = "x") -> None:
    """A log scale labelled 100, 1000 rather than 10^2, 10^3."""
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    target = ax.xaxis if axis == "x" else ax.yaxis
    (ax.set_xscale if axis == "x" else ax.set_yscale)("log")
    target.set_major_formatter(ScalarFormatter())
    target.set_minor_formatter(NullFormatter())


def _save(plt: Any, fig: Any, out: Path) -> None:
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------- charts


def chart_ttft(bench: dict[str, Any], out: Path) -> str:
    """TTFT p50/p90/p99/max (medians over repeats) per scenario, one line per target."""
    from loadtest.bench import SCENARIOS

    plt = _pyplot()
    runs = [r for r in bench["runs"] if not r.get("error") and r.get("load")]
    keys = [k for k in SCENARIOS if any(r["scenario"] == k for r in runs)]
    fig, axes = plt.subplots(1, len(keys), figsize=(3.6 * len(keys), 3.4), squeeze=False)
    quantiles = ("p50", "p90", "p99", "max")
    for ax, key in zip(axes[0], keys, strict=True):
        for target, color in COLORS.items():
            mine = [r["load"]["ttft_ms"] for r in runs if r["scenario"] == key and r["target"] == target]
            values = [statistics.median(v) if (v := [t[q] for t in mine if t.get(q) is not None]) else None
                      for q in quantiles]
            if any(v is not None for v in values):
                ax.plot(quantiles, values, marker="o", color=color, label=target)
        streams = SCENARIOS[key].streams
        ax.set_title(f"({key}) {streams} stream{'s' * (streams > 1)}", fontsize=9)
        _plain_log(ax, "y")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("TTFT ms (log)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Time to first token by percentile: direct vs gateway vs nginx", fontsize=10)
    _save(plt, fig, out)
    drawn = f"{keys[0]}-{keys[-1]}" if len(keys) > 1 else keys[0]
    return (f"TTFT percentiles (p50, p90, p99, max; medians over repeats) for scenarios {drawn}, straight "
            "to the pod, through the gateway and through nginx: how far apart the lines sit is what each "
            "proxy adds.")


def chart_ttft_cdf(goodput: dict[str, Any], out: Path) -> str:
    """The distribution of per-request TTFT at the sweep's lowest (unsaturated) rate."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    rate = min(goodput["rates"])
    for target, color in COLORS.items():
        values = sorted(goodput["targets"].get(target, {}).get("lowest_level_ttft_ms", []))
        if values:
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post",
                    color=color, label=f"{target} ({len(values)} requests)")
    ax.set_xlabel("TTFT ms")
    ax.set_ylabel("share of requests")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"TTFT distribution at {rate:g} requests/s (open loop, below saturation)", fontsize=10)
    _save(plt, fig, out)
    return (f"Cumulative distribution of every request's TTFT at {rate:g} requests/s offered, open loop, "
            "direct vs gateway vs nginx (the pod's own TTFT is 50 ms plus its batching).")


def chart_cpu_rss(bench: dict[str, Any], out: Path) -> str:
    """Proxy CPU per 1,000 tokens and peak RSS against concurrent streams (every scenario but the
    long-prompt one, which has d's streams)."""
    from loadtest.bench import SCENARIOS, RunResult, aggregate

    plt = _pyplot()
    results = [RunResult(**{k: v for k, v in r.items() if k in RunResult.__slots__}) for r in bench["runs"]]
    rows = [r for r in aggregate(results) if not SCENARIOS[r.scenario].prompt_chars]
    fig, (cpu_ax, rss_ax) = plt.subplots(1, 2, figsize=(10, 3.6))
    for target in ("gateway", "nginx"):
        mine = sorted((r for r in rows if r.target == target), key=lambda r: SCENARIOS[r.scenario].streams)
        cpu = [(SCENARIOS[r.scenario].streams, r.cpu_total, r.scenario) for r in mine if r.cpu_total]
        rss = [(SCENARIOS[r.scenario].streams, r.peak_rss_mib) for r in mine if r.peak_rss_mib]
        style = {"marker": "o", "color": COLORS[target], "label": target}
        if cpu:
            cpu_ax.plot([c[0] for c in cpu], [c[1] for c in cpu], **style)
            for x, y, key in cpu:
                cpu_ax.annotate(key, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        if rss:
            rss_ax.plot([r[0] for r in rss], [r[1] for r in rss], **style)
    for ax, label in ((cpu_ax, "proxy CPU-ms per 1,000 tokens"), (rss_ax, "proxy peak RSS MiB")):
        _plain_log(ax)
        ax.set_xlabel("concurrent streams (log)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("What relaying costs the proxy as concurrency grows (scenarios a-d)", fontsize=10)
    _save(plt, fig, out)
    return ("Gateway and nginx CPU per 1,000 relayed tokens (user + system) and peak RSS at 1, 100, 500 and "
            "2,000 concurrent streams (scenarios a-d; d is paced at 200 ms a token, the others at 1-5 ms).")


def chart_goodput(goodput: dict[str, Any], out: Path) -> str:
    """Goodput (solid) and successful requests/s (dashed) against the offered rate, per target."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    top = max(goodput["rates"])
    for target, color in COLORS.items():
        levels = goodput["targets"].get(target, {}).get("levels", [])
        if not levels:
            continue
        rates = [lv["config"]["rate"] for lv in levels]
        ax.plot(rates, [lv["goodput"]["per_s"] for lv in levels], marker="o", color=color,
                label=f"{target} goodput")
        ax.plot(rates, [lv["throughput"]["requests_per_s"] for lv in levels], linestyle="--", color=color,
                alpha=0.6, label=f"{target} ok requests/s")
    ax.plot([0, top], [0, top], color="grey", linewidth=0.8, alpha=0.5, label="offered")
    ax.set_xlabel("offered requests/s (open loop)")
    ax.set_ylabel("requests/s")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(f"Goodput against offered load ({goodput['goodput']})", fontsize=10)
    _save(plt, fig, out)
    return (f"Requests per second meeting every target ({goodput['goodput']}, TTFT from the schedule) and "
            "all successful requests per second, against the offered open-loop rate, for a pod that "
            "saturates like a GPU (bounded batch, slower tokens per running sequence, a queue beyond).")


def transports_table(markdown: str) -> list[dict[str, Any]]:
    """The rows of the ``bench:transports`` section's table (empty when the section is missing)."""
    begin, end = "<!-- bench:transports:begin -->", "<!-- bench:transports:end -->"
    if begin not in markdown or end not in markdown:
        return []
    section = markdown.split(begin, 1)[1].split(end, 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or cells[0] in ("transport", "---"):
            continue

        def number(text: str) -> float | None:
            try:
                return float(text)
            except ValueError:
                return None

        rows.append({"transport": cells[0], "ttft_p50": number(cells[1]), "ttft_p99": number(cells[2]),
                     "added_ttft": number(cells[3]), "cpu": number(cells[4])})
    return rows


def chart_transports(rows: list[dict[str, Any]], out: Path) -> str:
    """Added TTFT and CPU per 1,000 tokens per transport, as bars."""
    plt = _pyplot()
    rows = [r for r in rows if r["cpu"] is not None]
    names = [r["transport"] for r in rows]
    fig, (ttft_ax, cpu_ax) = plt.subplots(1, 2, figsize=(10, 3.6))
    ttft_ax.barh(names, [r["added_ttft"] or 0.0 for r in rows], color="#dd8452")
    ttft_ax.set_xlabel("added TTFT p50 ms (vs straight to the pod)")
    cpu_ax.barh(names, [r["cpu"] for r in rows], color="#8172b3")
    cpu_ax.set_xlabel("gateway CPU-ms per 1,000 tokens")
    for ax in (ttft_ax, cpu_ax):
        ax.invert_yaxis()
        ax.grid(True, axis="x", alpha=0.3)
    cpu_ax.set_yticklabels([])
    fig.suptitle("Per transport: what the gateway adds to TTFT, and spends per token", fontsize=10)
    _save(plt, fig, out)
    return ("Per transport (HTTP/1.1, HTTP/2, HTTP/3, gRPC-Web; cleartext and TLS): the gateway's added TTFT "
            "at one stream and its CPU per 1,000 tokens at 50 streams, from the Transports table.")


def chart_scale(scale: dict[str, Any], out: Path) -> str:
    """Peak RSS, CPU per 1,000 tokens, loop lag p99 and TTFT p99 against concurrent streams."""
    plt = _pyplot()
    levels = [lv for lv in scale["levels"] if not lv.get("failure")]
    streams = [lv["streams"] for lv in levels]
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.4))
    panels: list[tuple[Any, str, Callable[[dict[str, Any]], float | None]]] = [
        (axes[0][0], "gateway peak RSS MiB", lambda lv: (lv["peak_rss_kib"] or 0) / 1024 or None),
        (axes[0][1], "gateway CPU-ms per 1,000 tokens", lambda lv: lv["cpu_ms_per_1k_tokens"]),
        (axes[1][0], "gateway event-loop lag p99 ms", lambda lv: lv["lag_ms"].get("p99")),
        (axes[1][1], "TTFT p99 ms", lambda lv: lv["ttft_ms"].get("p99")),
    ]
    for ax, label, value in panels:
        points = [(s, v) for s, lv in zip(streams, levels, strict=True) if (v := value(lv)) is not None]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color="#dd8452")
        for s, lv in zip(streams, levels, strict=True):
            if lv.get("broke") and (v := value(lv)) is not None:
                ax.plot([s], [v], marker="x", color="red", markersize=10)
        _plain_log(ax)
        ax.set_ylabel(label, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    spec = scale["spec"]
    lag_bound = spec["lag_bound_ms"]
    axes[1][0].axhline(lag_bound, color="red", linewidth=0.8, linestyle=":")
    axes[1][1].axhline(spec["ttft_bound_ms"], color="red", linewidth=0.8, linestyle=":")
    for ax in axes[1]:
        ax.set_xlabel("concurrent streams on one gateway process (log)")
    per_stream = [lv["mem_per_stream_kib"] for lv in levels if lv.get("mem_per_stream_kib")]
    memory = f"; ~{per_stream[-1]:.0f} KiB a stream at the top level" if per_stream else ""
    fig.suptitle(f"Scale curve: slow streams ({spec['itl_ms']:g} ms a token){memory}; red x: did not hold",
                 fontsize=10)
    _save(plt, fig, out)
    return ("The scale curve: one gateway process holding 100 to 10,000 slow streams; its peak memory, "
            "CPU per 1,000 tokens, event-loop lag p99 and the clients' TTFT p99 (dotted: the bounds; "
            "red x: a level that did not hold).")


# --------------------------------------------------------------------------- the page


def render_charts(source: Path, markdown: Path, img_dir: Path) -> tuple[str, list[Path]]:
    """Draw every chart whose input exists; the ``bench:charts`` section and the files written."""
    bench, goodput, scale = (_load(source / name) for name in ("bench.json", "goodput.json", "scale.json"))
    transports = transports_table(markdown.read_text()) if markdown.exists() else []
    plans: list[tuple[str, Any, Callable[[Any, Path], str], str]] = [
        ("ttft", bench, chart_ttft, "bench.json"),
        ("ttft_cdf", goodput, chart_ttft_cdf, "goodput.json"),
        ("cpu_rss", bench, chart_cpu_rss, "bench.json"),
        ("goodput", goodput, chart_goodput, "goodput.json"),
        ("transports", transports or None, chart_transports, "the bench:transports section"),
        ("scale", scale, chart_scale, "scale.json"),
    ]
    img_dir.mkdir(parents=True, exist_ok=True)
    relative = os.path.relpath(img_dir, markdown.parent)
    lines = ["Drawn by `python -m loadtest.make_report` (`make report`) from the runs above.", ""]
    written = []
    for key, data, draw, needs in plans:
        if not data:
            lines += [f"- No {key.replace('_', ' ')} chart: {needs} is missing.", ""]
            continue
        out = img_dir / CHART_FILES[key]
        caption = draw(data, out)
        written.append(out)
        lines += [f"![{ALT_TEXT[key]}]({relative}/{CHART_FILES[key]})", "", f"*{caption}*", ""]
    lines.append("The overload, admission and attack results stay tables (their sections above).")
    return "\n".join(lines), written


def run_steps(directory: Path, markdown: Path) -> list[str]:
    """Run every benchmark step; the names of those that failed (a failed step's section stays as it was)."""
    directory.mkdir(parents=True, exist_ok=True)
    failed = []
    for name, template in STEPS:
        argv = [sys.executable, "-m", *(a.format(dir=directory, md=markdown) for a in template)]
        started = time.monotonic()
        print(f"make_report: {name} ...", file=sys.stderr, flush=True)
        code = subprocess.run(argv, check=False).returncode
        took = time.monotonic() - started
        print(f"make_report: {name} exit {code} [{took:.0f} s]", file=sys.stderr, flush=True)
        if code:
            failed.append(name)
    return failed


def rerender(directory: Path, markdown: Path) -> None:
    """The sections whose numbers live in the directory's JSON files, written again from them."""
    for name, file in RERENDER.items():
        path = directory / file
        if not path.exists():
            continue
        module = dict(STEPS)[name][0]
        subprocess.run([sys.executable, "-m", module, "--from-json", str(path), "--write-md", str(markdown)],
                       check=True, stdout=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks (or re-read them) and draw the charts; 1 if a benchmark step failed."""
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.make_report", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--dir", default=".bench/report", help="JSON outputs (default %(default)s)")
    parser.add_argument("--from-json", metavar="DIR", help="run nothing: re-render from an earlier run's DIR")
    parser.add_argument("--write-md", default="docs/benchmarks.md", help="the page (default %(default)s)")
    parser.add_argument("--img-dir", default="docs/img", help="where the PNGs go (default docs/img)")
    args = parser.parse_args(argv)
    markdown, img_dir = Path(args.write_md), Path(args.img_dir)
    failed: list[str] = []
    started = time.monotonic()
    if args.from_json:
        source = Path(args.from_json)
        if not source.is_dir():
            parser.error(f"--from-json: {source} is not a directory")
        try:
            rerender(source, markdown)
        except subprocess.CalledProcessError as exc:
            print(f"make_report: re-rendering failed: {exc}", file=sys.stderr)
            return 1
    else:
        source = Path(args.dir)
        failed = run_steps(source, markdown)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("make_report: matplotlib is missing: pip install -e '.[bench]'", file=sys.stderr)
        return 1
    section, written = render_charts(source, markdown, img_dir)
    publish(section, str(markdown), "charts")
    print(f"make_report: {len(written)} charts in {img_dir}; {time.monotonic() - started:.0f} s"
          + (f"; failed steps: {', '.join(failed)}" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
