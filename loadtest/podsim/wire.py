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
HUGE_TOKEN = b"x" * (4 * 1024 * 1024)
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
