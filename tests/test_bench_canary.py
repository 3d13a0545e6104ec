"""A tiny smoke run of the canary benchmark: one scenario (canary 2x slower to first token) for 8 s
at 20 requests/s through real pods and a real gateway. At 5% weight the canary sees only a handful
of requests in 8 s, so whether it is rolled back yet is not certain; the table, the counts and the
outcome's form are."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from loadtest.bench_canary import main


def test_a_smoke_run_prints_the_table_and_publishes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    md = tmp_path / "benchmarks.md"
    md.write_text(
        "# Benchmarks\n\n<!-- bench:canary:begin -->\nold\n<!-- bench:canary:end -->\n\n## Attacks\n"
    )
    assert main(["--duration", "8", "--rate", "20", "--scenarios", "ttft", "--write-md", str(md)]) == 0
    out = capsys.readouterr().out
    assert "| scenario | outcome | seconds | canary requests | total requests | triggered | reason |" in out
    row = re.search(
        r"^\| canary 2x slower to first token \| ([^|]+) \| ([\d.]+) \| (\d+) \| (\d+) \|", out, re.M
    )
    assert row, out
    outcome, seconds, canary, total = row[1].strip(), float(row[2]), int(row[3]), int(row[4])
    assert outcome in ("progressing (at 5%)", "rolled back at 5%"), outcome
    assert 7.5 <= seconds <= 9.5 or (outcome.startswith("rolled back") and seconds < 8)
    assert 0 < total <= 20 * seconds + 1 and canary < total  # at 5%, never most of them
    text = md.read_text()
    assert (
        "\nold\n" not in text and row[0] in text and text.index("bench:canary:end") < text.index("## Attacks")
    )
