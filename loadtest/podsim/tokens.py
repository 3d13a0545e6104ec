"""The simulated model's tokenizer and embedding model: deterministic, and the same in every process.

A token is a word. Words of the answer vocabulary (``words.VOCABULARY``) are ids ``0..63``, so a
generated answer tokenizes to the ids it was generated from; any other word gets an id from a
BLAKE2b hash (never Python's per-process ``hash()``), so every pod agrees. A chat's template adds
the same number of special tokens per message that ``estimate_chat_tokens`` counts: ``/tokenize``
reports exactly the prompt tokens a generation with the same prompt reports as usage.

An embedding is a unit vector of ``EMBEDDING_DIM`` floats drawn from a hash of (model, input): the
same input always embeds the same way on every pod, and different inputs differ.
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct

from loadtest.podsim.words import VOCABULARY

VOCAB_SIZE = 32_000
EMBEDDING_DIM = 384
# Special tokens, at the top of the vocabulary: begin of text, a message's start, the separator
# after its role, its end, and the prompt for the assistant's turn.
BOS, MSG_START, ROLE_SEP, MSG_END, GEN_PROMPT = range(VOCAB_SIZE - 5, VOCAB_SIZE)
_SPECIAL = {
    BOS: "<s>", MSG_START: "<|start|>", ROLE_SEP: "<|sep|>", MSG_END: "<|end|>", GEN_PROMPT: "<|gen|>"
}
_IDS = {word: i for i, word in enumerate(VOCABULARY)}
_HASHED = VOCAB_SIZE - 5 - len(VOCABULARY)  # ids for other words: len(VOCABULARY) .. BOS - 1


def word_id(word: str) -> int:
    """The id of one word."""
    known = _IDS.get(word)
    if known is not None:
        return known
    digest = hashlib.blake2b(word.encode(), digest_size=8).digest()
    return len(VOCABULARY) + int.from_bytes(digest, "big") % _HASHED


def encode_text(text: str) -> list[int]:
    """A completion prompt's tokens: one per word, or BOS alone for a text without words (the
    prompt of a generation counts at least one token)."""
    return [word_id(word) for word in text.split()] or [BOS]


def encode_chat(messages: list[tuple[str, str]]) -> list[int]:
    """A chat's tokens through the template: BOS, per message ``start role sep words... end``,
    then the generation prompt: ``2 + sum(4 + words)``, as ``estimate_chat_tokens`` counts."""
    out = [BOS]
    for role, text in messages:
        out += (MSG_START, word_id(role), ROLE_SEP, *(word_id(word) for word in text.split()), MSG_END)
    out.append(GEN_PROMPT)
    return out


def token_text(token: int) -> str:
    """What one token id reads as: its word, a special token's name, or a placeholder."""
    if token < len(VOCABULARY):
        return VOCABULARY[token]
    return _SPECIAL.get(token, f"<w{token}>")


def decode(tokens: list[int]) -> str:
    """The text of ``tokens``: its words joined by spaces, special tokens skipped (vLLM's default)."""
    return " ".join(token_text(t) for t in tokens if t not in _SPECIAL)


def embed(model: str, key: str) -> list[float]:
    """The unit vector for ``key`` (a text, or a token list's repr) under ``model``."""
    seed = hashlib.blake2b(f"{model}\x00{key}".encode(), digest_size=64).digest()
    values: list[float] = []
    counter = 0
    while len(values) < EMBEDDING_DIM:
        block = hashlib.blake2b(seed + counter.to_bytes(4, "big"), digest_size=64).digest()
        counter += 1
        values.extend(b / 127.5 - 1.0 for b in block)
    values = values[:EMBEDDING_DIM]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [round(v / norm, 6) for v in values]


def as_base64(vector: list[float]) -> str:
    """vLLM's ``encoding_format: base64``: the little-endian float32 bytes, base64-encoded."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
