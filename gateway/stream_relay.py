"""The streaming relay: hold the status until the first token, pass the pod's bytes through, judge
the end, and continue on another pod when a stream breaks.

Once the first token is out, the pod's bytes are spliced to the client's socket from the pod
connection's parser callback (see ``transports/pod_client.py``), untouched; under any other server
or protocol each pod read is one ASGI ``send``. Nothing here runs per token except the splice sink
(and, when the stream may be resumed or has several choices, the recorder and finish watch it
wraps, and for a stream under a quota the usage tap, ``gateway/usage.py``), so keep it that way:
no per-chunk awaits, wrappers or allocations.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.admit import CHUNK_ROUTES, InferenceRequest
from gateway.completeness import FinishWatch, choices_of, incomplete
from gateway.config import Config
from gateway.deadlines import FIRST_TOKEN_DEADLINES, TOTAL_DEADLINES
from gateway.errors import GatewayError, upstream_failed, upstream_truncated
from gateway.exchange import Exchange
from gateway.metrics import GatewayMetrics
from gateway.pod_errors import reason
from gateway.pods.registry import Pod, PodRegistry
from gateway.quota.estimate import prompt_estimate
from gateway.resume import (
    Recorder,
    RolledBack,
    Splicer,
    Transcript,
    continuation_body,
    token_count,
    tokenize_body,
    unsupported_reason,
)
from gateway.retries import Retryable
from gateway.usage import UsageTap, content_events, tokens_of, trailing_reads, wants_usage
from transports import sse
from transports.client_socket import ClientSocket, SpliceTarget, client_socket, start_response
from transports.deadline import Deadline
from transports.pod_client import PodBrokenError, PodLineTooLong, PodResponse, PodStalledError, StallWatch

_SSE_HEADERS = ((b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"))

Connect = Callable[[Exchange, InferenceRequest, Pod, list[tuple[bytes, bytes]]], Awaitable[PodResponse]]


class StreamRelay:
    """Relays one streaming answer (``text/event-stream``) from the first token to its end.

    ``connect`` sends a request to a pod (the relay's connect phase), for continuations.
    """

    def __init__(
        self, config: Config, registry: PodRegistry, metrics: GatewayMetrics, connect: Connect
    ) -> None:
        self.config = config
        self.registry = registry
        self.metrics = metrics
        self._connect = connect

    async def first_token(self, pod: Pod, resp: PodResponse) -> bytes:
        """Everything the pod sent up to and including the first event a client would see.

        At most ``upstream.max_event_bytes`` of it, and no line longer than that (also enforced
        by the pod response for the rest of the stream): a pod cannot grow the gateway's memory.
        """
        try:
            head, _ = await read_first_token(resp, self.config.upstream.max_event_bytes)
        except (sse.MalformedEvent, PodLineTooLong) as bad:  # (one name per type: compiled, see docs)
            resp.close()
            self.metrics.upstream_errors.labels(pod.name, "protocol").inc()
            raise upstream_failed(pod.name, f"sent a malformed event before the first token: {bad}") from None
        except PodBrokenError as exc:
            self.metrics.upstream_errors.labels(pod.name, "broken_stream").inc()
            detail = f"broke the stream before the first token ({reason(exc)})."
            raise Retryable(upstream_failed(pod.name, detail), "reset") from None
        if not head:
            raise upstream_failed(pod.name, "closed the stream before sending anything.")
        return head  # the stream ended without a token (e.g. only a role chunk): pass it on

    async def relay(
        self, ex: Exchange, pod: Pod, resp: PodResponse, content_type: bytes, head: bytes
    ) -> None:
        """The status and ``head`` (up to the first token), then the rest of the answer as it comes.

        A stream that breaks ends with an SSE error event, after continuing on other pods while
        that is allowed; the status line is long gone by then, so the event is the only way to say it.
        """
        send = ex.send
        req = ex.req
        assert req is not None and ex.budget is not None and ex.watch is not None
        start = {
            "type": "http.response.start",
            "status": 200,
            "headers": [*ex.response_headers(content_type), *_SSE_HEADERS],
        }
        ex.ttft = time.perf_counter() - ex.started
        # Only chat and completions chunks can be recorded and continued elsewhere (not the Responses API)
        resumable = req.route in CHUNK_ROUTES and self.config.resume.enabled_for(req.model)
        recorder = Recorder() if resumable else None
        tap = UsageTap(ex) if UsageTap.metered(ex) else None
        first = recorder.filter(head) if recorder is not None else head
        if tap is not None:
            first = tap.head(first)
        elif recorder is None:  # tokens relayed, counted by reads from here on (see _pump)
            ex.tokens_relayed = content_events(first)
        await start_response(send, start, {"type": "http.response.body", "body": first, "more_body": True})
        ex.status = 200
        choices = choices_of(req.payload)
        finish = FinishWatch() if choices > 1 else None
        if finish is not None:
            finish.feed(head)

        # relay: the pod's bytes, as they arrive, under the stall and total deadlines; on a break,
        # continue on another pod when this stream may be resumed
        socket = client_socket(send)
        # HTTP/1.1 holds the stream's last read back for the final message (one write with the end)
        take_tail = socket.take_tail if isinstance(socket, ClientSocket) else _nothing
        try:
            while True:
                err, broke = await self._pump(ex, pod, resp, socket, recorder, choices, finish, tap)
                if err is None or not broke or recorder is None:
                    break
                if held := take_tail():  # (a pod that broke after its last event) before the continuation
                    await send({"type": "http.response.body", "body": held, "more_body": True})
                resumed = await self._resume(ex, ex.req or req, recorder, err, tap)  # a rollback renames it
                if resumed is None:
                    break
                err = None
                pod, resp = resumed
            if tap is not None:
                tap.end(resp.previous + resp.last)
                if tap.held:  # a partial event the pod never finished: as it sent it
                    body = take_tail() + tap.flush()
                    await send({"type": "http.response.body", "body": body, "more_body": True})
            if err is not None:
                event = err.sse_event()
                if recorder is None and not sse.ends_event(resp.last):
                    event = b"\n\n" + event  # the pod's bytes stopped inside an event: close it first
                await send({"type": "http.response.body", "body": take_tail() + event, "more_body": True})
            elif resp.last.find(sse.ERROR_EVENT) != -1 or resp.previous.find(sse.ERROR_EVENT) != -1:
                # whole by its framing, but the pod ended it with an error event of its own (vLLM's
                # mid-stream failure): passed on as sent, and not an "ok" for the logs or a canary's judge
                ex.detail = "upstream_error_event"
            ex.watch.finished = True
            await send({"type": "http.response.body", "body": take_tail(), "more_body": False})
        finally:  # every ending counts what the pods reported, a client that left after it included
            self._record_usage(ex, resp, recorder, tap)

    def _record_usage(
        self, ex: Exchange, resp: PodResponse, recorder: Recorder | None, tap: UsageTap | None
    ) -> None:
        """``ex.usage`` from the pods; without it, the tokens the client got are the charge, counted
        here from the recorder when the tap did not count them per read (``read_sink``)."""
        self._pods_usage(ex, resp, recorder, tap)
        if ex.usage is None and tap is not None and recorder is not None:
            ex.tokens_relayed = content_events(recorder.sent)

    def _pods_usage(
        self, ex: Exchange, resp: PodResponse, recorder: Recorder | None, tap: UsageTap | None
    ) -> None:
        """``ex.usage``: what the pods did (over every pod of a resumed stream), counted in the metrics."""
        splicer = recorder.splicer if recorder is not None else None
        if splicer is not None:  # resumed: the client's usage was rewritten; the pods' is the sum
            if splicer.pods is None:
                return
            ex.usage = splicer.pods
            usage: dict[str, int] | None = {"prompt_tokens": ex.usage[0], "completion_tokens": ex.usage[1]}
        elif tap is not None and tap.usage is not None:
            usage = tap.usage
        elif resp.complete:
            usage = sse.find_usage(resp.previous + resp.last)
        else:
            return
        if ex.usage is None:
            ex.usage = tokens_of(usage)
        ex.count_tokens(self.metrics, usage)

    async def _pump(
        self,
        ex: Exchange,
        pod: Pod,
        resp: PodResponse,
        socket: SpliceTarget | None,
        recorder: Recorder | None,
        choices: int = 1,
        finish: FinishWatch | None = None,
        tap: UsageTap | None = None,
    ) -> tuple[GatewayError | None, bool]:
        """Relay one pod's answer to its end; returns (the error that ended it, whether it broke).

        A stream that ends cleanly but not whole (see ``gateway/completeness.py``) is a break too.
        """
        assert ex.budget is not None
        send = ex.send
        stall = StallWatch(resp, ex.budget.stall_s)
        reads = resp.chunks  # those of the head, already counted
        try:
            with Deadline(ex.task, ex.deadline, TOTAL_DEADLINES):
                if socket is not None:
                    resp.splice(read_sink(socket.writer(resp), resp, recorder, finish, tap))
                    await resp.done
                else:  # the same sink, its output sent by ASGI after each read
                    out: list[bytes] = []
                    sink = read_sink(out.append, resp, recorder, finish, tap)
                    while chunk := await resp.read():
                        sink(chunk)
                        for body in out:
                            await send({"type": "http.response.body", "body": body, "more_body": True})
                        out.clear()
            why = incomplete(resp, choices, finish, ex.route)
            if why is None:
                return None, False
            resp.close()  # a pod that ends answers short gets no keep-alive reuse
            self.metrics.upstream_errors.labels(pod.name, "truncated").inc()
            self.registry.report_failure(pod, "truncated stream")
            ex.detail = "upstream_truncated"
            return upstream_truncated(pod.name, f"{why}."), True
        except TimeoutError:
            resp.close()
            return ex.timeout("total", self.metrics), False
        except PodStalledError:
            self.registry.report_failure(pod, "stalled mid-stream")
            return ex.timeout("stall", self.metrics), True
        except PodLineTooLong as too_long:  # (one name per type: compiled, a name has one type)
            self.metrics.upstream_errors.labels(pod.name, "protocol").inc()
            self.registry.report_failure(pod, "oversized event")
            ex.detail = "upstream_truncated"
            return upstream_truncated(pod.name, f"sent an oversized event ({reason(too_long)})."), True
        except RolledBack:  # the route's rollout rolled back: continue on stable (canary/rollback.py)
            ex.detail = "rollback"
            return upstream_truncated(pod.name, "was rolled back mid-answer."), True
        except PodBrokenError as exc:
            self.metrics.upstream_errors.labels(pod.name, "broken_stream").inc()
            self.registry.report_failure(pod, "broke mid-stream")
            ex.detail = "upstream_broke_mid_stream"
            return upstream_truncated(pod.name, f"broke the stream mid-answer ({reason(exc)})."), True
        finally:
            stall.cancel()
            resp.unsplice()  # the sinks hold resp: without this each stream is a reference cycle
            # here, not after the pump returns: a client that leaves cancels it, and what it was
            # sent must still be counted (the access log's chunks, sluicegate_stream_chunks_total)
            ex.chunks += resp.chunks
            if tap is None:  # tokens relayed on every ending, when no usage tap counts them
                req = ex.req
                no_usage = req is not None and not (resp.complete and wants_usage(req.payload))
                if no_usage and req is not None and not ex.prompt_estimate:  # as admission estimates it
                    ex.prompt_estimate = prompt_estimate(req.payload, self.config.quotas.chars_per_token)
                if recorder is not None:  # what the client got of every pod, counted once
                    if no_usage:
                        ex.tokens_relayed = content_events(recorder.sent)
                else:  # a read is an event (a token) of a paced stream: no per-read work
                    ex.tokens_relayed += max(0, resp.chunks - reads - trailing_reads(resp))

    def _hold(self, ex: Exchange, pod: Pod, resp: PodResponse) -> None:
        """Count a continuation pod as busy until the request ends."""
        pod.in_flight += 1
        self.metrics.child(self.metrics.in_flight, pod.name).inc()
        ex.held.append((pod, resp))

    def release_held(self, ex: Exchange) -> None:
        """At the request's end: continuation pods are no longer busy with it, their answers released."""
        for held_pod, held_resp in ex.held:
            held_resp.release()
            held_pod.in_flight -= 1
            self.metrics.child(self.metrics.in_flight, held_pod.name).dec()

    async def _resume(
        self, ex: Exchange, req: InferenceRequest, recorder: Recorder, err: GatewayError, tap: UsageTap | None
    ) -> tuple[Pod, PodResponse] | None:
        """Continue the answer on another pod; None (and a counted outcome) when it cannot be."""
        rollback = ex.detail == "rollback"  # moved to stable by a rollback, not broken
        why = unsupported_reason(req.route, req.payload)
        if why is not None:
            self.metrics.stream_resumes.labels("unsupported").inc()
            err.message += f" The stream cannot be resumed on another pod ({why})."
            return None
        assert ex.budget is not None
        loop = ex.task.get_loop()
        done = Transcript.read(recorder.sent)  # once: nothing is sent between the attempts
        while ex.resumes < self.config.resume.max_per_request and loop.time() < ex.deadline:
            pod = self.registry.pick(
                req.model, exclude=tuple(ex.tried), criticality=ex.criticality, pods=ex.selector
            )
            if pod is None:
                break
            ex.resumes += 1
            ex.tried.append(pod)
            body = continuation_body(req.route, req.payload, done)
            cont = InferenceRequest(req.route, req.model, True, body, req.payload)
            resp: Any = None  # a PodResponse once connected (Any: see docs/architecture.md, compiled code)
            previous = recorder.splicer
            counting: asyncio.Task[int | None] | None = None
            if previous is None and wants_usage(req.payload):  # the client's prompt, counted meanwhile
                counting = asyncio.ensure_future(self._prompt_tokens(ex, req, pod))
            try:
                first_token_at = min(loop.time() + ex.budget.first_token_s, ex.deadline)
                with Deadline(ex.task, first_token_at, FIRST_TOKEN_DEADLINES):
                    resp = await self._connect(ex, cont, pod, ex.headers)
                    assert ex.watch is not None
                    ex.watch.upstream = resp
                    if resp.status != 200:
                        raise upstream_failed(pod.name, f"answered HTTP {resp.status}")
                    head = await self.first_token(pod, resp)
            except (Retryable, GatewayError, TimeoutError):
                if resp is not None:
                    resp.close()
                if counting is not None:
                    counting.cancel()
                continue
            self._hold(ex, pod, resp)
            recorder.broken = False
            recorder.tail = b""
            if previous is not None:
                prompt, earlier = previous.prompt_tokens, (*previous.earlier, previous.tokens_before)
            else:
                prompt, earlier = await _result(counting, ex.budget.connect_s), ()
            recorder.splicer = Splicer(
                created=done.created, tokens_before=done.tokens, prompt_tokens=prompt, earlier=earlier
            )
            out = recorder.filter(recorder.splicer.head(head))
            if tap is not None:
                out = tap.feed(out)
            await ex.send({"type": "http.response.body", "body": out, "more_body": True})
            self.metrics.stream_resumes.labels("ok").inc()
            ex.pod = pod
            ex.detail = "resumed"
            if rollback:
                ex.detail = "resumed_rollback"
                self.metrics.rollback_resumed_streams.labels(ex.public_model, "resumed").inc()
            return pod, resp
        self.metrics.stream_resumes.labels("failed").inc()
        if rollback:
            self.metrics.rollback_resumed_streams.labels(ex.public_model, "failed").inc()
        err.message += " No other pod could continue the stream."
        return None

    async def _prompt_tokens(self, ex: Exchange, req: InferenceRequest, pod: Pod) -> int | None:
        """The client's prompt in tokens, as ``pod`` (same model, same tokenizer) counts it: vLLM's
        ``/tokenize`` with the original messages and template options; None when it cannot say."""
        body = tokenize_body(req.route, req.payload)
        ask = InferenceRequest("tokenize", req.model, False, body, req.payload)
        resp: Any = None  # a PodResponse once connected (Any: see docs/architecture.md, compiled code)
        try:
            resp = await self._connect(ex, ask, pod, ex.headers)
            if resp.status != 200:
                return None
            return token_count(await resp.read_all())
        except (Retryable, GatewayError, PodBrokenError, OSError):
            return None
        finally:
            if resp is not None:
                resp.release()


def _nothing() -> bytes:
    """No held tail: every transport but HTTP/1.1's splice writes each read as it comes."""
    return b""


async def read_first_token(resp: PodResponse, cap: int) -> tuple[bytes, bool]:
    """What the pod sent up to and including the first event a client would see, and whether that
    event came (False: the answer ended first). No line longer than ``cap`` from here on, and
    ``MalformedEvent`` after ``cap`` bytes without a token: a pod cannot grow the gateway's memory."""
    resp.max_line = cap
    head = b""
    pos = 0
    while chunk := await resp.read():
        head += chunk
        found, pos = sse.scan_first_token(head, pos)
        if found:
            return head, True
        if len(head) > cap:
            raise sse.MalformedEvent(f"more than {cap} bytes and no token")
    return head, False


async def _result(task: asyncio.Task[int | None] | None, seconds: float) -> int | None:
    """The task's result within ``seconds`` (it has mostly finished by now), else None."""
    if task is None:
        return None
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if not done:
        task.cancel()
        return None
    return None if task.cancelled() or task.exception() is not None else task.result()


def read_sink(
    write: Callable[[bytes], None],
    resp: PodResponse,
    recorder: Recorder | None,
    finish: FinishWatch | None,
    tap: UsageTap | None,
) -> Callable[[bytes], None]:
    """What every pod read goes through on its way to ``write``: the finish watch, the recorder, the
    usage tap (each only when the stream has one)."""
    if recorder is not None:  # it passes reads on to the tap; tokens relayed are counted from it
        sink = recorder.sink(write, functools.partial(_broken_by_its_pod, resp), tap)
    else:
        sink = write if tap is None else tap.wrap(write)
    return sink if finish is None else finish.wrap(sink)


def _broken_by_its_pod(resp: PodResponse) -> None:
    resp.close(PodBrokenError("the pod reported an error mid-stream"))
