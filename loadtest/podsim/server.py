"""vLLM's OpenAI-compatible HTTP surface over the simulated engine (aiohttp, uvloop when available).

Streams are written straight to the connection's transport by engine callbacks: once the response
headers are out, a token costs one bytes formatting (HTTP chunk header + pre-encoded prefix + token +
suffix) and one ``transport.write`` -- no JSON encoding, no task switch. The handler only waits for the
sequence to end; with ``handler_cancellation`` aiohttp cancels it when the client disconnects, which
aborts the sequence in the engine at once, as vLLM does.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import socket
import ssl
import struct
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.side_server import serve_app
from loadtest.podsim import tokens, wire
from loadtest.podsim.auth import api_key_middleware
from loadtest.podsim.engine import Engine, EngineConfig, ModelStats, Sequence
from loadtest.podsim.faults import NO_FAULTS, Faults, faults_from_json, parse_faults
from loadtest.podsim.metrics import PodsimCollector, build_registry
from loadtest.podsim.words import MAX_TOKEN_BYTES, SequenceCache, WordSequence

log = logging.getLogger("podsim")

VLLM_VERSION = "0.33.0"
FAULT_HEADER = "x-podsim-fault"
READY_PREFIX = "podsim listening on "
_FAULT_ORDER = (
    "malformed_after", "huge_event_after", "error_after", "garbage_after", "bad_utf8_after", "end_after",
    "close_after", "drop_after", "endless_line_after", "keepalive_after", "stall_after",
)  # fmt: skip
_CARRY_ON = ("malformed_after", "huge_event_after")  # one odd event, then the answer goes on
_CLEAN_END = {"end_after": b"", "garbage_after": wire.GARBAGE, "bad_utf8_after": wire.BAD_UTF8}
_STREAM_ONLY = ("huge_event_after", "endless_line_after", "keepalive_after")
ENDLESS_PIECE = 64 * 1024  # bytes per write of an endless line
ENDLESS_BUFFER = 1024 * 1024  # ... written only while the peer's unread bytes stay under this
KEEPALIVE_S = 0.05  # one comment this often


@dataclass
class PodsimConfig:
    """Everything that shapes one simulated pod."""

    models: list[str] = field(default_factory=lambda: ["llama-8b"])
    engine: EngineConfig = field(default_factory=EngineConfig)
    max_model_len: int | None = None  # None: 8192, or less if the KV cache holds less
    default_max_tokens: int = 16
    answer_tokens: int = 0  # > 0: answers end with EOS ("stop") after this many tokens of S
    gpu_uuid: str = ""
    mig_uuid: str = ""
    mig_profile: str = ""
    faults: Faults = NO_FAULTS
    api_keys: tuple[str, ...] = ()  # vLLM's --api-key: /v1/* needs one of them (loadtest.podsim.auth)


class ApiError(Exception):
    """An error answered before streaming began, in vLLM's JSON shape."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def response(self) -> web.Response:
        """The JSON error response."""
        return web.Response(
            status=self.status,
            body=wire.error_body(self.status, self.message, self.param),
            content_type=wire.JSON_CONTENT_TYPE,
        )


@dataclass(slots=True)
class Job:
    """A validated generation request."""

    chat: bool
    model: str
    stream: bool
    include_usage: bool
    prompt_tokens: int
    start: int  # index into the model's word sequence where this answer begins
    max_tokens: int
    limit: int  # tokens the engine generates, EOS included
    final_reason: str
    words: WordSequence
    request_id: str
    created: int
    echo: dict[str, Any] | None = None  # a Responses API request: what its response object repeats


def _field_error(kind: str, loc: str, msg: str, value: Any) -> str:
    """A message shaped like FastAPI's RequestValidationError text, which vLLM passes through."""
    return str([{"type": kind, "loc": ("body", loc), "msg": msg, "input": value}])


def _opt_bool(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, _field_error("bool_type", key, "Input should be a valid boolean", value), key)
    return value


def _opt_int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, _field_error("int_type", key, "Input should be a valid integer", value), key)
    return value


def _content_text(content: Any, index: int) -> str:
    """The text of a message's content: a string, null, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif not (isinstance(part, dict) and isinstance(part.get("type"), str)):
                break
        else:
            return "".join(texts)
    raise ApiError(
        400,
        _field_error("string_type", f"messages.{index}.content", "Input should be a valid string", content),
        "messages",
    )


def estimate_chat_tokens(texts: list[str]) -> int:
    """Prompt tokens of a chat: words of every message plus a few per message for the template."""
    return 2 + sum(4 + len(text.split()) for text in texts)


def fault_schedule(faults: Faults) -> list[tuple[int, int, str]]:
    """(token number before which the fault fires, order, knob) for each knob set, firing order first."""
    return sorted(
        (getattr(faults, name) + 1, _FAULT_ORDER.index(name), name)
        for name in _FAULT_ORDER
        if getattr(faults, name) is not None
    )


class _StreamSink:
    """Writes one SSE response straight to its transport from engine callbacks."""

    __slots__ = (
        "client_gone",
        "done",
        "dropped",
        "engine",
        "fault_at",
        "fmt",
        "heads",
        "job",
        "no_finish",
        "offset",
        "pending",
        "post",
        "pre",
        "stalled",
        "started",
        "stats",
        "timer",
        "tokens",
        "transport",
    )

    def __init__(
        self,
        engine: Engine,
        job: Job,
        transport: asyncio.Transport,
        faults: Faults,
        stats: ModelStats,
        done: asyncio.Future[str],
    ) -> None:
        self.engine = engine
        self.job = job
        self.transport = transport
        self.stats = stats
        self.done = done
        self.fmt = wire.StreamFormat(
            chat=job.chat, request_id=job.request_id, created=job.created, model=job.model
        )
        self.pre = self.fmt.pre
        self.post = self.fmt.post
        base = len(self.pre) + len(self.post)
        # HTTP chunk-size lines by token length, so a token costs one join and one write
        self.heads = [b"%x\r\n" % (base + n) for n in range(MAX_TOKEN_BYTES + 1)]
        self.tokens = job.words.bytes
        self.offset = job.start - 1  # token g (1-based) is tokens[offset + g]
        # (token number before which the fault fires, knob), in firing order
        self.pending = fault_schedule(faults)
        self.fault_at = self.pending[0][0] if self.pending else -1
        self.started = False
        self.client_gone = False
        self.dropped = False
        self.stalled = False
        self.no_finish = bool(faults.no_finish)
        self.timer: asyncio.TimerHandle | None = None

    def emit(self, seq: Sequence) -> None:
        """Every token but the first and the last: the hot path."""
        transport = self.transport
        if transport.is_closing():
            self._gone(seq)
            return
        generated = seq.generated
        if generated == self.fault_at:
            self._slow(seq, final=False)
            return
        token = self.tokens[self.offset + generated]
        transport.write(b"".join((self.heads[len(token)], self.pre, token, self.post, b"\r\n")))

    def emit_first(self, seq: Sequence) -> None:
        """The first token (after the role event, for chat); later tokens take :meth:`emit`."""
        seq.emit = self.emit
        self._slow(seq, final=False)

    def finish(self, seq: Sequence) -> None:
        """The last token, with finish_reason, the usage event if asked for, and ``[DONE]``."""
        self._slow(seq, final=True)

    def _gone(self, seq: Sequence) -> None:
        self.client_gone = True
        self.engine.abort(seq)

    def _write(self, parts: list[bytes]) -> None:
        data = b"".join(parts)
        if data:
            self.transport.write(b"%x\r\n%b\r\n" % (len(data), data))

    def _slow(self, seq: Sequence, *, final: bool) -> None:
        if self.transport.is_closing():
            self._gone(seq)
            return
        fmt, job = self.fmt, self.job
        generated = seq.generated
        parts: list[bytes] = []
        if not self.started:
            self.started = True
            parts.append(fmt.first)
        while self.fault_at == generated:
            _, _, knob = self.pending.pop(0)
            self.fault_at = self.pending[0][0] if self.pending else -1
            self.stats.count_fault(knob)
            if knob in _CARRY_ON:
                huge = knob != "malformed_after"
                parts.append(fmt.token(b"x" * wire.HUGE_TOKEN_BYTES) if huge else wire.MALFORMED)
                continue
            if knob == "error_after":
                parts += (wire.MIDSTREAM_ERROR, wire.DONE)
                self._write(parts)
                self.engine.abort(seq)
                self._resolve("error")
                return
            if knob in _CLEAN_END:  # the body ends well at the HTTP level, short of the answer
                parts.append(_CLEAN_END[knob] if knob != "bad_utf8_after" else fmt.token(wire.BAD_UTF8))
                self._write(parts)
                self.engine.abort(seq)
                self._resolve("truncated")
                return
            self._write(parts)
            self.engine.abort(seq)
            if knob == "drop_after":
                self.dropped = True
                self.transport.abort()
            elif knob == "close_after":
                self.dropped = True
                self.transport.close()  # FIN once written, no terminating chunk
            else:  # stall, keep-alives, an endless line: the connection stays open until the client goes
                self.stalled = True
                if knob == "keepalive_after":
                    self._keepalive()
                elif knob == "endless_line_after":
                    self._write([wire.ENDLESS_HEAD])
                    self._endless()
            return
        if final:
            eos = seq.final_reason == "stop"
            token = b"" if eos else self.tokens[self.offset + generated]
            if self.no_finish:  # the last chunk says nothing of an end, and no [DONE] follows
                parts.append(fmt.token(token))
                if job.include_usage:
                    parts.append(fmt.usage(job.prompt_tokens, generated))
                self._write(parts)
                self.stats.count_fault("no_finish")
                self._resolve("truncated")
                return
            parts += self._ending(token, seq)
            self._write(parts)
            self._resolve("ok")
        else:
            parts.append(fmt.token(self.tokens[self.offset + generated]))
            self._write(parts)

    def _ending(self, token: bytes, seq: Sequence) -> list[bytes]:
        """The last token with its finish reason, the usage event if asked for, and ``[DONE]``."""
        parts = [self.fmt.final(token, seq.final_reason)]
        if self.job.include_usage:
            parts.append(self.fmt.usage(self.job.prompt_tokens, seq.generated))
        parts.append(wire.DONE)
        return parts

    def _keepalive(self) -> None:
        """A comment now and then, never a token, until the client goes."""
        if self.transport.is_closing():
            self.client_gone = True
            return
        self._write([wire.KEEPALIVE])
        self.timer = asyncio.get_running_loop().call_later(KEEPALIVE_S, self._keepalive)

    def _endless(self) -> None:
        """More of a line that never ends, as fast as the client takes it, until it goes."""
        transport = self.transport
        if transport.is_closing():
            self.client_gone = True
            return
        if transport.get_write_buffer_size() < ENDLESS_BUFFER:
            self._write([wire.ENDLESS_PIECE])
        self.timer = asyncio.get_running_loop().call_later(0.001, self._endless)

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()

    def _resolve(self, outcome: str) -> None:
        if not self.done.done():
            self.done.set_result(outcome)


class _ResponsesSink(_StreamSink):
    """A Responses API stream: typed events around the same engine tokens, ``response.completed``
    (and no ``[DONE]``) at the end. Faults fire as in a chat stream: ``end_after`` ends the body
    cleanly before ``response.completed``, ``no_finish`` leaves out the closing events."""

    __slots__ = ()

    def __init__(
        self,
        engine: Engine,
        job: Job,
        transport: asyncio.Transport,
        faults: Faults,
        stats: ModelStats,
        done: asyncio.Future[str],
    ) -> None:
        super().__init__(engine, job, transport, faults, stats, done)
        assert job.echo is not None
        fmt = wire.ResponsesFormat(
            request_id=job.request_id, created=job.created, model=job.model, echo=job.echo,
            item_id=f"msg_{uuid.uuid4().hex}",
        )  # fmt: skip
        self.fmt = fmt  # type: ignore[assignment]

    def emit(self, seq: Sequence) -> None:
        """Every token but the first and the last: one delta event."""
        transport = self.transport
        if transport.is_closing():
            self._gone(seq)
            return
        if seq.generated == self.fault_at:
            self._slow(seq, final=False)
            return
        self._write([self.fmt.token(self.tokens[self.offset + seq.generated])])

    def _ending(self, token: bytes, seq: Sequence) -> list[bytes]:
        job = self.job
        generated = seq.generated
        text = job.words.slice_text(job.start, job.start + generated - (seq.final_reason == "stop"))
        status = "incomplete" if seq.final_reason == "length" else "completed"
        parts = [self.fmt.token(token)] if token else []
        parts.append(self.fmt.closing(text, status, job.prompt_tokens, generated))  # type: ignore[attr-defined]
        return parts


def _final_response(job: Job, text: str, generated: int) -> dict[str, Any]:
    """The whole (non-streaming) Responses API answer of a finished job."""
    assert job.echo is not None
    status = "incomplete" if job.final_reason == "length" else "completed"
    item = wire.output_message(f"msg_{uuid.uuid4().hex}", text, "completed")
    usage = wire.response_usage(job.prompt_tokens, generated)
    return wire.response_object(job.request_id, job.created, job.model, job.echo, [item], status, usage)


# What a Responses API answer repeats from its request, when the request set it.
_ECHOED = (
    "instructions", "metadata", "parallel_tool_calls", "temperature", "tool_choice", "tools", "top_p",
    "background", "max_tool_calls", "previous_response_id", "reasoning", "service_tier", "text",
    "top_logprobs", "truncation", "user",
)  # fmt: skip


def _caller_id(request_id: str) -> str:
    """The caller's X-Request-Id in an answer's id (after ``chatcmpl-``, ``cmpl-`` or ``resp_``)."""
    for prefix in ("chatcmpl-", "cmpl-", "resp_"):
        if request_id.startswith(prefix):
            return request_id[len(prefix):]
    return request_id


class _PlainSink:
    """Collects a non-streaming answer; only faults need per-token attention."""

    __slots__ = (
        "client_gone",
        "done",
        "dropped",
        "engine",
        "fault_at",
        "malformed",
        "pending",
        "short",
        "stalled",
        "stats",
        "transport",
    )

    def __init__(
        self,
        engine: Engine,
        transport: asyncio.Transport,
        faults: Faults,
        stats: ModelStats,
        done: asyncio.Future[str],
    ) -> None:
        self.engine = engine
        self.transport = transport
        self.stats = stats
        self.done = done
        self.pending = fault_schedule(faults)
        self.fault_at = self.pending[0][0] if self.pending else -1
        self.malformed = False
        self.short: str | None = None  # a clean-end knob that fired: the body is cut or garbage
        self.client_gone = False
        self.dropped = False
        self.stalled = False

    def emit(self, seq: Sequence) -> None:
        """Per token: fire a fault when its position comes."""
        if seq.generated == self.fault_at:
            self._fire(seq)

    def finish(self, seq: Sequence) -> None:
        """The answer is complete (unless a fault fires on this last token)."""
        if seq.generated == self.fault_at and not self._fire(seq):
            return
        if not self.done.done():
            self.done.set_result("ok")

    def _fire(self, seq: Sequence) -> bool:
        """Fire the faults due now; False when the answer will never be sent."""
        while self.fault_at == seq.generated:
            _, _, knob = self.pending.pop(0)
            self.fault_at = self.pending[0][0] if self.pending else -1
            self.stats.count_fault(knob)
            if knob == "malformed_after":
                self.malformed = True
                continue
            if knob in _STREAM_ONLY:
                continue
            if knob in _CLEAN_END:
                self.short = knob
                continue
            self.engine.abort(seq)
            if knob == "error_after":
                if not self.done.done():
                    self.done.set_result("error")
            elif knob in ("drop_after", "close_after"):
                self.dropped = True
                if knob == "drop_after":
                    self.transport.abort()
                else:
                    self.transport.close()
            else:
                self.stalled = True
            return False
        return True


class Podsim:
    """One simulated vLLM pod: engine, models, faults and the aiohttp application."""

    def __init__(self, config: PodsimConfig, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if not config.models:
            raise ValueError("a pod serves at least one model")
        self.config = config
        self.models = list(dict.fromkeys(config.models))
        self.loop = loop or asyncio.get_running_loop()
        self.engine = Engine(config.engine, self.loop)
        cache_tokens = self.engine.max_tokens_in_cache()
        if config.max_model_len is None:
            self.max_model_len = min(8192, cache_tokens)
        elif config.max_model_len > cache_tokens:
            raise ValueError(
                f"the model's max seq len ({config.max_model_len}) is larger than the maximum number of "
                f"tokens that can be stored in KV cache ({cache_tokens}); raise --kv-blocks or lower "
                "--max-model-len"
            )
        else:
            self.max_model_len = config.max_model_len
        self.stats = {model: ModelStats(model) for model in self.models}
        self.abort_log: collections.deque[tuple[str, float, int]] = collections.deque(maxlen=100_000)
        # (X-Request-Id, time.monotonic()) of each generation request as its handler starts
        self.arrival_log: collections.deque[tuple[str, float]] = collections.deque(maxlen=100_000)
        self.sequences = SequenceCache()
        self.faults = config.faults
        self.in_flight = 0
        self.created = int(time.time())
        self._permission_ids = {model: f"modelperm-{uuid.uuid4().hex}" for model in self.models}
        self.registry = build_registry(
            PodsimCollector(self.engine, self.stats, self._info_labels, lambda: self.faults)
        )

    # --- identity ------------------------------------------------------------------------------

    def _info_labels(self) -> dict[str, str]:
        c = self.config
        return {"gpu_uuid": c.gpu_uuid, "mig_uuid": c.mig_uuid, "mig_profile": c.mig_profile}

    def identity(self) -> dict[str, Any]:
        """What ``GET /podsim/identity`` reports."""
        c = self.config
        return {
            "gpu_uuid": c.gpu_uuid or None,
            "mig_uuid": c.mig_uuid or None,
            "mig_profile": c.mig_profile or None,
            "models": self.models,
            "kv_blocks": self.engine.total_blocks,
            "block_size": c.engine.block_size,
            "max_num_seqs": c.engine.max_num_seqs,
            "max_model_len": self.max_model_len,
            "pid": os.getpid(),
            "vllm_version": VLLM_VERSION,
        }

    # --- the application -----------------------------------------------------------------------

    def app(self) -> web.Application:
        """The aiohttp application with vLLM's routes and the simulator's admin routes."""
        guard = [api_key_middleware(self.config.api_keys)] if self.config.api_keys else []
        app = web.Application(middlewares=[*guard, _fastapi_style_errors], client_max_size=64 * 1024 * 1024)
        r = app.router
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/responses", self.responses)
        r.add_post("/v1/embeddings", self.embeddings)
        r.add_post("/tokenize", self.tokenize)
        r.add_post("/detokenize", self.detokenize)
        r.add_get("/v1/models", self.list_models)
        for path in ("/health", "/ping"):
            r.add_get(path, self.health)
        r.add_post("/ping", self.health)
        r.add_get("/load", self.load)
        r.add_get("/version", self.version)
        r.add_get("/metrics", self.metrics)
        r.add_get("/podsim/identity", self.identity_handler)
        r.add_get("/podsim/aborts", self.aborts_handler)
        r.add_get("/podsim/arrivals", self.arrivals_handler)
        r.add_get("/admin/faults", self.get_faults)
        r.add_post("/admin/faults", self.set_faults)
        r.add_delete("/admin/faults", self.clear_faults)
        return app

    def _json(self, obj: Any, status: int = 200) -> web.Response:
        return web.Response(status=status, body=wire.jbytes(obj), content_type=wire.JSON_CONTENT_TYPE)

    def _request_faults(self, request: web.Request) -> Faults:
        header = request.headers.get(FAULT_HEADER)
        if not header:
            return self.faults
        return self.faults.merged(parse_faults(header))

    async def health(self, request: web.Request) -> web.Response:
        """200 with an empty body, or 503 under the ``unhealthy`` fault; late under ``health_delay_ms``."""
        try:
            faults = self._request_faults(request)
        except ValueError as exc:
            return ApiError(400, f"bad {FAULT_HEADER} header: {exc}").response()
        if faults.health_delay_ms:
            await asyncio.sleep(faults.health_delay_ms / 1000)
        return web.Response(status=503 if faults.unhealthy else 200)

    async def load(self, _request: web.Request) -> web.Response:
        """vLLM's server-load tracking: generation requests in flight."""
        return self._json({"server_load": self.in_flight})

    async def version(self, _request: web.Request) -> web.Response:
        """vLLM's ``/version``: clients and gateways log or gate on it."""
        return self._json({"version": VLLM_VERSION})

    async def metrics(self, _request: web.Request) -> web.Response:
        """Prometheus text from the simulator's own registry (never subject to faults)."""
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def list_models(self, _request: web.Request) -> web.Response:
        """``GET /v1/models``: how gateways discover what a pod serves."""
        body = wire.model_list(self.models, self.created, self.max_model_len, self._permission_ids)
        return web.Response(body=body, content_type=wire.JSON_CONTENT_TYPE)

    async def aborts_handler(self, _request: web.Request) -> web.Response:
        """``GET /podsim/aborts``: request ids of aborted generations and when (time.monotonic())."""
        return self._json(
            {"aborts": [{"id": rid, "at": at, "peer_port": port} for rid, at, port in self.abort_log]}
        )

    async def arrivals_handler(self, request: web.Request) -> web.Response:
        """``GET /podsim/arrivals[?since=T]``: each generation request's ``X-Request-Id`` and arrival time.

        The time is ``time.monotonic()`` (CLOCK_MONOTONIC, one clock for the whole machine) when the
        handler started, so a benchmark can tell when a gateway last routed a request here.
        """
        try:
            since = float(request.query.get("since", "-inf"))
        except ValueError:
            return ApiError(400, "since must be a number (time.monotonic() seconds)").response()
        arrivals = [{"id": rid, "at": at} for rid, at in self.arrival_log if at >= since]
        return self._json({"arrivals": arrivals})

    async def identity_handler(self, _request: web.Request) -> web.Response:
        """``GET /podsim/identity``: the MIG slice this pod pretends to run on."""
        return self._json(self.identity())

    async def get_faults(self, _request: web.Request) -> web.Response:
        """The process-wide faults now in force."""
        return self._json(self.faults.to_dict())

    async def set_faults(self, request: web.Request) -> web.Response:
        """Replace the process-wide faults with the JSON body's knobs."""
        try:
            self.faults = faults_from_json(json.loads(await request.read() or b"{}"))
        except ValueError as exc:  # JSONDecodeError is a ValueError
            return ApiError(400, f"bad faults: {exc}").response()
        log.info("process faults now %r", self.faults.to_spec())
        return self._json(self.faults.to_dict())

    async def clear_faults(self, _request: web.Request) -> web.Response:
        """Back to a well-behaved pod."""
        self.faults = NO_FAULTS
        return self._json({})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/chat/completions``, streaming or not."""
        return await self._generate(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/completions``, streaming or not."""
        return await self._generate(request, chat=False)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/responses`` (the Responses API), streaming or not, from the same engine tokens."""
        return await self._generate(request, chat=False, responses=True)

    # --- pooling and tokenization: answered at once, no engine time ---------------------------------

    async def _pooling_body(self, request: web.Request) -> tuple[dict[str, Any], str] | web.Response:
        """The JSON body and its model, or the answer to give instead (a fault, or vLLM's 400/404)."""
        try:
            faults = self._request_faults(request)
        except ValueError as exc:
            return ApiError(400, f"bad {FAULT_HEADER} header: {exc}").response()
        raw = await request.read()
        if faults.refuse:
            self.stats[self.models[0]].count_fault("refuse")
            return await _refuse(request)
        if faults.status:
            self.stats[self.models[0]].count_fault("status")
            return _status_fault(faults.status)
        try:
            try:
                body = json.loads(raw)
            except ValueError as exc:
                raise _json_error(raw, exc) from None
            if not isinstance(body, dict):
                raise ApiError(
                    400,
                    str([{"type": "model_attributes_type", "loc": ("body",),
                          "msg": "Input should be a valid dictionary or object to extract fields from",
                          "input": body}]),
                )  # fmt: skip
            model = body.get("model")
            if model is None:
                model = self.models[0]
            if not isinstance(model, str):
                raise ApiError(
                    400, _field_error("string_type", "model", "Input should be a valid string", model)
                )
            if model not in self.stats:
                raise ApiError(404, f"The model `{model}` does not exist.", "model")
        except ApiError as err:
            return err.response()
        return body, model

    async def embeddings(self, request: web.Request) -> web.Response:
        """``POST /v1/embeddings``: a deterministic unit vector per input (see ``tokens.embed``)."""
        got = await self._pooling_body(request)
        if isinstance(got, web.Response):
            return got
        body, model = got
        given = body.get("input")
        if isinstance(given, str) or (
            isinstance(given, list) and given and all(type(t) is int for t in given)
        ):
            given = [given]  # one text, or one token list
        if not isinstance(given, list) or not given or not all(
            isinstance(item, str) or (isinstance(item, list) and all(type(t) is int for t in item))
            for item in given
        ):
            return ApiError(
                400, _field_error("union_type", "input", "Input should be a string or a list", given), "input"
            ).response()
        encoding = body.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            return ApiError(
                400, _field_error("literal_error", "encoding_format", "Input should be 'float' or 'base64'",
                                  encoding), "encoding_format",
            ).response()  # fmt: skip
        dimensions = body.get("dimensions")
        if dimensions is not None and dimensions != tokens.EMBEDDING_DIM:
            return ApiError(
                400, f"Model \"{model}\" does not support matryoshka representation, changing output "
                "dimensions will lead to poor results.", "dimensions",
            ).response()  # fmt: skip
        vectors: list[list[float] | str] = []
        prompt_tokens = 0
        for item in given:
            if isinstance(item, str):
                vector = tokens.embed(model, item)
                prompt_tokens += len(tokens.encode_text(item))
            else:
                vector = tokens.embed(model, repr(item))
                prompt_tokens += len(item)
            vectors.append(tokens.as_base64(vector) if encoding == "base64" else vector)
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        body_bytes = wire.embedding_response(f"embd-{rid}", int(time.time()), model, vectors, prompt_tokens)
        return web.Response(body=body_bytes, content_type=wire.JSON_CONTENT_TYPE)

    async def tokenize(self, request: web.Request) -> web.Response:
        """``POST /tokenize`` (vLLM's TokenizeCompletionRequest or TokenizeChatRequest): the ids of the
        prompt (or of the chat through the template); ``count`` is what a generation with the same
        prompt reports as its prompt tokens."""
        got = await self._pooling_body(request)
        if isinstance(got, web.Response):
            return got
        body, _model = got
        try:
            if "messages" in body:
                self._chat_prompt(body, self.sequences.get(self.models[0]))  # vLLM's checks and errors
                ids = tokens.encode_chat(
                    [(m["role"], _content_text(m.get("content"), i)) for i, m in enumerate(body["messages"])]
                )
            else:
                prompt = body.get("prompt")
                if not isinstance(prompt, str):
                    raise ApiError(
                        400, _field_error("string_type", "prompt", "Input should be a valid string", prompt),
                        "prompt",
                    )  # fmt: skip
                ids = tokens.encode_text(prompt)
            strs = _opt_bool(body, "return_token_strs", False)
        except ApiError as err:
            return err.response()
        token_strs = [tokens.token_text(t) for t in ids] if strs else None
        answer = wire.tokenize_response(ids, self.max_model_len, token_strs)
        return web.Response(body=answer, content_type=wire.JSON_CONTENT_TYPE)

    async def detokenize(self, request: web.Request) -> web.Response:
        """``POST /detokenize``: the text of a list of token ids."""
        got = await self._pooling_body(request)
        if isinstance(got, web.Response):
            return got
        body, _model = got
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(type(t) is int for t in ids):
            message = _field_error("list_type", "tokens", "Input should be a valid list of integers", ids)
            return ApiError(400, message, "tokens").response()
        for token in ids:
            if not 0 <= token < tokens.VOCAB_SIZE:
                return ApiError(400, f"Token id {token} is out of vocabulary", "tokens").response()
        answer = wire.detokenize_response(tokens.decode(ids))
        return web.Response(body=answer, content_type=wire.JSON_CONTENT_TYPE)

    # --- generation ----------------------------------------------------------------------------

    async def _generate(
        self, request: web.Request, *, chat: bool, responses: bool = False
    ) -> web.StreamResponse:
        self.arrival_log.append((request.headers.get("X-Request-Id", ""), time.monotonic()))
        self.in_flight += 1
        try:
            try:
                faults = self._request_faults(request)
            except ValueError as exc:
                return ApiError(400, f"bad {FAULT_HEADER} header: {exc}").response()
            raw = await request.read()
            try:
                body: Any = json.loads(raw)
                decode_error = None
            except ValueError as exc:
                body, decode_error = None, exc
            named = body.get("model") if isinstance(body, dict) else None
            stats = self.stats.get(named if isinstance(named, str) else "") or self.stats[self.models[0]]
            if faults.refuse:
                stats.count_fault("refuse")
                return await _refuse(request)
            if faults.status:
                stats.count_fault("status")
                return _status_fault(faults.status)
            try:
                if decode_error is not None:
                    raise _json_error(raw, decode_error)
                job = self._responses_job(request, body) if responses else self._job(request, body, chat=chat)
            except ApiError as err:
                return err.response()
            stats = self.stats[job.model]
            if job.stream:
                return await self._stream(request, job, faults, stats)
            return await self._respond(request, job, faults, stats)
        finally:
            self.in_flight -= 1

    def _job(self, request: web.Request, body: Any, *, chat: bool) -> Job:
        """Validate a request body the way vLLM does; raises ApiError."""
        if not isinstance(body, dict):
            raise ApiError(
                400,
                str([{"type": "model_attributes_type", "loc": ("body",),
                      "msg": "Input should be a valid dictionary or object to extract fields from",
                      "input": body}]),
            )  # fmt: skip
        model = body.get("model")
        if model is None:
            model = self.models[0]  # vLLM serves its (first) model when none is named
        if not isinstance(model, str):
            raise ApiError(400, _field_error("string_type", "model", "Input should be a valid string", model))
        if model not in self.stats:
            raise ApiError(404, f"The model `{model}` does not exist.", "model")
        stream = _opt_bool(body, "stream", False)
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise ApiError(
                400, _field_error("model_type", "stream_options", "Input should be an object", options)
            )
        if options and not stream:
            raise ApiError(400, "Stream options can only be defined when `stream=True`.", "stream_options")
        include_usage = bool(options and options.get("include_usage"))
        n = _opt_int(body, "n")
        if n not in (None, 1):
            raise ApiError(400, "podsim generates one choice per request; n must be 1.", "n")
        seed = _opt_int(body, "seed")
        words = self.sequences.get(model, seed)
        if chat:
            prompt_tokens, start = self._chat_prompt(body, words)
            max_tokens = _opt_int(body, "max_completion_tokens") or _opt_int(body, "max_tokens")
        else:
            prompt_tokens, start = self._completion_prompt(body, words)
            max_tokens = _opt_int(body, "max_tokens")
        if max_tokens is None:
            max_tokens = self.config.default_max_tokens
        if max_tokens < 1:
            raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
        if prompt_tokens + max_tokens > self.max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
                "completion). Please reduce the length of the messages or completion.",
                "max_tokens",
            )
        answer = 0 if _opt_bool(body, "ignore_eos", False) else self.config.answer_tokens
        remaining = max(answer - start, 0)
        if answer > 0 and remaining + 1 <= max_tokens:
            limit, reason = remaining + 1, "stop"  # the rest of the answer, then EOS
        else:
            limit, reason = max_tokens, "length"
        words.ensure(start + limit)
        request_id = request.headers.get("X-Request-Id") or body.get("request_id")
        if not isinstance(request_id, str) or not request_id:
            request_id = uuid.uuid4().hex
        return Job(
            chat=chat,
            model=model,
            stream=stream,
            include_usage=include_usage,
            prompt_tokens=prompt_tokens,
            start=start,
            max_tokens=max_tokens,
            limit=limit,
            final_reason=reason,
            words=words,
            request_id=("chatcmpl-" if chat else "cmpl-") + request_id,
            created=int(time.time()),
        )

    def _chat_prompt(self, body: dict[str, Any], words: WordSequence) -> tuple[int, int]:
        messages = body.get("messages")
        if messages is None:
            raise ApiError(400, _field_error("missing", "messages", "Field required", body), "messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(
                400,
                _field_error("list_type", "messages", "Input should be a non-empty list", messages),
                "messages",
            )
        texts = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ApiError(
                    400,
                    _field_error("missing", f"messages.{i}.role", "Field required", message),
                    "messages",
                )
            texts.append(_content_text(message.get("content"), i))
        continue_final = _opt_bool(body, "continue_final_message", False)
        generation_prompt = _opt_bool(body, "add_generation_prompt", True)
        if continue_final and body.get("add_generation_prompt"):
            raise ApiError(
                400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        if continue_final and generation_prompt:  # left at vLLM's default of true: the chat template refuses
            raise ApiError(
                400,
                "continue_final_message and add_generation_prompt are not compatible. Use "
                "continue_final_message when you want the model to continue the final message, and "
                "add_generation_prompt when you want to add a header that will prompt it to start a new "
                "assistant message instead.",
            )
        start = words.continuation_point(texts[-1]) if continue_final else 0
        return estimate_chat_tokens(texts), start

    def _completion_prompt(self, body: dict[str, Any], words: WordSequence) -> tuple[int, int]:
        prompt = body.get("prompt")
        if prompt is None or prompt == "" or prompt == []:
            raise ApiError(400, "Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
        if _opt_bool(body, "echo", False):
            raise ApiError(400, "podsim does not simulate echo=true.", "echo")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return max(1, len(prompt.split())), words.continuation_point(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return len(prompt), 0
        raise ApiError(
            400,
            "podsim serves one prompt per request: a string, a list of token ids, or a list of one of these.",
            "prompt",
        )

    def _responses_job(self, request: web.Request, body: Any) -> Job:
        """A Responses API request as a job: ``instructions`` and ``input`` are the prompt,
        ``max_output_tokens`` the limit; everything the response object repeats goes in ``echo``."""
        if not isinstance(body, dict):
            raise ApiError(
                400,
                str([{"type": "model_attributes_type", "loc": ("body",),
                      "msg": "Input should be a valid dictionary or object to extract fields from",
                      "input": body}]),
            )  # fmt: skip
        given = body.get("input")
        if given is None:
            raise ApiError(400, _field_error("missing", "input", "Field required", body), "input")
        texts = []
        instructions = body.get("instructions")
        if isinstance(instructions, str):
            texts.append(instructions)
        if isinstance(given, str):
            texts.append(given)
        elif isinstance(given, list):
            for i, item in enumerate(given):
                if not isinstance(item, dict):
                    message = _field_error("model_type", f"input.{i}", "Input should be an object", item)
                    raise ApiError(400, message, "input")
                content = item.get("content", item.get("output"))
                texts.append(_content_text(content, i))
        else:
            message = _field_error("union_type", "input", "Input should be a string or a list", given)
            raise ApiError(400, message, "input")
        # the generation's own checks (model, stream, the token limit) as for a one-message chat
        generation = {**body, "messages": [{"role": "user", "content": ""}], "stream_options": None}
        generation["max_tokens"] = _opt_int(body, "max_output_tokens")
        job = self._job(request, generation, chat=True)
        prompt_tokens = estimate_chat_tokens(texts)
        if prompt_tokens + job.max_tokens > self.max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_tokens + job.max_tokens} tokens ({prompt_tokens} in the input, {job.max_tokens} in "
                "the output). Please reduce the length of the input or output.",
                "max_output_tokens",
            )
        echo = {key: body[key] for key in _ECHOED if body.get(key) is not None}
        echo["max_output_tokens"] = job.max_tokens
        rid = request.headers.get("X-Request-Id") or body.get("request_id")
        if not isinstance(rid, str) or not rid:
            rid = uuid.uuid4().hex
        job.chat = False
        job.prompt_tokens = prompt_tokens
        job.request_id = f"resp_{rid}"
        job.echo = echo
        return job

    def _abandoned(
        self, seq: Sequence, sink: _StreamSink | _PlainSink, request_id: str, peer: tuple[str, int] | None
    ) -> None:
        """The handler was cancelled (the client went away, or a drop fault): abort and count."""
        active = self.engine.abort(seq)
        if (active or sink.client_gone or sink.stalled) and not sink.dropped:
            seq.stats.aborts += 1
            # CLOCK_MONOTONIC is machine-wide: benchmarks compare it with when their client left.
            # Logged by the caller's X-Request-Id, without the chatcmpl-/cmpl- prefix, with the
            # caller's port (a benchmark can find that connection's FIN in a packet capture).
            port = peer[1] if peer else 0
            self.abort_log.append((_caller_id(request_id), time.monotonic(), port))

    async def _stream(
        self, request: web.Request, job: Job, faults: Faults, stats: ModelStats
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": wire.SSE_CONTENT_TYPE})
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(b"")  # headers go out now, before the first token, as with uvicorn
        transport = request.transport
        if transport is None or transport.is_closing():
            return response  # the client is already gone; nothing to generate for
        peer = transport.get_extra_info("peername")
        done: asyncio.Future[str] = self.loop.create_future()
        sink_type = _StreamSink if job.echo is None else _ResponsesSink
        sink = sink_type(self.engine, job, transport, faults, stats, done)
        seq = Sequence(
            stats,
            job.prompt_tokens,
            job.limit,
            final_reason=job.final_reason,
            extra_delay_s=(faults.first_token_delay_ms or 0.0) / 1000.0,
            emit=sink.emit_first,
            finish=sink.finish,
        )
        if faults.first_token_delay_ms:
            stats.count_fault("first_token_delay_ms")
        self.engine.submit(seq)
        try:
            await done
        except asyncio.CancelledError:
            self._abandoned(seq, sink, job.request_id, peer)
            raise
        finally:
            sink.cancel()
        return response

    async def _respond(
        self, request: web.Request, job: Job, faults: Faults, stats: ModelStats
    ) -> web.Response:
        transport = request.transport
        if transport is None or transport.is_closing():
            return web.Response(status=499)  # client closed the request: never delivered
        peer = transport.get_extra_info("peername")
        done: asyncio.Future[str] = self.loop.create_future()
        sink = _PlainSink(self.engine, transport, faults, stats, done)
        seq = Sequence(
            stats,
            job.prompt_tokens,
            job.limit,
            final_reason=job.final_reason,
            extra_delay_s=(faults.first_token_delay_ms or 0.0) / 1000.0,
            finish=sink.finish,
        )
        if faults.any_stream_fault():
            seq.emit = sink.emit
        if faults.first_token_delay_ms:
            stats.count_fault("first_token_delay_ms")
        self.engine.submit(seq)
        try:
            outcome = await done
        except asyncio.CancelledError:
            self._abandoned(seq, sink, job.request_id, peer)
            raise
        if outcome == "error":
            return ApiError(500, "Internal server error").response()
        if sink.malformed:
            return web.Response(body=b'{"id":', content_type=wire.JSON_CONTENT_TYPE)
        generated = seq.generated
        text_tokens = generated - 1 if job.final_reason == "stop" else generated
        text = job.words.slice_text(job.start, job.start + text_tokens)
        if job.echo is not None:
            body = wire.response_body(_final_response(job, text, generated))
        else:
            build = wire.chat_response if job.chat else wire.completion_response
            body = build(
                job.request_id, job.created, job.model, text, job.final_reason, job.prompt_tokens, generated
            )
        if sink.short == "end_after":
            body = body[: len(body) // 2]  # a correct Content-Length for half an answer
        elif sink.short == "garbage_after":
            body = wire.GARBAGE
        elif sink.short is not None:  # bad_utf8_after: invalid UTF-8 inside the answer's text
            field = b'"content":"' if job.chat else b'"text":"'
            body = body.replace(field, field + wire.BAD_UTF8, 1)
        return web.Response(body=body, content_type=wire.JSON_CONTENT_TYPE)


def _json_error(raw: bytes, exc: ValueError) -> ApiError:
    """vLLM (FastAPI) answers undecodable JSON with a 400 naming the decode error."""
    detail = getattr(exc, "msg", str(exc))
    position = getattr(exc, "pos", 0)
    if not raw.strip():
        detail = "Expecting value"
    return ApiError(
        400,
        str([{"type": "json_invalid", "loc": ("body", position), "msg": "JSON decode error",
              "input": {}, "ctx": {"error": detail}}]),
    )  # fmt: skip


def _status_fault(status: int) -> web.Response:
    """The injected ``status=`` answer: a vLLM error body, Retry-After on 503."""
    if status == 500:
        message = "Internal server error"
    else:
        try:
            message = f"{HTTPStatus(status).phrase} (injected by podsim)"
        except ValueError:
            message = f"HTTP {status} (injected by podsim)"
    response = web.Response(
        status=status, body=wire.error_body(status, message), content_type=wire.JSON_CONTENT_TYPE
    )
    if status == 503:
        response.headers["Retry-After"] = "1"
    return response


async def _refuse(request: web.Request) -> web.StreamResponse:
    """Reset the connection without a byte of answer; aiohttp then cancels this handler."""
    transport = request.transport
    if transport is not None:
        with contextlib.suppress(OSError, AttributeError, ValueError):
            sock = transport.get_extra_info("socket")
            if sock is not None:  # SO_LINGER 0: closing sends RST, like a crashed server
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()
    await asyncio.Event().wait()  # cancelled by handler_cancellation once the loss is noticed
    raise AssertionError("unreachable")


@web.middleware
async def _fastapi_style_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Unknown routes and wrong methods answer like FastAPI: ``{"detail": ...}`` JSON."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return web.Response(status=404, body=b'{"detail":"Not Found"}', content_type=wire.JSON_CONTENT_TYPE)
    except web.HTTPMethodNotAllowed as exc:
        return web.Response(
            status=405,
            body=b'{"detail":"Method Not Allowed"}',
            content_type=wire.JSON_CONTENT_TYPE,
            headers={"Allow": ", ".join(sorted(exc.allowed_methods))},
        )


async def serve(
    config: PodsimConfig,
    host: str,
    port: int,
    *,
    announce: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> None:
    """Serve until ``stop`` is set (or SIGTERM/SIGINT); ``announce`` gets the URL once bound.
    With ``ssl_context``, over TLS (vLLM's ``--ssl-*`` flags)."""
    sim = Podsim(config)
    runner = web.AppRunner(sim.app(), handler_cancellation=True, access_log=None, shutdown_timeout=0.5)
    try:
        await serve_app(
            runner, host, port, announce=announce, stop=stop, backlog=4096, ssl_context=ssl_context
        )
    finally:
        sim.engine.shutdown()
