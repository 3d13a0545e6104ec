"""docs/configuration.md documents every key of gateway/config.py, so the page cannot drift again.

Each field of the pydantic models, as a dotted path from the top of the YAML, must appear in
backticks in the first cell of a table row: ``server.tls.cert``, ``pods[].mig.profile`` (list
items), ``tiers.<name>.timeouts.total_s`` (map keys, any ``<placeholder>``).
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel

from gateway.config import Config

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
MAP_KEY = "<*>"


def _models_in(annotation: object) -> tuple[str, type[BaseModel]] | None:
    """(how the path continues, the model) when a field holds a model, a map or a list of them."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        inner = [arg for arg in args if arg is not type(None)]
        return _models_in(inner[0]) if len(inner) == 1 else None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "", annotation
    if origin is dict and len(args) == 2:
        found = _models_in(args[1])
        return (f".{MAP_KEY}" + found[0], found[1]) if found else None
    if origin in (tuple, list) and args:
        found = _models_in(args[0])
        return ("[]" + found[0], found[1]) if found else None
    return None


def config_keys(model: type[BaseModel] = Config, prefix: str = "") -> Iterator[str]:
    """Every leaf key under ``model``, dotted, with ``[]`` for list items and ``<*>`` for map keys."""
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        inner = _models_in(field.annotation)
        if inner is None:
            yield path
        else:
            suffix, sub = inner
            yield from config_keys(sub, f"{path}{suffix}.")


def documented_keys(text: str) -> set[str]:
    """The backticked names in the first cell of each table row of the page."""
    keys: set[str] = set()
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| ---"):
            keys.update(re.findall(r"`([^`]+)`", line.split("|")[1]))
    return keys


def _pattern(key: str) -> re.Pattern[str]:
    return re.compile(re.escape(key).replace(re.escape(MAP_KEY), r"<[^>.]+>") + "$")


def test_the_walk_finds_nested_list_and_map_keys() -> None:
    keys = set(config_keys())
    for key in ("server.tls.cert", "pods[].mig.profile", "timeouts.models.<*>.total_s",
                "tiers.<*>.degrade.inter_token_p95_ms", "resume.models", "retries.max_attempts"):
        assert key in keys
    assert not any(key.endswith((".tls", ".mig", ".degrade")) for key in keys), "leaves only"


def test_every_config_key_is_in_docs_configuration_md() -> None:
    documented = documented_keys(DOC.read_text(encoding="utf-8"))
    missing = [
        key for key in config_keys() if not any(_pattern(key).match(doc) for doc in documented)
    ]
    assert not missing, (
        f"docs/configuration.md does not document {len(missing)} config key(s) of gateway/config.py; add "
        f"a table row whose first cell names each in backticks (map keys as <name>): {', '.join(missing)}"
    )
