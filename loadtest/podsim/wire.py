"""Bytes exactly as vLLM's OpenAI server writes them (see shared/wire/vllm-chat-stream.txt).

Streaming chunks are compact JSON (pydantic ``model_dump_json(exclude_unset=True)``), one SSE event
each: ``data: {...}\\n\\n``, ending with ``data: [DONE]\\n\\n``. Field order and the version-dependent
``null`` extras follow the shared samples and vLLM's protocol models. Non-streaming bodies and errors
are Starlette ``JSONResponse`` output: ``json.dumps(..., ensure_ascii=False, separators=(",", ":"))``.

For speed, :class:`StreamFormat` pre-encodes everything around a token once per request; a token
chunk is then ``prefix + token + suffix``.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

DONE = b"data: [DONE]\n\n"
MALFORMED = b'data: {"id":\n\n'
# Fault shapes of a stream cut short or gone wrong (see faults.py)
GARBAGE = b"<html><body><h1>502 Bad Gateway</h1></body></html>\n\n"
BAD_UTF8 = b"caf\xc3 \xff\xfe na\xefve"  # a lone lead byte, bytes UTF-8 never uses, a Latin-1 byte
HUGE_TOKEN_BYTES = 4 * 1024 * 1024  # built when the fault asks for it: 4 MB held by every importer otherwise
ENDLESS_HEAD = b'data: {"id":"'
ENDLESS_PIECE = b"A" * (64 * 1024)
KEEPALIVE = b": keep-alive\n\n"
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
JSON_CONTENT_TYPE = "application/json"


def dumps(obj: Any) -> str:
    """Compact JSON the way Starlette's JSONResponse renders it."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def jbytes(obj: Any) -> bytes:
    """:func:`dumps` as UTF-8 bytes."""
    return dumps(obj).encode()


# vLLM's create_error_response err_type names by status; anything else gets a name from the phrase.
_ERROR_TYPES = {
    400: "BadRequestError",
    401: "UnauthorizedError",
    403: "ForbiddenError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLargeError",
    429: "TooManyRequestsError",
    500: "InternalServerError",
    501: "NotImplementedError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_type(status: int) -> str:
    """The ``type`` string vLLM uses for an error with this HTTP status."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        return "Error"
    return "".join(word.capitalize() for word in phrase.replace("-", " ").split()) + "Error"


def error_body(status: int, message: str, param: str | None = None, err_type: str | None = None) -> bytes:
    """``{"error":{"message","type","param","code"}}`` as vLLM (0.10.1+) sends it."""
    return jbytes(
        {
            "error": {
                "message": message,
                "type": err_type or error_type(status),
                "param": param,
                "code": status,
            }
        }
    )


MIDSTREAM_ERROR = b"data: " + error_body(500, "Internal server error") + b"\n\n"


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}


class StreamFormat:
    """Pre-encoded pieces of one streamed response (chat or text completion)."""

    __slots__ = ("first", "head", "post", "pre", "tail_chat")

    def __init__(self, *, chat: bool, request_id: str, created: int, model: str) -> None:
        obj = b"chat.completion.chunk" if chat else b"text_completion"
        self.head = (
            b'data: {"id":' + jbytes(request_id) + b',"object":"' + obj + b'","created":'
            + str(created).encode() + b',"model":' + jbytes(model) + b',"choices":['
        )  # fmt: skip
        self.tail_chat = chat
        if chat:
            self.first = (
                self.head + b'{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
                b'"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}\n\n'
            )
            self.pre = self.head + b'{"index":0,"delta":{"content":"'
            self.post = b'"},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
        else:
            self.first = b""
            self.pre = self.head + b'{"index":0,"text":"'
            self.post = (
                b'","logprobs":null,"finish_reason":null,"stop_reason":null,'
                b'"prompt_token_ids":null,"token_ids":null}]}\n\n'
            )

    def token(self, text: bytes) -> bytes:
        """One content event (the hot path inlines this)."""
        return self.pre + text + self.post

    def final(self, text: bytes, finish_reason: str) -> bytes:
        """The last content event, carrying ``finish_reason`` and ``stop_reason``."""
        reason = finish_reason.encode()
        if self.tail_chat:
            post = (
                b'"},"logprobs":null,"finish_reason":"' + reason
                + b'","stop_reason":null,"token_ids":null}]}\n\n'
            )  # fmt: skip
        else:
            post = (
                b'","logprobs":null,"finish_reason":"' + reason
                + b'","stop_reason":null,"prompt_token_ids":null,"token_ids":null}]}\n\n'
            )  # fmt: skip
        return self.pre + text + post

    def usage(self, prompt: int, completion: int) -> bytes:
        """The ``"choices":[]`` usage event sent when ``stream_options.include_usage`` is set."""
        return self.head + b'],"usage":' + jbytes(_usage(prompt, completion)) + b"}\n\n"


def chat_response(
    request_id: str, created: int, model: str, text: str, finish_reason: str, prompt: int, completion: int
) -> bytes:
    """A non-streaming ``chat.completion`` body (vLLM's ChatCompletionResponse.model_dump())."""
    return jbytes(
        {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": text,
                        "refusal": None,
                        "annotations": None,
                        "audio": None,
                        "function_call": None,
                        "reasoning": None,
                    },
                    "logprobs": None,
                    "finish_reason": finish_reason,
                    "stop_reason": None,
                    "token_ids": None,
                }
            ],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": {**_usage(prompt, completion), "prompt_tokens_details": None},
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "kv_transfer_params": None,
        }
    )


def completion_response(
    request_id: str, created: int, model: str, text: str, finish_reason: str, prompt: int, completion: int
) -> bytes:
    """A non-streaming ``text_completion`` body (vLLM's CompletionResponse.model_dump())."""
    return jbytes(
        {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": finish_reason,
                    "stop_reason": None,
                    "token_ids": None,
                    "prompt_logprobs": None,
                    "prompt_token_ids": None,
                }
            ],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": {**_usage(prompt, completion), "prompt_tokens_details": None},
            "kv_transfer_params": None,
        }
    )


def model_list(models: list[str], created: int, max_model_len: int, permission_ids: dict[str, str]) -> bytes:
    """``GET /v1/models`` as vLLM's ModelList.model_dump()."""
    data = [
        {
            "id": model,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": model,
            "parent": None,
            "max_model_len": max_model_len,
            "permission": [
                {
                    "id": permission_ids[model],
                    "object": "model_permission",
                    "created": created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        for model in models
    ]
    return jbytes({"object": "list", "data": data})


# --- the rest of the OpenAI surface: embeddings, tokenization, the Responses API ---------------------


def embedding_response(
    request_id: str, created: int, model: str, embeddings: list[list[float] | str], prompt_tokens: int
) -> bytes:
    """``POST /v1/embeddings`` as vLLM's EmbeddingResponse.model_dump(): floats, or base64 strings."""
    return jbytes(
        {
            "id": request_id,
            "object": "list",
            "created": created,
            "model": model,
            "data": [
                {"index": i, "object": "embedding", "embedding": vector}
                for i, vector in enumerate(embeddings)
            ],
            "usage": {**_usage(prompt_tokens, 0), "prompt_tokens_details": None},
        }
    )


def tokenize_response(tokens: list[int], max_model_len: int, token_strs: list[str] | None) -> bytes:
    """``POST /tokenize`` as vLLM's TokenizeResponse.model_dump()."""
    return jbytes(
        {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens, "token_strs": token_strs}
    )


def detokenize_response(prompt: str) -> bytes:
    """``POST /detokenize`` as vLLM's DetokenizeResponse.model_dump()."""
    return jbytes({"prompt": prompt})


def response_usage(prompt: int, completion: int) -> dict[str, Any]:
    """A Responses API ``usage`` (vLLM's ResponseUsage)."""
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def response_object(
    request_id: str,
    created: int,
    model: str,
    echo: dict[str, Any],
    output: list[dict[str, Any]],
    status: str,
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    """vLLM's ResponsesResponse (``from_request``) as a dict, in its field order; ``echo`` holds what
    it repeats from the request (instructions, sampling parameters, tools, ...)."""
    return {
        "id": request_id,
        "created_at": created,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": echo.get("instructions"),
        "metadata": echo.get("metadata"),
        "model": model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": echo.get("parallel_tool_calls", True),
        "temperature": echo.get("temperature", 1.0),
        "tool_choice": echo.get("tool_choice", "auto"),
        "tools": echo.get("tools", []),
        "top_p": echo.get("top_p", 1.0),
        "background": echo.get("background", False),
        "max_output_tokens": echo["max_output_tokens"],
        "max_tool_calls": echo.get("max_tool_calls"),
        "previous_response_id": echo.get("previous_response_id"),
        "prompt": None,
        "reasoning": echo.get("reasoning"),
        "service_tier": echo.get("service_tier", "auto"),
        "status": status,
        "text": echo.get("text"),
        "top_logprobs": echo.get("top_logprobs"),
        "truncation": echo.get("truncation", "disabled"),
        "usage": usage,
        "user": echo.get("user"),
        "input_messages": None,
        "output_messages": None,
    }


def output_text(text: str) -> dict[str, Any]:
    """An ``output_text`` content part."""
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": None}


def output_message(item_id: str, text: str, status: str) -> dict[str, Any]:
    """An assistant ``message`` output item."""
    content = [output_text(text)] if status == "completed" else []
    return {"id": item_id, "content": content, "role": "assistant", "status": status, "type": "message"}


def response_body(response: dict[str, Any]) -> bytes:
    """A non-streaming ``POST /v1/responses`` answer."""
    return jbytes(response)


class ResponsesFormat:
    """One streamed Responses API answer, event by event, as vLLM writes it.

    Every event is ``event: TYPE\\ndata: {...}\\n\\n`` (pydantic ``model_dump_json``; the openai
    event models end with ``sequence_number`` and ``type``), numbered from 0, and no ``[DONE]``
    follows the final ``response.completed``. A text delta is pre-encoded around its token and
    its sequence number.
    """

    __slots__ = ("created", "echo", "first", "item_id", "mid", "model", "request_id", "seq")

    PRE = b'event: response.output_text.delta\ndata: {"content_index":0,"delta":"'

    def __init__(self, *, request_id: str, created: int, model: str, echo: dict[str, Any], item_id: str):
        self.request_id = request_id
        self.created = created
        self.model = model
        self.echo = echo
        self.item_id = item_id
        self.mid = b'","item_id":' + jbytes(item_id) + b',"logprobs":[],"output_index":0,"sequence_number":'
        self.seq = 0
        self.first = self.opening()  # sent with the first token, as a chat stream's role chunk

    def _event(self, kind: str, fields: dict[str, Any]) -> bytes:
        payload = {**fields, "sequence_number": self.seq, "type": kind}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + jbytes(payload) + b"\n\n"

    def opening(self) -> bytes:
        """``response.created``, ``response.in_progress``, then the message item and its text part."""
        response = response_object(
            self.request_id, self.created, self.model, self.echo, [], "in_progress", None
        )
        return b"".join((
            self._event("response.created", {"response": response}),
            self._event("response.in_progress", {"response": response}),
            self._event(
                "response.output_item.added",
                {"item": output_message(self.item_id, "", "in_progress"), "output_index": 0},
            ),
            self._event(
                "response.content_part.added",
                {"content_index": 0, "item_id": self.item_id, "output_index": 0, "part": output_text("")},
            ),
        ))  # fmt: skip

    def token(self, text: bytes) -> bytes:
        """One ``response.output_text.delta`` event."""
        seq = self.seq
        self.seq += 1
        return self.PRE + text + self.mid + b'%d,"type":"response.output_text.delta"}\n\n' % seq

    def closing(self, text: str, status: str, prompt: int, completion: int) -> bytes:
        """The text, part and item done events, then ``response.completed`` with the whole response."""
        item = output_message(self.item_id, text, "completed")
        response = response_object(
            self.request_id, self.created, self.model, self.echo, [item], status,
            response_usage(prompt, completion),
        )  # fmt: skip
        head = {"content_index": 0, "item_id": self.item_id}
        return b"".join((
            self._event(
                "response.output_text.done", {**head, "logprobs": [], "output_index": 0, "text": text}
            ),
            self._event("response.content_part.done", {**head, "output_index": 0, "part": output_text(text)}),
            self._event("response.output_item.done", {"item": item, "output_index": 0}),
            self._event("response.completed", {"response": response}),
        ))  # fmt: skip
