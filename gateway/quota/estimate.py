"""How many tokens a request reserves at admission, before any pod has tokenized it.

The gateway has no tokenizer (one per model, and tokenizing every prompt would cost more than the
rest of the request path), so the prompt is estimated from its length: text characters divided by
``quotas.chars_per_token`` (4 by default: OpenAI's rule of thumb for English), rounded up, plus 4
tokens per chat message for the chat template's role markers. Token-id prompts (lists of integers)
count one token per id, exactly. Images and audio parts are not estimated. The completion part is
the request's ``max_tokens`` (as asked, capped by the tier) times the choices it generates (``n``,
or ``best_of`` when larger). When the stream ends the reservation is settled against the pod's own
``usage``, so the estimate decides only whether a request is admitted, never what it is charged.
"""

from __future__ import annotations

import json
import math
from typing import Any

PER_MESSAGE = 4
# Routes that generate nothing: their whole cost is the input.
NO_COMPLETION = frozenset(
    {"embeddings", "tokenize", "detokenize", "/v1/embeddings", "/tokenize", "/detokenize"}
)


def _text_chars(value: Any) -> tuple[int, int]:
    """(characters of text, token ids) in a prompt, an input, or a message's content."""
    if isinstance(value, str):
        return len(value), 0
    if isinstance(value, int) and not isinstance(value, bool):
        return 0, 1
    chars = ids = 0
    if isinstance(value, list):
        for item in value:
            c, i = _text_chars(item)
            chars += c
            ids += i
    elif isinstance(value, dict):
        # a content part ({"type": "text", "text": ...}) or a Responses input item ({"content": ...})
        for field in ("text", "content", "input", "output", "tool_calls", "function", "arguments"):
            if field in value:
                c, i = _text_chars(value[field])
                chars += c
                ids += i
    return chars, ids


def reservation(payload: dict, route: str, max_tokens: int | None, chars_per_token: float) -> int:
    """Tokens to reserve: the prompt's estimate plus ``max_tokens`` for each generated choice."""
    return prompt_estimate(payload, chars_per_token) + completion_reserve(payload, route, max_tokens)


def prompt_estimate(payload: dict, chars_per_token: float) -> int:
    """The prompt's tokens, estimated: characters of the messages' contents (chat), ``prompt``
    (completions) or ``input`` (embeddings, responses), plus ``instructions`` and the tools' JSON
    when present, divided by ``chars_per_token`` and rounded up; +4 per chat message for the
    template; one per token id."""
    chars = ids = 0
    messages = payload.get("messages")
    template = 0
    if isinstance(messages, list):
        template = PER_MESSAGE * len(messages)
        c, ids = _text_chars(messages)
        chars += c
    for field in ("prompt", "input", "instructions"):
        if field in payload:
            c, i = _text_chars(payload[field])
            chars += c
            ids += i
    tools = payload.get("tools")
    if tools:
        chars += len(json.dumps(tools, separators=(",", ":")))
    return math.ceil(chars / chars_per_token) + ids + template


def completion_reserve(payload: dict, route: str, max_tokens: int | None) -> int:
    """``max_tokens`` for each choice the request may generate (``n``, ``best_of``); 0 for routes
    that generate nothing."""
    if route in NO_COMPLETION or not max_tokens:
        return 0
    choices = 1
    for field in ("n", "best_of"):
        value = payload.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > choices:
            choices = value
    return max_tokens * choices
