"""Writing benchmark results into a Markdown file between marker comments."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def replace_marked_section(path: Path, begin: str, end: str, section: str) -> None:
    """Replace the text between ``begin`` and ``end`` in ``path``, or append a marked section."""
    block = f"{begin}\n{section.rstrip()}\n{end}"
    text = path.read_text() if path.exists() else ""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = (text.rstrip() + "\n\n" if text.strip() else "") + block + "\n"
    path.write_text(text)


def command_line(module: str, argv: list[str] | None) -> str:
    """How a benchmark was run (``python -m MODULE ARGS``), for the first line of its report."""
    return f"python -m {module} {' '.join(sys.argv[1:] if argv is None else argv)}".strip()


def publish(section: str, write_md: str | None, name: str) -> None:
    """Print a benchmark's report and, with ``write_md``, put it in that file's ``bench:NAME`` section."""
    print(section)
    if write_md:
        replace_marked_section(Path(write_md), f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->",
                               section)


def read_saved(parser: argparse.ArgumentParser, path: str, schema: str) -> dict[str, Any]:
    """An earlier run's ``--json`` for ``--from-json``; a usage error when unreadable or not ``schema``."""
    try:
        saved = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        parser.error(f"--from-json: {exc}")
    if saved.get("schema") != schema:
        parser.error(f"--from-json: {path} is not a {schema} file")
    return saved
