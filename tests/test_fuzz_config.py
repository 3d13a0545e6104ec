"""Property tests of config validation: whatever an operator writes, they get a Config or one readable
``ConfigError`` paragraph, never a traceback; and a Config that validates can be used (a pod's URL can be
taken apart as the registry does).

The data is shaped like the real schema, walked from the pydantic models: the right keys at every level
with arbitrary YAML values (and unknown keys now and then), so the fuzzing reaches every validator."""

from __future__ import annotations

import tempfile
import types
import typing
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from pydantic import BaseModel

import tests.fuzz_strategies  # noqa: F401  (the Hypothesis profiles)
from gateway.config import Config, ConfigError
from gateway.config_load import load_config, parse_config

yaml_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**64), 2**64), st.floats(), st.text(max_size=16),
    st.sampled_from(["", "0", "-1", "1e9", "http://10.0.0.5:8000", "https://p:99999", "http://h:x",
                     "http://[::1", "GPU-1", "MIG-1", "1g.10gb", "auto", "always", "never"]),
)  # fmt: skip
yaml_values = st.recursive(
    yaml_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models inside a field's annotation (``X | None``, ``tuple[X, ...]``, ``dict[str, X]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is not None:
        return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]
    return []


def shaped(model: type[BaseModel], depth: int = 0) -> st.SearchStrategy[dict[str, Any]]:
    """Dicts with (some of) ``model``'s keys, each holding arbitrary YAML or the shape of its sub-model."""
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for name, info in model.model_fields.items():
        options = [yaml_values]
        if depth < 4:
            for sub in _models_in(info.annotation):
                inner = shaped(sub, depth + 1)
                options += [inner, st.lists(inner, max_size=3)]
                options.append(st.dictionaries(st.text(max_size=6), inner, max_size=2))
        fields[name] = st.one_of(*options)
    known = st.fixed_dictionaries({}, optional=fields)
    unknown = st.dictionaries(st.text(max_size=8), yaml_values, max_size=1)
    return st.one_of(known, st.builds(lambda a, b: {**b, **a}, known, unknown))


def _outcome(data: Any) -> Config | ConfigError:
    try:
        return parse_config(data, "fuzz.yaml")
    except ConfigError as exc:
        return exc


@given(shaped(Config))
@example({"pods": [{"name": "a", "url": "http://10.0.0.5:99999"}]})  # found by fuzzing: accepted, then the
@example({"pods": [{"name": "a", "url": "http://10.0.0.5:x"}]})  # registry's urlsplit().port raised
@example({"pods": [{"name": "a", "url": "http://[::1"}]})
@example({"server": {"port": float("nan")}, "timeouts": {"connect_s": float("inf")}})
def test_config_shaped_data_gives_a_config_or_one_config_error(data: dict[str, Any]) -> None:
    outcome = _outcome(data)
    if isinstance(outcome, ConfigError):
        text = str(outcome)
        assert text.startswith("fuzz.yaml has ") and "Traceback" not in text
        return
    for pod in outcome.pods:  # what the pod registry does with each pod at start-up
        parts = urlsplit(pod.url)
        assert parts.hostname and (parts.port is None or 0 <= parts.port <= 65535)


@given(yaml_values)
def test_any_yaml_value_at_the_top_gives_a_config_or_one_config_error(data: Any) -> None:
    _outcome(data)


def _deep(depth: int) -> list[Any]:
    top: list[Any] = []
    node = top
    for _ in range(depth):
        node.append([])
        node = node[0]
    return top


def _cyclic() -> list[Any]:
    loop: list[Any] = []
    loop.append(loop)  # what a YAML anchor that refers to itself (&p [*p]) loads as
    return loop


@pytest.mark.parametrize(
    "value", [_deep(3000), _cyclic(), {"t": _deep(3000)}, {"t": {"api_keys": _cyclic()}}]
)
@pytest.mark.parametrize("key", ["pods", "tiers", "server"])
def test_self_referencing_and_deep_data_gives_a_config_error(key: str, value: Any) -> None:
    """Plain cases, not Hypothesis examples: Hypothesis itself recurses too deep printing such values."""
    assert isinstance(_outcome({key: value}), ConfigError)


yaml_texts = st.one_of(
    st.text(max_size=200),
    st.lists(st.sampled_from(["server:", "pods:", " - ", "name: a", "url: ", "{", "[", "&a ", "*a",
                              "!!int ", "!!float ", "!!timestamp ", "2001-02-30", "\n", "  ", "port: ", "0x",
                              "9" * 5000]), max_size=12).map("".join),
)  # fmt: skip


@given(yaml_texts)
@example("[" * 5000)  # found by fuzzing: PyYAML's parser recursed past Python's limit (RecursionError)
@example("pods: &p [*p]")
@example("drain_until: 2001-02-30")  # found by fuzzing: PyYAML's date constructor raised ValueError
@example("a: !!int 0x")
@example("a: !!timestamp x")  # ... AttributeError for an explicit tag on a value it cannot match
@example("a: !!float")  # ... and IndexError for one on an empty value
@example("a: " + "9" * 5000)  # past Python's int-digits limit
@example("server: {port: 1}\n\x00")
def test_any_yaml_file_gives_a_config_or_one_config_error(text: str) -> None:
    _load(text.encode("utf-8", "surrogatepass"))


@given(st.binary(max_size=100))
@example(b"server: {host: \xe9}\n")  # found by fuzzing: a Latin-1 file raised UnicodeDecodeError
def test_any_file_bytes_give_a_config_or_one_config_error(raw: bytes) -> None:
    _load(raw)


def _load(raw: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.yaml"
        path.write_bytes(raw)
        try:
            load_config(path)
        except ConfigError as exc:
            assert str(exc).startswith(str(path))
