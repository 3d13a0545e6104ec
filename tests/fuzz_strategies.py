"""Shared pieces of the property tests (tests/test_fuzz_*.py): Hypothesis profiles and strategies.

Importing this module registers two profiles and loads one: ``ci`` (the default, bounded and
derandomized so that the fuzz tests stay a few seconds of ``make test`` and never flake) or ``fuzz``
(``HYPOTHESIS_PROFILE=fuzz``, what ``make fuzz`` runs: many more, fresh examples per property).
Deadlines are off in both: the machine is shared, and a slow example is not a failure; hangs are
caught by pytest-timeout.
"""

from __future__ import annotations

import itertools
import os
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large]
# ci: the same examples on every run (a red `make test` is never a dice roll) and no example database;
# fuzz: fresh random examples each run, failures kept in .hypothesis/ and replayed first next time.
settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True, database=None, suppress_health_check=_QUIET
)
settings.register_profile("fuzz", max_examples=5000, deadline=None, suppress_health_check=_QUIET)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

WIRE = Path(__file__).resolve().parents[2] / "shared" / "wire"

T = TypeVar("T")


def wire_sample(name: str, fallback: bytes) -> bytes:
    """A real wire sample from ../shared/wire, or a small stand-in of the same format without it."""
    path = WIRE / name
    return path.read_bytes() if path.exists() else fallback


# -- JSON ------------------------------------------------------------------------------------------

json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)


def json_values(keys: st.SearchStrategy[str] | None = None) -> st.SearchStrategy[Any]:
    """Any JSON-shaped value (NaN and infinities included, as Python's json module reads them)."""
    key = keys if keys is not None else st.text(max_size=12)
    return st.recursive(
        json_scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(key, inner, max_size=5),
        max_leaves=20,
    )


def nested(depth: int, opener: bytes = b"[", closer: bytes = b"]") -> bytes:
    """JSON nested ``depth`` deep: Python's decoder gives up with RecursionError past ~1000."""
    return opener * depth + closer * depth


# -- byte streams ----------------------------------------------------------------------------------


@st.composite
def splits(draw: st.DrawFn, data: bytes, max_parts: int = 12) -> list[bytes]:
    """``data`` cut at arbitrary points (empty pieces included): a transport's read sizes."""
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=max_parts)))
    edges = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges)]


_INTERESTING = [
    b"NaN", b"+Inf", b"-Inf", b"1e309", b"-1", b"0", b"9" * 40, b"{", b"}", b"\"", b"\\", b"\n", b"\r\n",
    b" ", b",", b"=", b"le=\"", b"#", b"# TYPE x counter\n", b"\xff", b"\x00", b"_bucket", b"_total",
]


@st.composite
def mutated(draw: st.DrawFn, sample: bytes, max_ops: int = 6) -> bytes:
    """A real sample with a few random edits: the near-misses a buggy exporter or a proxy produces."""
    data = bytearray(sample)
    for _ in range(draw(st.integers(1, max_ops))):
        at = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(["delete", "insert", "token", "duplicate", "flip"]))
        if op == "delete":
            del data[at : at + draw(st.integers(1, 40))]
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "token":
            data[at : at + draw(st.integers(0, 4))] = draw(st.sampled_from(_INTERESTING))
        elif op == "duplicate":
            data[at:at] = data[at : at + draw(st.integers(1, 200))]
        elif data and at < len(data):
            data[at] ^= 1 << draw(st.integers(0, 7))
    return bytes(data)


# -- memory ----------------------------------------------------------------------------------------


def peak_bytes(fn: Callable[[], T]) -> tuple[T | BaseException, int]:
    """Run ``fn`` under tracemalloc: (its result or the exception it raised, peak bytes allocated)."""
    tracemalloc.start()
    try:
        try:
            result: T | BaseException = fn()
        except Exception as exc:
            result = exc
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, peak


def run_sync(coro: Any) -> Any:
    """Drive a coroutine that never really suspends (its awaitables are plain async functions)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise AssertionError("the coroutine suspended; these tests feed it without an event loop")


def chunks_of(data: bytes, size: int) -> Iterator[bytes]:
    for at in range(0, len(data), size):
        yield data[at : at + size]
