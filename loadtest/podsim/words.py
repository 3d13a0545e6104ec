"""Deterministic "model output": an endless, fixed word sequence per model and seed.

Every answer a simulated model gives is a slice ``S[k : k + max_tokens]`` of one sequence ``S``
chosen by the model name (and the request's optional ``seed``). Each token is ``" " + word``, plain
ASCII that never needs JSON escaping, so chunks can be assembled from pre-encoded bytes.

``k`` is chosen so that a client can resume an answer anywhere: when the text being continued
(the final assistant message, or a completion prompt) already ends with ``S[0:k]``, generation
picks up at ``S[k]``. An interrupted stream resumed on another pod therefore yields exactly the
rest of the uninterrupted answer.

The generator is a 64-bit LCG seeded from BLAKE2b of the model name and seed, never Python's
per-process randomised ``hash()``, so every pod process agrees on ``S``.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

# Short, lowercase, ASCII-only words: no JSON escaping, no spaces inside a token.
VOCABULARY: tuple[str, ...] = (
    "the", "a", "model", "token", "stream", "gateway", "slice", "memory", "cache", "block",
    "request", "answer", "pod", "queue", "batch", "engine", "latency", "first", "next", "every",
    "quickly", "slowly", "and", "or", "but", "with", "without", "under", "over", "into",
    "load", "fault", "retry", "resume", "route", "healthy", "warm", "cold", "fast", "steady",
    "gpu", "mig", "kernel", "tensor", "weight", "layer", "prompt", "reply", "word", "line",
    "keeps", "sends", "holds", "moves", "waits", "reads", "writes", "flows", "ends", "starts",
    "bright", "quiet", "simple", "honest",
)  # fmt: skip

TOKEN_BYTES: tuple[bytes, ...] = tuple((" " + word).encode("ascii") for word in VOCABULARY)
TOKEN_TEXT: tuple[str, ...] = tuple(" " + word for word in VOCABULARY)
MAX_TOKEN_BYTES = max(len(token) for token in TOKEN_BYTES)

_LCG_MUL = 6364136223846793005  # Knuth's MMIX constants
_LCG_ADD = 1442695040888963407
_MASK64 = (1 << 64) - 1
# Resuming is only searched this far back; longer texts just restart the answer (k = 0).
MAX_CONTINUATION_TOKENS = 200_000


def stable_seed(model: str, seed: int | None = None) -> int:
    """A process-independent 64-bit seed for ``model`` (and a request ``seed``)."""
    material = f"{model}\x00{'' if seed is None else seed}".encode()
    return int.from_bytes(hashlib.blake2b(material, digest_size=8).digest(), "big")


class WordSequence:
    """The endless sequence ``S`` for one (model, seed), materialised lazily and cached."""

    __slots__ = ("_state", "bytes", "ids", "text")

    def __init__(self, model: str, seed: int | None = None) -> None:
        self._state = stable_seed(model, seed)
        self.ids: list[int] = []
        self.bytes: list[bytes] = []  # TOKEN_BYTES entries, shared, so cheap to hold
        self.text: list[str] = []

    def ensure(self, n: int) -> None:
        """Make sure ``S[0:n]`` exists, so per-token lookups are plain list indexing."""
        missing = n - len(self.ids)
        if missing <= 0:
            return
        state, size = self._state, len(VOCABULARY)
        new_ids = []
        for _ in range(missing):
            state = (state * _LCG_MUL + _LCG_ADD) & _MASK64
            new_ids.append((state >> 33) % size)
        self._state = state
        self.ids.extend(new_ids)
        self.bytes.extend(TOKEN_BYTES[i] for i in new_ids)
        self.text.extend(TOKEN_TEXT[i] for i in new_ids)

    def slice_text(self, start: int, stop: int) -> str:
        """The concatenated text of ``S[start:stop]``."""
        self.ensure(stop)
        return "".join(self.text[start:stop])

    def continuation_point(self, text: str) -> int:
        """The largest ``k`` such that ``text`` ends with ``S[0:k]`` (0 if none)."""
        if not text:
            return 0
        self.ensure(1)
        first = self.text[0]
        # Lenient: a client that stripped the leading space still resumes the whole answer.
        if text.startswith(first[1:]) and self._is_prefix(" " + text):
            return text.count(" ") + 1
        pos = text.find(first)
        while pos != -1:
            if self._is_prefix(text[pos:]):
                return text.count(" ", pos)
            pos = text.find(first, pos + 1)
        return 0

    def _is_prefix(self, candidate: str) -> bool:
        """Whether ``candidate`` is exactly ``S[0:k]`` for k = its number of spaces."""
        k = candidate.count(" ")
        if k > MAX_CONTINUATION_TOKENS:
            return False
        self.ensure(k)
        text = self.text
        pos = 0
        for i in range(k):
            token = text[i]
            if not candidate.startswith(token, pos):
                return False
            pos += len(token)
        return pos == len(candidate)


class SequenceCache:
    """A small LRU of word sequences, so per-request seeds cannot grow memory without bound."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._items: OrderedDict[tuple[str, int | None], WordSequence] = OrderedDict()

    def get(self, model: str, seed: int | None = None) -> WordSequence:
        """The sequence for (model, seed), created on first use."""
        key = (model, seed)
        found = self._items.get(key)
        if found is not None:
            self._items.move_to_end(key)
            return found
        created = WordSequence(model, seed)
        self._items[key] = created
        if len(self._items) > self.capacity:
            self._items.popitem(last=False)
        return created
