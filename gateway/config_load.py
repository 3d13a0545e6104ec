"""Reading a config: YAML in, a validated ``Config`` out, and every problem worded for the operator.

The schema (``gateway/config.py``) says what a valid config is; this module turns a file, a mapping
or command-line flags into one, and pydantic's errors into one readable paragraph naming each bad
key (``ConfigError``), never a traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from gateway.config import Config, ConfigError

# What a list-typed key holds (and an example), for when it is given something else, e.g. one name.
_LIST_ITEMS: dict[str, tuple[str, str | None]] = {
    "models": ("model names", None),
    "api_keys": ("API keys", None),
    "dcgm_urls": ("dcgm-exporter /metrics URLs", None),
    "agent_urls": ("mig-agent base URLs", None),
    "pods": ("pods", "[{name: pod-a, url: 'http://10.0.0.5:8000'}]"),
}


def _message(err: Any) -> str:
    """pydantic's message, reworded where it names Python types instead of what YAML to write."""
    kind, value = err["type"], err.get("input")
    if kind in ("tuple_type", "list_type", "set_type", "frozen_set_type"):
        field = next((part for part in reversed(err["loc"]) if isinstance(part, str)), "")
        items, example = _LIST_ITEMS.get(field, ("values", None))
        if example is None:
            example = f"[{value}]" if isinstance(value, str) and value else "[first, second]"
        return f"must be a list of {items}, e.g. {example}"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return f"must be a mapping of keys to values (YAML 'key: value' lines), not {type(value).__name__}"
    return err["msg"].removeprefix("Value error, ")


def _describe(exc: ValidationError, source: str) -> str:
    problems = []
    for err in exc.errors():
        where = ".".join(str(part) for part in err["loc"]) or "(top level)"
        problems.append(f"'{where}': {_message(err)}")
    count = len(problems)
    return f"{source} has {count} problem{'s' if count > 1 else ''}: " + "; ".join(problems) + "."


def parse_config(data: Any, source: str = "config") -> Config:
    """Validate already-parsed data (a mapping) into a ``Config``."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source} must be a YAML mapping at the top level, not {type(data).__name__}.")
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, source)) from None


def load_config(path: str | Path) -> Config:
    """Read and validate a YAML config file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}.") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not UTF-8 text: byte {exc.start} cannot be decoded.") from None
    try:
        data = yaml.safe_load(text)
    except RecursionError:
        raise ConfigError(f"{path} nests lists or mappings too deeply.") from None
    except (ValueError, TypeError, AttributeError, LookupError) as exc:  # PyYAML's constructors (2001-02-30)
        raise ConfigError(f"{path} has a value YAML cannot read: {exc}.") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{path} is not valid YAML{where}: {problem}.") from None
    return parse_config(data, str(path))


def with_overrides(
    config: Config,
    *,
    host: str | None = None,
    port: int | None = None,
    upstreams: list[str] | None = None,
    no_auth: bool = False,
) -> Config:
    """Apply command-line flags on top of a file's config (flags win; ``--upstream`` adds pods;
    ``--no-auth`` turns auth off)."""
    raw = config.model_dump()
    raw["pods"] = list(raw["pods"])
    if host is not None:
        raw["server"]["host"] = host
    if port is not None:
        raw["server"]["port"] = port
    if no_auth:
        raw["auth"]["enabled"] = False
    if upstreams:
        names = {pod["name"] for pod in raw["pods"]}
        for index, url in enumerate(upstreams, start=1):
            name = f"upstream-{index}"
            while name in names:
                name += "x"
            names.add(name)
            raw["pods"].append({"name": name, "url": url})
    return parse_config(raw, "command-line flags")
