"""gRPC-Web messages ↔ OpenAI JSON, through the generated protobuf code.

A ChatCompletionRequest becomes the JSON body an HTTP client would have sent; a whole
``chat.completion`` or a ``chat.completion.chunk`` event becomes its protobuf message. The hot
path (one chunk per token) uses ``gateway/grpc_web_chunks.py`` instead, which the tests hold to
these functions' bytes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from transports.proto.sluicegate.v1 import inference_pb2 as pb

_OPTIONAL_FIELDS = (
    "max_tokens", "temperature", "top_p", "user", "seed", "n", "presence_penalty", "frequency_penalty",
    "max_completion_tokens", "top_k", "min_p", "ignore_eos",
)  # fmt: skip


def openai_body(request: pb.ChatCompletionRequest, stream: bool) -> bytes:
    """The OpenAI ``/v1/chat/completions`` JSON body for a ChatCompletionRequest."""
    messages = []
    for m in request.messages:
        item: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.HasField("name"):
            item["name"] = m.name
        messages.append(item)
    body: dict[str, Any] = {"model": request.model, "messages": messages}
    for name in _OPTIONAL_FIELDS:
        if request.HasField(name):
            body[name] = getattr(request, name)
    if request.stop:
        body["stop"] = list(request.stop)
    if stream:
        body["stream"] = True
        if request.stream_options.include_usage:
            body["stream_options"] = {"include_usage": True}
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def chunk_message(event: dict[str, Any]) -> pb.ChatCompletionChunk:
    """A ``chat.completion.chunk`` event as a ChatCompletionChunk."""
    return _completion(pb.ChatCompletionChunk, event, "delta", _fill_delta)


def completion_message(answer: dict[str, Any]) -> pb.ChatCompletion:
    """A ``chat.completion`` body as a ChatCompletion."""
    return _completion(pb.ChatCompletion, answer, "message", _fill_message)


def _completion(
    cls: Any, body: dict[str, Any], part: str, fill: Callable[[Any, dict[str, Any]], None]
) -> Any:
    """What a chunk and a whole completion share: the top-level fields, and each choice's index and
    finish reason; ``fill`` copies the choice's ``part`` (its delta or its message)."""
    msg = cls(id=body.get("id") or "", created=body.get("created") or 0, model=body.get("model") or "")
    for c in body.get("choices") or ():
        choice = msg.choices.add(index=c.get("index") or 0)
        value = c.get(part)
        if value:
            fill(getattr(choice, part), value)
        finish = c.get("finish_reason")
        if finish is not None:
            choice.finish_reason = finish
    usage = body.get("usage")
    if usage:
        _usage(msg.usage, usage)
    fingerprint = body.get("system_fingerprint")
    if fingerprint:
        msg.system_fingerprint = fingerprint
    return msg


def _fill_delta(out: pb.Delta, delta: dict[str, Any]) -> None:
    role = delta.get("role")
    if role is not None:
        out.role = role
    content = delta.get("content")
    if content is not None:
        out.content = content
    reasoning = delta.get("reasoning_content") or delta.get("reasoning")
    if reasoning is not None:
        out.reasoning_content = reasoning


def _fill_message(out: pb.ChatMessage, message: dict[str, Any]) -> None:
    out.role = message.get("role") or ""
    out.content = message.get("content") or ""
    if message.get("name"):
        out.name = message["name"]
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning is not None:
        out.reasoning_content = reasoning


def _usage(out: pb.Usage, usage: dict[str, Any]) -> None:
    out.prompt_tokens = usage.get("prompt_tokens") or 0
    out.completion_tokens = usage.get("completion_tokens") or 0
    out.total_tokens = usage.get("total_tokens") or 0


def as_chunk(answer: dict[str, Any]) -> dict[str, Any]:
    """A whole ``chat.completion`` as the single chunk of a stream."""
    choices = [
        {"index": c.get("index"), "delta": c.get("message"), "finish_reason": c.get("finish_reason")}
        for c in answer.get("choices") or ()
    ]
    return {**answer, "choices": choices}
