"""The benchmark report: charts drawn from saved JSON, and the scale curve and goodput sweep run for real.

The chart tests feed ``loadtest.make_report`` small synthetic outputs of each benchmark (the shapes the
benchmarks write) and check that every chart is a real PNG and that the page shows it. The smoke tests
run ``loadtest.bench_scale`` and ``loadtest.bench_goodput`` end to end against real pod simulators and a
real gateway, for a few seconds, and check the fields the report is drawn from; no speed is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from loadtest import make_report
from loadtest.bench_scale import SCHEMA as SCALE_SCHEMA
from loadtest.bench_scale import Level, ScaleSpec, histogram_quantile, judge, plan_streams_per_core

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TRANSPORTS = """# Benchmarks

<!-- bench:transports:begin -->
| transport | TTFT p50 ms | TTFT p99 ms | added TTFT p50 ms | gateway CPU ms / 1000 tokens |
| --- | --- | --- | --- | --- |
| direct to the pod (HTTP/1.1) | 21.00 | 21.47 | - | - |
| h1 (cleartext) | 21.27 | 24.04 | 0.27 | 17.0 |
| h3 (QUIC) | 22.05 | 24.57 | 1.04 | 106.0 |
<!-- bench:transports:end -->
"""


def _bench_json() -> dict[str, Any]:
    runs = []
    for scenario, streams in (("a", 1), ("b", 100), ("c", 500), ("d", 2000)):
        for target, added in (("direct", 0.0), ("gateway", 0.4), ("nginx", 0.2)):
            for repeat in (1, 2):
                proxied = target != "direct"
                runs.append({
                    "scenario": scenario, "target": target, "repeat": repeat, "pod_cpu_s": 0.2,
                    "profile": None, "error": None,
                    "proxy_user_s": 0.01 * streams if proxied else None,
                    "proxy_sys_s": 0.005 * streams if proxied else None,
                    "proxy_peak_rss_kib": 50_000 + 30 * streams if proxied else None,
                    "load": {
                        "requests": streams, "ok": streams, "errors": 0, "completed_streams": streams,
                        "tokens": streams * 64, "wall_s": 2.0, "tokens_per_s": streams * 32.0,
                        "ttft_ms": {"p50": 1 + added, "p90": 1.5 + added, "p99": 2 + added, "max": 3 + added},
                        "loadgen_cpu_s": {"user": 0.1, "sys": 0.05}, "error_samples": [],
                    },
                })
    return {"command": "synthetic", "machine": "test", "notes": [], "elapsed_s": 1.0, "runs": runs}


def _goodput_json() -> dict[str, Any]:
    def level(rate: float, good: float) -> dict[str, Any]:
        return {"config": {"rate": rate}, "goodput": {"per_s": good},
                "throughput": {"requests_per_s": min(rate, 19.0)}, "requests": {"errors": 0}}

    sweep = {"levels": [level(4, 4), level(12, 11.5), level(24, 6)], "knee": 12.0, "stopped": None,
             "lowest_level_ttft_ms": [51.0, 52.5, 50.2, 55.0]}
    return {"schema": "sluicegate.bench_goodput/1", "command": "synthetic", "machine": "test",
            "rates": [4, 12, 24], "seconds": 10, "goodput": "ttft_ms=500,tpot_ms=40",
            "targets": {"direct": sweep, "gateway": sweep, "nginx": sweep}, "failures": {}}


def _scale_json() -> dict[str, Any]:
    spec = ScaleSpec()
    levels = []
    for streams, lag in ((100, 2.0), (1000, 8.0), (10000, 140.0)):
        levels.append(Level(
            streams, max(1, streams // 2000), requests=2 * streams, ok=2 * streams, completed_streams=streams,
            tokens=40 * streams, wall_s=45.0, ttft_ms={"p50": 501.0, "p99": 530.0},
            cpu_ms_per_1k_tokens=15.0, gateway_core_busy=0.1, peak_rss_kib=80_000 + 20 * streams,
            lag_ms={"p50": 0.5, "p99": lag, "max_le": 200.0, "samples": 900}, core0_busy=0.4,
        ))
    judge(levels, spec)
    return {"schema": SCALE_SCHEMA, "command": "synthetic", "machine": "test", "elapsed_s": 300,
            "spec": asdict(spec), "levels": [asdict(lv) for lv in levels],
            "plan": plan_streams_per_core(levels, spec)}


def _write(directory: Path, name: str, data: dict[str, Any]) -> None:
    (directory / name).write_text(json.dumps(data))


def _run(module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


def _is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 5000


def test_every_chart_is_drawn_and_shown_on_the_page(tmp_path: Path) -> None:
    saved = tmp_path / "saved"
    saved.mkdir()
    _write(saved, "bench.json", _bench_json())
    _write(saved, "goodput.json", _goodput_json())
    _write(saved, "scale.json", _scale_json())
    page, img = tmp_path / "docs" / "benchmarks.md", tmp_path / "docs" / "img"
    page.parent.mkdir()
    page.write_text(TRANSPORTS)

    assert make_report.main(["--from-json", str(saved), "--write-md", str(page), "--img-dir", str(img)]) == 0

    text = page.read_text()
    charts = text.split("<!-- bench:charts:begin -->", 1)[1].split("<!-- bench:charts:end -->", 1)[0]
    for name in make_report.CHART_FILES.values():
        assert _is_png(img / name), name
        assert f"](img/{name})" in charts
    assert "No " not in charts
    # the JSON-backed sections are written again from the saved files
    for section in ("results", "scale", "goodput"):
        assert f"<!-- bench:{section}:begin -->" in text
    assert "10000 | loadgen (h1) | 5 | 20000 / 20000" in text  # the scale table's top level
    assert "no: loop lag p99 140 ms > 100" in text
    assert "**Plan for 1000 streams per gateway core**" in text


def test_a_missing_input_leaves_its_chart_out_and_says_so(tmp_path: Path) -> None:
    _write(tmp_path, "scale.json", _scale_json())
    page, img = tmp_path / "benchmarks.md", tmp_path / "img"

    argv = ["--from-json", str(tmp_path), "--write-md", str(page), "--img-dir", str(img)]
    assert make_report.main(argv) == 0

    assert sorted(p.name for p in img.iterdir()) == ["bench-scale.png"]
    text = page.read_text()
    assert "No ttft chart: bench.json is missing." in text
    assert "No transports chart: the bench:transports section is missing." in text


def test_a_missing_directory_is_one_message(tmp_path: Path) -> None:
    done = _run("loadtest.make_report", "--from-json", str(tmp_path / "nope"))
    assert done.returncode == 2
    assert "is not a directory" in done.stderr and "Traceback" not in done.stderr


def test_histogram_quantile_interpolates_inside_the_bucket() -> None:
    before = {0.001: 10.0, 0.01: 10.0, 0.1: 10.0, float("inf"): 10.0}
    after = {0.001: 60.0, 0.01: 150.0, 0.1: 160.0, float("inf"): 160.0}  # 150 new: 50, 90, 10 per bucket
    assert histogram_quantile(0.5, before, after) == pytest.approx(0.001 + 0.009 * (75 - 50) / 90)
    assert histogram_quantile(0.99, before, after) == pytest.approx(0.01 + 0.09 * (148.5 - 140) / 10)
    assert histogram_quantile(0.5, after, after) is None


def test_scale_curve_smoke_reports_memory_cpu_and_the_gateways_loop_lag(tmp_path: Path) -> None:
    out, page = tmp_path / "scale.json", tmp_path / "benchmarks.md"
    done = _run("loadtest.bench_scale", "--levels", "20,40", "--tokens", "4", "--itl-ms", "100",
                "--ttft-ms", "50", "--no-pin", "--json", str(out), "--write-md", str(page))
    assert done.returncode == 0, done.stderr[-3000:]

    saved = json.loads(out.read_text())
    small, large = saved["levels"]
    for level in (small, large):
        assert level["failure"] is None and level["errors"] == 0
        assert level["ok"] == level["requests"] == 2 * level["streams"]
        assert level["tokens"] == 4 * level["requests"]
        assert level["peak_rss_kib"] > 0 and level["cpu_ms_per_1k_tokens"] is not None
        # the gateway's own sluicegate_event_loop_lag_seconds histogram, scraped around the load
        assert level["lag_ms"]["samples"] > 0 and level["lag_ms"]["p99"] is not None
    assert small["mem_per_stream_kib"] is None and isinstance(large["mem_per_stream_kib"], float)
    section = page.read_text()
    assert "<!-- bench:scale:begin -->" in section and "memory per stream KiB" in section


def test_goodput_sweep_smoke_feeds_the_goodput_charts(tmp_path: Path) -> None:
    out = tmp_path / "goodput.json"
    done = _run("loadtest.bench_goodput", "--rates", "5,10", "--seconds", "1", "--target", "direct,gateway",
                "--no-pin", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]

    saved = json.loads(out.read_text())
    for target in ("direct", "gateway"):
        sweep = saved["targets"][target]
        assert [lv["config"]["rate"] for lv in sweep["levels"]] == [5.0, 10.0]
        assert sweep["lowest_level_ttft_ms"] and all(t > 0 for t in sweep["lowest_level_ttft_ms"])
    section, written = make_report.render_charts(tmp_path, tmp_path / "page.md", tmp_path / "img")
    assert sorted(p.name for p in written) == ["bench-goodput.png", "bench-ttft-cdf.png"]
    assert "](img/bench-goodput.png)" in section and "No scale chart: scale.json is missing." in section
    assert all(_is_png(p) for p in written)
