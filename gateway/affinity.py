"""The affinity key of a request: what makes two requests worth sending to the same pod.

vLLM keeps the KV cache of recent prompts (automatic prefix caching); a conversation's next turn, or
another request with the same long system prompt, starts much faster on the pod that has it. The
key is read from the request the gateway has already parsed (no extra JSON work), and the registry
maps it to a pod by rendezvous hashing (``PodRegistry._by_affinity``).
"""

from __future__ import annotations

from typing import Any

from gateway.config import AffinityConfig


def affinity_key(config: AffinityConfig, payload: dict[str, Any], header: bytes | None) -> str | None:
    """The request's key under ``config``, or None when it has none (then load balancing decides).

    ``user``: the OpenAI ``user`` field. ``header:NAME``: that request header (``header`` is its
    value, read with the others by ``gateway.request_head``). ``prefix``: the first ``prefix_chars``
    characters of the prompt (chat: the messages' text in order, roles included).
    """
    kind = config.key
    if kind == "user":
        user = payload.get("user")
        return user if isinstance(user, str) and user else None
    if kind.startswith("header:"):
        return (header.decode("latin-1") or None) if header is not None else None
    return _prompt_prefix(payload, config.prefix_chars)


def _prompt_prefix(payload: dict[str, Any], limit: int) -> str | None:
    messages = payload.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        size = 0
        for message in messages:
            if size >= limit:
                break
            if not isinstance(message, dict):
                continue
            text = f"{message.get('role', '')}:{_text_of(message.get('content'))}\n"
            parts.append(text)
            size += len(text)
        prefix = "".join(parts)[:limit]
    else:
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and prompt:
            prompt = prompt[0]
        prefix = prompt[:limit] if isinstance(prompt, str) else str(prompt)[:limit] if prompt else ""
    return prefix or None


def _text_of(content: Any) -> str:
    """A message's text: a plain string, or the text parts of a multimodal content list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""
