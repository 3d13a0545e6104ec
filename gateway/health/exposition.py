"""Read chosen series out of a Prometheus text page, one regular expression a line (sans-IO).

The gateway scrapes every pod's ``/metrics`` once a second for the handful of vLLM series routing
reads. prometheus_client's parser walks label strings character by character in Python: 1.3-1.6 ms
of the event loop's CPU for podsim's 177-line page even when only its ~30 wanted lines are handed to
it, the largest part of an idle gateway's CPU (``docs/benchmarks.md``, "What changed"). Here each
wanted line is matched by one compiled pattern and its labels by two more (~0.3 ms a page); a line
they do not match whole is a ValueError, as prometheus_client's parser raises for it. Only sample
lines of legacy (unquoted) names are read, which is what vLLM and dcgm-exporter export (both pages
are read this way); ``# HELP``/``# TYPE`` lines and other series are skipped unread, so a malformed
line of a series nobody reads cannot fail a scrape.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator

_SAMPLE = re.compile(
    r"(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)"
    r"(?:\{(?P<labels>.*)\}[ \t]*|[ \t]+)"
    r"(?P<value>[^ \t]+)"
    r"(?:[ \t]+(?P<timestamp>[^ \t]+))?"  # checked, not used
    r"[ \t]*"
)
_PAIR = r'([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"'
_PAIRS = re.compile(_PAIR)
# Each run of blanks has exactly one place to go, so a hostile page cannot make matching backtrack.
_LABEL_SET = re.compile(
    rf"[ \t]*(?:,[ \t]*)?(?:{_PAIR}[ \t]*(?:,[ \t]*{_PAIR}[ \t]*)*(?:,[ \t]*)?)?"
)
_ESCAPE = re.compile(r'\\(.)')
_ESCAPED = {"\\": "\\", "n": "\n", '"': '"'}


def samples(text: str, names: Collection[str]) -> Iterator[tuple[str, dict[str, str], float]]:
    """(sample name, labels, value) of every sample line of ``text`` whose name is in ``names``;
    ValueError (with the line) for such a line that is not a valid sample."""
    prefixes = tuple(n + "{" for n in names) + tuple(n + " " for n in names)
    for line in text.split("\n"):  # the format's line end (splitlines would also cut at U+2028)
        if line.startswith(prefixes):
            yield sample(line)


def sample(line: str) -> tuple[str, dict[str, str], float]:
    """One sample line's name, labels and value (ValueError if it is not one)."""
    found = _SAMPLE.fullmatch(line)
    if found is None:
        raise ValueError(f"not a sample line: {line[:100]!r}")
    raw = found["labels"]
    labels = _labels(raw, line) if raw and not raw.isspace() else {}
    value, timestamp = found["value"], found["timestamp"]
    if "_" in value or (timestamp is not None and "_" in timestamp):  # float() reads "1_000"
        raise ValueError(f"not a sample value: {line[:100]!r}")
    if timestamp is not None:
        float(timestamp)
    return found["name"], labels, float(value)


def _labels(raw: str, line: str) -> dict[str, str]:
    """``a="1",b="2"`` as a dict: checked whole by one pattern, then read pair by pair by another."""
    if _LABEL_SET.fullmatch(raw) is None:
        raise ValueError(f"invalid labels: {line[:100]!r}")
    pairs = _PAIRS.findall(raw)
    labels = dict(pairs)
    if len(labels) != len(pairs):
        raise ValueError(f"duplicate label: {line[:100]!r}")
    if "\\" in raw:
        for name, value in pairs:
            if "\\" in value:
                labels[name] = _ESCAPE.sub(_unescape, value)
    return labels


def _unescape(found: re.Match[str]) -> str:
    return _ESCAPED.get(found[1], found[0])
