"""Degrade to non-streaming: ask the pod for the whole answer, give the client an SSE stream of it.

When a pod streams slowly, the per-token work of streaming (an output object and an SSE event per
token in vLLM's API server, a relay step per token here) is load it can shed: a tier configured for
it (``tiers.NAME.degrade``) gets its streaming requests served with ``stream: false`` upstream. The
client asked for a stream and its SDK expects one, so the answer is re-sent as a short OpenAI stream:
one chunk with each choice's whole content, one with its finish reason, the usage chunk if the
client asked for it, and ``[DONE]``. Pure functions over bytes.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.admit import encode_body

_DONE = b"data: [DONE]\n\n"


def non_streaming_body(payload: dict[str, Any]) -> tuple[bytes, bool]:
    """The request body for the pod, and whether the client asked for a usage chunk."""
    options = payload.get("stream_options")
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    body = {k: v for k, v in payload.items() if k not in ("stream", "stream_options")}
    body["stream"] = False
    return encode_body(body), include_usage


def as_sse(answer: bytes, include_usage: bool) -> bytes:
    """The pod's whole chat or text completion as the SSE stream a streaming client expects.

    ValueError when ``answer`` is not a completion object.
    """
    try:
        completion = json.loads(answer)
    except RecursionError:
        raise ValueError("the pod's answer is nested too deeply") from None
    if not isinstance(completion, dict) or not isinstance(completion.get("choices"), list):
        raise ValueError("the pod's answer is not a completion object")
    chat = completion.get("object") == "chat.completion"
    head = {
        "id": completion.get("id"),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": completion.get("created"),
        "model": completion.get("model"),
    }
    if completion.get("system_fingerprint") is not None:
        head["system_fingerprint"] = completion["system_fingerprint"]
    events = []
    choices = [c for c in completion["choices"] if isinstance(c, dict)]
    for choice in choices:
        index = choice.get("index", 0)
        if chat:
            message = choice.get("message")
            delta = _delta(message if isinstance(message, dict) else {})
            first = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        else:
            first = {"index": index, "text": choice.get("text", ""), "logprobs": None, "finish_reason": None}
        events.append({**head, "choices": [first]})
    for choice in choices:
        last: dict[str, Any] = {
            "index": choice.get("index", 0), "logprobs": None, "finish_reason": choice.get("finish_reason")
        }
        if chat:
            last["delta"] = {}
        else:
            last["text"] = ""
        events.append({**head, "choices": [last]})
    if include_usage and completion.get("usage") is not None:
        events.append({**head, "choices": [], "usage": completion["usage"]})
    out = [b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in events]
    out.append(_DONE)
    return b"".join(out)


def _delta(message: dict[str, Any]) -> dict[str, Any]:
    """A whole message as one delta: tool calls get the ``index`` that streamed ones carry."""
    delta: dict[str, Any] = {"role": message.get("role", "assistant")}
    for field in ("content", "reasoning_content", "refusal"):
        if message.get(field) is not None:
            delta[field] = message[field]
    calls = message.get("tool_calls")
    if isinstance(calls, list) and calls:
        delta["tool_calls"] = [
            {"index": i, **call} for i, call in enumerate(calls) if isinstance(call, dict)
        ]
    return delta
