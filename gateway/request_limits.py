"""Limits on how much work one request may ask of the GPUs: messages, choices, and tokens per tier.

Why: the body size limit bounds bytes, not work. A 4 MiB body can hold tens of thousands of tiny
messages (each one templated, tokenized and attended to), and a request may ask for as many
completion tokens as the model's context allows, holding a sequence slot and KV cache for minutes.
A tier's ``max_tokens`` caps what its callers may ask for; a request that names no limit gets the cap
written into the body, so the pod never runs it to the context's end. Checked once per request,
after the tier is known; refusals are 400s in the OpenAI shape, with the offending ``param``.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.admit import InferenceRequest, encode_body
from gateway.config import Config
from gateway.errors import bad_request

# Per route, the fields that bound the tokens a request may generate; the first is the one the cap
# is written into. Embeddings and (de)tokenization generate nothing: no cap.
_TOKEN_FIELDS: dict[str, tuple[str, ...]] = {
    "chat": ("max_tokens", "max_completion_tokens"),
    "completions": ("max_tokens", "max_completion_tokens"),
    "responses": ("max_output_tokens",),
}


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_messages: int
    max_tokens: int | None
    max_choices: int


def limits_by_tier(config: Config) -> dict[str | None, RequestLimits]:
    """Each tier's limits (None: callers without a tier), its own settings over the server's."""
    server = config.server
    limits: dict[str | None, RequestLimits] = {
        None: RequestLimits(server.max_messages, server.max_tokens, server.max_choices)
    }
    for name, tier in config.tiers.items():
        limits[name] = RequestLimits(
            tier.max_messages if tier.max_messages is not None else server.max_messages,
            tier.max_tokens if tier.max_tokens is not None else server.max_tokens,
            tier.max_choices if tier.max_choices is not None else server.max_choices,
        )
    return limits


def enforce(req: InferenceRequest, limits: RequestLimits) -> InferenceRequest:
    """``req`` within ``limits``: a 400 when it asks for more, the cap filled in when it names none."""
    payload = req.payload
    messages = payload.get("messages")
    if isinstance(messages, list) and len(messages) > limits.max_messages:
        raise bad_request(
            f"'messages' has {len(messages)} entries; at most {limits.max_messages} are allowed.",
            "messages", "too_many_messages",
        )
    for field in ("n", "best_of"):  # each choice is a generation of its own: the token cap is per choice
        value = payload.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > limits.max_choices:
            raise bad_request(
                f"'{field}' is {value}; at most {limits.max_choices} choices are allowed.",
                field, "too_many_choices",
            )
    cap = limits.max_tokens
    fields = _TOKEN_FIELDS.get(req.route)
    if cap is None or fields is None:
        return req
    asked = False
    for field in fields:
        value = payload.get(field)
        if value is None:
            continue
        asked = True
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise bad_request(f"'{field}' must be a positive integer.", field, "invalid_type")
        if value > cap:
            raise bad_request(
                f"'{field}' is {value}; this caller may ask for at most {cap} tokens.",
                field, "max_tokens_too_large",
            )
    if asked:
        return req
    capped = {**payload, fields[0]: cap}
    return InferenceRequest(req.route, req.model, req.stream, encode_body(capped), capped)
