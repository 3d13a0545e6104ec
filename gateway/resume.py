"""Mid-stream resume: continue a broken stream on another pod as if nothing had happened.

Sans-IO pieces: read what the client has already been sent (``Transcript``), build the
continuation request vLLM understands (the text so far as a final assistant message with
``continue_final_message``, or appended to a completion prompt), and splice the continuation's
events into the same client stream (``Splicer``: same id and created, one role delta, usage that
covers the whole answer). Only resumed streams pay for any of this.
"""

from __future__ import annotations

import contextlib
import json
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from mypy_extensions import mypyc_attr

from gateway.admit import CHUNK_ROUTES, encode_body
from transports import sse
from transports.client_socket import Sink
from transports.pod_client import PodBrokenError

if TYPE_CHECKING:
    from gateway.usage import UsageTap


@mypyc_attr(native_class=False)
class RolledBack(PodBrokenError):
    """The gateway closed a canary pod's answer because its route's rollout rolled back
    (``rollout.on_rollback: resume``): a break to continue on stable, not the pod's fault."""


def unsupported_reason(route: str, payload: dict[str, Any]) -> str | None:
    """Why this request's stream could not be continued correctly, or None if it can."""
    if route not in CHUNK_ROUTES:
        return f"the {route} API"
    if (payload.get("n") or 1) != 1:
        return "n > 1"
    if route == "chat" and (payload.get("tools") or payload.get("functions")):
        return "tool calls"
    if payload.get("logprobs") or payload.get("top_logprobs"):
        return "logprobs"
    if route == "completions" and (payload.get("echo") or not isinstance(payload.get("prompt"), str)):
        return "echo or a non-text prompt"
    return None


@dataclass
class Transcript:
    """What the client has received so far, read back from the relayed SSE bytes."""

    text: str = ""
    tokens: int = 0
    finished: bool = False
    id: str | None = None
    created: int | None = None

    @classmethod
    def read(cls, relayed: bytes) -> Transcript:
        out = cls()
        pos = 0
        while True:
            end = relayed.find(b"\n\n", pos)
            if end == -1:
                return out
            data = sse.event_data(relayed[pos:end])
            pos = end + 2
            if not data or data.strip() == sse.DONE:
                continue
            try:
                event = json.loads(data)
            except (ValueError, RecursionError):
                continue
            if not isinstance(event, dict):
                continue
            # only values of the right type: a pod's stream is not trusted (and compiled, the
            # attributes check what they are given)
            if not out.id and isinstance(ident := event.get("id"), str):
                out.id = ident
            if not out.created and isinstance(created := event.get("created"), int):
                out.created = created
            choices = event.get("choices")
            for choice in choices if isinstance(choices, list) else ():
                if not isinstance(choice, dict):
                    continue
                delta = choice.get("delta")
                piece = delta.get("content") if isinstance(delta, dict) else choice.get("text")
                if piece and isinstance(piece, str):
                    out.text += piece
                    out.tokens += 1
                if choice.get("finish_reason") is not None:
                    out.finished = True


def continuation_body(route: str, payload: dict[str, Any], done: Transcript) -> bytes:
    """The request that asks a pod for the rest of the answer."""
    body = dict(payload)
    if route == "chat":
        body["messages"] = [*payload["messages"], {"role": "assistant", "content": done.text}]
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    else:
        body["prompt"] = payload["prompt"] + done.text
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(payload.get(key), int):
            body[key] = max(1, payload[key] - done.tokens)
    return encode_body(body)


# What the original request's prompt is tokenized with on vLLM's ``/tokenize`` (TokenizeChatRequest):
# the same template and options give the same count the first pod reported to itself.
_TEMPLATE_KEYS = (
    "add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
    "chat_template_kwargs", "documents", "tools", "mm_processor_kwargs",
)


def tokenize_body(route: str, payload: dict[str, Any]) -> bytes:
    """The ``/tokenize`` request that counts the original request's prompt tokens.

    A continuation's own ``prompt_tokens`` include the text already generated and the chat
    template's tokens around it, so they cannot give the client's prompt back exactly.
    """
    if route == "chat":
        body = {"model": payload.get("model"), "messages": payload.get("messages")}
        body.update((key, payload[key]) for key in _TEMPLATE_KEYS if key in payload)
    else:
        body = {"model": payload.get("model"), "prompt": payload.get("prompt")}
        if "add_special_tokens" in payload:
            body["add_special_tokens"] = payload["add_special_tokens"]
    return encode_body(body)


def token_count(answer: bytes) -> int | None:
    """The ``count`` of a ``/tokenize`` answer, or None when it has none."""
    try:
        count = json.loads(answer).get("count")
    except (ValueError, AttributeError, RecursionError):
        return None
    return count if type(count) is int and 0 <= count < 1 << 53 else None


@dataclass
class Splicer:
    """Rewrites a continuation's events so they read as the original stream's.

    Its usage event becomes the client's (what it asked and got); what the pods really did is kept
    in ``pods`` for quotas and metrics (see docs/resilience.md, "Usage after a resume").
    """

    created: int | None
    new_created: int | None = None
    tokens_before: int = 0
    prompt_tokens: int | None = None  # the original prompt, counted by /tokenize; None if that failed
    earlier: tuple[int, ...] = ()  # tokens_before of each earlier continuation (they broke too)
    pods: tuple[int, int] | None = None  # (prompt, completion) tokens over every pod of the stream
    client: tuple[int, int] | None = None  # (prompt, completion) tokens the client's usage reports
    _skip_role: bool = True

    def head(self, data: bytes) -> bytes:
        """The continuation's opening bytes, without its role-only event(s)."""
        out = []
        pos = 0
        while True:
            end = data.find(b"\n\n", pos)
            if end == -1:
                out.append(data[pos:])
                break
            event = data[pos : end + 2]
            pos = end + 2
            payload = sse.event_data(event)
            if payload and self.new_created is None:
                with contextlib.suppress(ValueError, AttributeError, RecursionError):
                    created = json.loads(payload).get("created")
                    if isinstance(created, int):  # a pod's bytes: only a number is taken
                        self.new_created = created
            if self._skip_role and payload and b'"role"' in payload and b'"content":""' in payload:
                continue
            self._skip_role = False
            out.append(event)
        return self.chunk(b"".join(out))

    def chunk(self, data: bytes) -> bytes:
        if type(self.created) is int and type(self.new_created) is int and self.new_created != self.created:
            data = data.replace(b'"created":%d' % self.new_created, b'"created":%d' % self.created)
        if data.find(b'"usage"') != -1:
            data = self._fix_usage(data)
        return data

    def _fix_usage(self, data: bytes) -> bytes:
        """The client's usage: its own prompt, and every token it received from every pod.

        The continuation's prompt was the client's prompt plus the text so far plus template tokens;
        the original prompt's count comes from ``/tokenize`` (``prompt_tokens``). Without it, the
        continuation's prompt less the tokens before the break is the best left (a few template
        tokens too many). The pods' own work, for quotas: the first pod read the prompt and produced
        the tokens relayed before the first break, each continuation read its longer prompt.
        """
        events = data.split(b"\n\n")
        for i, event in enumerate(events):
            if b'"usage"' not in event or not event.startswith(b"data: "):
                continue
            try:
                payload = json.loads(event[6:])
                usage = payload["usage"]
                cont_prompt, cont_completion = usage["prompt_tokens"], usage["completion_tokens"]
                if type(cont_prompt) is not int or type(cont_completion) is not int:
                    continue
                prompt = self.prompt_tokens
                if prompt is None:
                    prompt = max(0, cont_prompt - self.tokens_before)
                completion = self.tokens_before + cont_completion
                usage["prompt_tokens"] = prompt
                usage["completion_tokens"] = completion
                usage["total_tokens"] = prompt + completion
            except (ValueError, KeyError, TypeError, RecursionError):
                continue
            # each earlier (broken) continuation read the prompt this one did, less the tokens since
            broken = sum(max(0, cont_prompt - (self.tokens_before - t)) for t in self.earlier)
            self.client = (prompt, completion)
            self.pods = (prompt + broken + cont_prompt, completion)
            events[i] = b"data: " + json.dumps(payload, separators=(",", ":")).encode()
        return b"\n\n".join(events)


class RawBudget:
    """How many bytes of sent logs the whole process keeps uncompressed (``SentLog``)."""

    __slots__ = ("free",)

    def __init__(self, size: int) -> None:
        self.free = size


# 4 MiB: most of every log kept whole at a hundred streams of 256 tokens (~5 MB in all); past it (500
# streams, 2000) blocks are deflated as before, so a gateway's peak memory grows by 4 MiB at most.
RAW_BUDGET = RawBudget(4 << 20)


# A sent log's block, and how much of its first one presets each deflated block's window. Per token of
# ~230 bytes (zlib 1, 4 KiB window): 4 KiB blocks alone 15.6x, 0.27 µs; 2 KiB alone 9.6x, 0.48 µs;
# 2 KiB with 256 bytes preset 28x, 0.31 µs, and half the open block a stream holds.
_BLOCK = 2048
_DICT = 256


@mypyc_attr(native_class=False)
class _Deflated(bytes):
    """A sent log's block deflated past the budget (raw DEFLATE, 4 KiB window)."""


class SentLog:
    """What a resumable stream has sent so far, in blocks, for a resume to read back.

    A resume needs the text already sent, and reading it back from the SSE bytes themselves is the
    exact way (``Transcript.read``). But an OpenAI chunk carries ~230 bytes for one token, so a
    256-token answer held whole is ~59 KB per stream: at 500 streams under a resume policy that was
    ~50 MB of the gateway's peak memory. The chunks repeat themselves (same id, model, created,
    keys), so a full block of ``BLOCK`` bytes deflates well on its own (a small window: ~24 KB of
    zlib state while it runs), ~28x with the log's first ``_DICT`` bytes as zlib's preset
    dictionary, which holds those repeated parts before the block's first byte. Deflating adds
    ~4.4 k instructions to a read of ~9.5 k (``bench_readpath`` with no budget), if little time
    (zlib runs ~1 % of the CPU at 2000 slow streams, perf), so full blocks are kept as they are
    while the process's ``RAW_BUDGET`` lasts (given back when the log goes), and only those past it
    are deflated; the last, partial block stays raw, so it is kept short: at 2000 slow streams the
    open blocks were the largest part of resume's memory.
    """

    __slots__ = ("_blocks", "_held", "_zdict", "open_reads", "open_size")

    BLOCK: ClassVar[int] = _BLOCK

    def __init__(self) -> None:
        # The open block: the reads themselves (kept, not copied: a list append and an add a read),
        # joined once it is full. bytearray += cost ~2x as much per read (callgrind). The recorder
        # appends to it itself (``Recorder.sink``), a call fewer on every read.
        self.open_reads: list[bytes] = []  # emptied in place when sealed
        self.open_size = 0
        self._blocks: list[bytes] = []  # within the budget: kept as they are; past it: _Deflated
        self._held = 0  # bytes of the budget this log holds
        self._zdict = b""  # the first block's first _DICT bytes: every deflated block's preset dictionary

    def append(self, data: bytes) -> None:
        self.open_reads.append(data)
        self.open_size += len(data)
        if self.open_size >= _BLOCK:
            self.seal()

    def seal(self) -> None:
        """Close the open block (the recorder calls this once ``open_size`` reaches ``BLOCK``)."""
        block = b"".join(self.open_reads)
        size = len(block)
        self.open_reads.clear()
        self.open_size = 0
        if not self._zdict:
            self._zdict = block[:_DICT]
        if RAW_BUDGET.free >= size:
            RAW_BUDGET.free -= size
            self._held += size
            self._blocks.append(block)
        else:
            packer = zlib.compressobj(1, zlib.DEFLATED, -12, 4, zlib.Z_DEFAULT_STRATEGY, self._zdict)
            self._blocks.append(_Deflated(packer.compress(block) + packer.flush()))

    def getvalue(self) -> bytes:
        """Everything appended, in order."""
        parts = [self._inflate(block) if type(block) is _Deflated else block for block in self._blocks]
        return b"".join([*parts, *self.open_reads])

    def _inflate(self, block: bytes) -> bytes:
        unpacker = zlib.decompressobj(-12, self._zdict)
        return unpacker.decompress(block) + unpacker.flush()

    def __del__(self) -> None:
        RAW_BUDGET.free += self._held


class Recorder:
    """Passes complete events on (holding back a partial one), remembers them, spots pod errors.

    Used only for streams that may be resumed: a partial event already sent could not be
    continued cleanly, and a pod's own mid-stream error event is a break to resume from, not
    something the client should see.
    """

    __slots__ = ("broken", "log", "splicer", "tail")

    def __init__(self) -> None:
        self.log = SentLog()
        self.tail = b""
        self.broken = False
        self.splicer: Splicer | None = None

    @property
    def sent(self) -> bytes:
        """What the client has been sent (read back only when resuming or counting at the end)."""
        return self.log.getvalue()

    def filter(self, body: bytes) -> bytes:
        """What of ``body`` may be passed on now, recorded (the stream's head, a continuation's)."""
        out: list[bytes] = []
        self.sink(out.append)(body)
        return b"".join(out)

    def sink(
        self,
        write: Callable[[bytes], None],
        on_break: Callable[[], None] | None = None,
        tap: UsageTap | None = None,
    ) -> Sink:
        """The per-read path of a recorded stream (it runs for every token): complete events are
        recorded and written, a partial one held back; at a pod's error event what came before it is
        passed on, nothing after, and ``on_break`` is called. ``tap``: the stream's usage tap, which
        gets the recorded bytes before ``write`` does.

        A token's read is one whole event, none held before it, no error, no usage: that read takes
        the first way, in one frame, and goes to ``write`` itself, since the tap would pass it on
        untouched (with a recorder it counts nothing, and, given whole events only, never holds any
        back). Every other read takes ``general``'s way.
        Each call on a read costs ~1 k instructions in Python 3.11 (``bytes.find`` parses its
        arguments from a tuple): the first way makes ~1.1 k fewer than the general way followed by
        the tap's (``bench_readpath``: 16.1 k -> 15.0 k a read, every feature on)."""
        return _RecordingSink(self, write, on_break, tap)


class _RecordingSink:
    """``Recorder.sink``'s sink (see there). A class, not a closure: compiled, a closure's variables
    live in an object that holds the closure itself, a cycle only the garbage collector frees, and
    with it the whole request."""

    __slots__ = (
        "error_event", "log", "on_break", "open_reads", "passed", "recorder", "tap", "usage_mark", "write",
    )

    def __init__(
        self,
        recorder: Recorder,
        write: Callable[[bytes], None],
        on_break: Callable[[], None] | None,
        tap: UsageTap | None,
    ) -> None:
        self.recorder = recorder
        self.log = recorder.log
        self.open_reads = recorder.log.open_reads  # the log's own ``append``, inline: it runs for every token
        self.error_event = sse.ERROR_EVENT
        self.usage_mark = sse.USAGE_MARK
        self.write = write
        self.on_break = on_break
        self.tap = tap
        self.passed: Callable[[bytes], None] = write if tap is None else tap.wrap(write, count=False)

    def __call__(self, body: bytes) -> None:
        recorder = self.recorder
        if (
            recorder.tail or recorder.broken or recorder.splicer is not None or body[-2:] != b"\n\n"
            or body.find(self.error_event) != -1
        ):  # fmt: skip
            self.general(body)
            return
        self.open_reads.append(body)
        log = self.log
        log.open_size += len(body)
        if log.open_size >= _BLOCK:
            log.seal()
        if self.tap is not None and body.find(self.usage_mark) != -1:
            self.passed(body)
        else:
            self.write(body)

    def general(self, body: bytes) -> None:
        recorder = self.recorder
        if recorder.broken:
            return
        data = recorder.tail + body if recorder.tail else body
        if data[-2:] == b"\n\n":
            recorder.tail = b""
            out = data
        else:
            cut = data.rfind(b"\n\n") + 2
            if cut < 2:
                recorder.tail = data
                return
            recorder.tail = data[cut:]
            out = data[:cut]
        error_at = out.find(self.error_event)
        if error_at != -1:
            out = out[:error_at]
            recorder.broken = True
        if recorder.splicer is not None and out:
            out = recorder.splicer.chunk(out)
        self.log.append(out)  # (the first way above inlines it: it runs for every token)
        if out:
            self.passed(out)
        if recorder.broken and self.on_break is not None:
            self.on_break()
