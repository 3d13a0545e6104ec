"""Writing benchmark results into a Markdown file between marker comments."""

from __future__ import annotations

from pathlib import Path


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
