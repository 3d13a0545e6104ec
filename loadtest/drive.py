"""Sending the load: closed-loop workers or an open-loop arrival schedule, one ``Record`` per request.

Open-loop requests are sent when their *scheduled* time comes, whatever the server is doing; each
record keeps that scheduled time beside the real send time, so a stalled server shows up as
latency from the schedule (and as dispatch delay once ``max_inflight`` holds requests back) instead
of vanishing from the samples: the coordinated-omission mistake of generators that time from the
real send. Closed-loop workers send their next request only after the last one ended, so their
scheduled and sent times coincide and a stall simply means fewer requests.

HTTP/1.1 over ``http://`` goes through loadgen.py's lean protocol (one ``asyncio.Protocol`` per
keep-alive connection, tokens counted by a byte regex); h2, h3, gRPC-Web and HTTPS h1 go through
the project's own client (transports/client), which is slower per token but speaks them all.
"""

from __future__ import annotations

import asyncio
import json
import random
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from loadtest.loadgen import StreamProtocol

CHAT_PATH = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt and the answer length to ask for."""

    text: str
    max_tokens: int


@dataclass(slots=True)
class Plan:
    """One load run. Exactly one of ``concurrency`` (closed loop) and ``rate`` (open loop) is set."""

    base_url: str
    model: str
    prompts: list[Prompt]
    concurrency: int = 0
    rate: float = 0.0
    arrivals: str = "constant"  # or "poisson"
    seed: int = 0
    duration_s: float = 0.0
    requests: int = 0
    max_tokens: int | None = None  # overrides each prompt's
    transport: str = "h1"
    api_key: str | None = None
    cacert: str | None = None
    timeout_s: float = 300.0
    max_inflight: int = 0  # open loop: 0 = no cap

    @property
    def open_loop(self) -> bool:
        return self.rate > 0


@dataclass(slots=True)
class Record:
    """What one request saw; times are ``time.perf_counter()`` seconds (0.0 = did not happen)."""

    index: int
    scheduled: float
    max_tokens: int
    transport: str
    sent: float = 0.0
    first: float = 0.0
    end: float = 0.0
    marks: list[float] = field(default_factory=list)
    tokens_seen: int = 0
    output_tokens: int | None = None
    status: int = 0
    error: str | None = None
    pod: str | None = None
    variant: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def raw(self, origin: float, **extra: Any) -> dict[str, Any]:
        """One ``--raw`` JSONL line: times in ms, from the run's start or from this request's send."""

        def ms(value: float) -> float:
            return round(value * 1000, 3)

        sent = self.sent or None
        itl = [ms(b - a) for a, b in zip(self.marks, self.marks[1:], strict=False)]
        return {
            "index": self.index,
            "scheduled_ms": ms(self.scheduled - origin),
            "sent_ms": ms(self.sent - origin) if sent else None,
            "dispatch_delay_ms": ms(self.sent - self.scheduled) if sent else None,
            "ttft_ms": ms(self.first - self.sent) if sent and self.first else None,
            "itl_ms": itl,
            "e2e_ms": ms(self.end - self.sent) if sent and self.end else None,
            "response_ms": ms(self.end - self.scheduled) if self.end else None,
            "output_tokens": self.output_tokens,
            "tokens_seen": self.tokens_seen,
            "max_tokens": self.max_tokens,
            "status": self.status,
            "error": self.error,
            "variant": self.variant,
            "pod": self.pod,
            "transport": self.transport,
            **extra,
        }


def arrival_offsets(rate: float, arrivals: str, seed: int) -> Iterator[float]:
    """Seconds from the start at which open-loop requests are due: evenly spaced, or Poisson
    (exponential gaps from a seeded generator, so a run can be repeated exactly)."""
    if arrivals == "poisson":
        rng = random.Random(seed)
        at = 0.0
        while True:
            at += rng.expovariate(rate)
            yield at
    else:
        index = 0
        while True:
            yield index / rate
            index += 1


class _LagProbe:
    """Event-loop lag: how late a 20 ms timer fires, sampled for the whole run."""

    PERIOD = 0.02

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            due = time.perf_counter() + self.PERIOD
            await asyncio.sleep(self.PERIOD)
            self.samples.append(max(0.0, time.perf_counter() - due))

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


class _H1Sender:
    """HTTP/1.1 on loadgen's protocol: a pool of idle keep-alive connections, grown on demand."""

    def __init__(self, plan: Plan) -> None:
        parts = urlsplit(plan.base_url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        prefix = parts.path.rstrip("/")
        path = prefix + ("/chat/completions" if prefix.endswith("/v1") else CHAT_PATH)
        auth = f"Authorization: Bearer {plan.api_key}\r\n" if plan.api_key else ""
        self.head = (
            f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\n{auth}Content-Length: "
        ).encode()
        self.timeout_s = plan.timeout_s
        self.idle: list[StreamProtocol] = []

    async def send(self, record: Record, body: bytes) -> None:
        conn = None
        while self.idle and conn is None:
            candidate = self.idle.pop()
            if not candidate.closed:
                conn = candidate
        if conn is None:
            loop = asyncio.get_running_loop()
            try:
                _, conn = await asyncio.wait_for(
                    loop.create_connection(StreamProtocol, self.host, self.port), self.timeout_s
                )
            except (OSError, TimeoutError) as exc:
                record.error = f"connect: {exc or type(exc).__name__}"
                return
        conn.reset()
        waiter = asyncio.get_running_loop().create_future()
        conn.waiter = waiter
        assert conn.transport is not None
        record.sent = time.perf_counter()
        conn.transport.write(self.head + str(len(body)).encode() + b"\r\n\r\n" + body)
        reusable = False
        try:
            await asyncio.wait_for(waiter, self.timeout_s)
            reusable = conn.keep_alive
        except TimeoutError:
            record.error = f"timeout: no complete answer within {self.timeout_s:g} s"
        except (ConnectionError, OSError) as exc:
            record.error = f"closed: {exc or type(exc).__name__}"
        finally:
            conn.waiter = None
        record.end = time.perf_counter()
        record.status, record.first, record.marks = conn.status, conn.first, conn.marks
        record.tokens_seen, record.output_tokens = conn.tokens, conn.usage_tokens
        record.pod, record.variant = conn.pod, conn.variant
        if record.error is None:
            if conn.status != 200:
                record.error = f"status_{conn.status}"
            elif not conn.done:
                record.error = "no_done: stream ended without [DONE]"
        if reusable and record.error is None:
            self.idle.append(conn)
        elif conn.transport is not None:
            conn.transport.close()

    async def close(self) -> None:
        for conn in self.idle:
            if conn.transport is not None:
                conn.transport.close()


class _ClientSender:
    """h2 / h3 / gRPC-Web (and HTTPS h1) through transports.client, forced to one transport."""

    def __init__(self, plan: Plan) -> None:
        from transports.client import SluicegateClient

        verify: Any = plan.cacert or True
        self.client = SluicegateClient(
            plan.base_url, api_key=plan.api_key, transport=plan.transport, verify=verify,
            h2c=plan.transport == "h2" and plan.base_url.startswith("http://"),
            read_timeout=plan.timeout_s,
        )
        self.model = plan.model

    async def send(self, record: Record, body: bytes) -> None:
        from transports.client import SluicegateError

        payload = json.loads(body)
        params = {k: v for k, v in payload.items() if k not in ("model", "messages", "stream")}
        stream = self.client.stream_chat(self.model, payload["messages"], **params)
        record.sent = time.perf_counter()
        try:
            async with asyncio.timeout(self.client.read_timeout):
                async for _ in stream:
                    now = time.perf_counter()
                    if not record.first:
                        record.first = now
                    record.marks.append(now)
                    record.tokens_seen += 1
        except SluicegateError as exc:
            record.error = f"status_{exc.status}" if exc.status else f"error: {exc}"
        except TimeoutError:
            record.error = f"timeout: no complete answer within {self.client.read_timeout:g} s"
        except Exception as exc:  # any transport failure is one failed request
            record.error = f"{type(exc).__name__}: {exc}"
        finally:
            await stream.aclose()
        record.end = time.perf_counter()
        record.status = stream.status or 0
        record.transport = stream.transport or record.transport
        usage = stream.usage or {}
        if isinstance(usage.get("completion_tokens"), int):
            record.output_tokens = usage["completion_tokens"]
        headers = dict(stream.headers)
        record.pod, record.variant = headers.get("x-sluicegate-pod"), headers.get("x-sluicegate-variant")

    async def close(self) -> None:
        await self.client.aclose()


@dataclass(slots=True)
class RunResult:
    """The records of one run and what the generator itself cost."""

    records: list[Record]
    started: float
    wall_s: float
    cpu_user_s: float
    cpu_sys_s: float
    loop_lag_s: list[float]
    peak_inflight: int


class Driver:
    """Runs a ``Plan`` on the running event loop. ``on_record`` is called as each request ends."""

    def __init__(self, plan: Plan, on_record: Callable[[Record], None] | None = None) -> None:
        self.plan = plan
        self.on_record = on_record
        fast = plan.transport == "h1" and plan.base_url.startswith("http://")
        self.sender: _H1Sender | _ClientSender = _H1Sender(plan) if fast else _ClientSender(plan)
        self.bodies = [self._body(p) for p in plan.prompts]
        self.records: list[Record] = []
        self.inflight = 0
        self.peak_inflight = 0

    def _body(self, prompt: Prompt) -> tuple[bytes, int]:
        max_tokens = self.plan.max_tokens or prompt.max_tokens
        # ignore_eos (vLLM's): the answer is exactly max_tokens long, so output lengths follow the set.
        payload = {
            "model": self.plan.model, "messages": [{"role": "user", "content": prompt.text}],
            "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        return json.dumps(payload, separators=(",", ":")).encode(), max_tokens

    def _new_record(self, scheduled: float) -> tuple[Record, bytes]:
        index = len(self.records)
        body, max_tokens = self.bodies[index % len(self.bodies)]
        record = Record(index, scheduled, max_tokens, self.plan.transport)
        self.records.append(record)
        return record, body

    async def _one(self, record: Record, body: bytes) -> None:
        self.inflight += 1
        self.peak_inflight = max(self.peak_inflight, self.inflight)
        try:
            await self.sender.send(record, body)
        finally:
            self.inflight -= 1
        if self.on_record is not None:
            self.on_record(record)

    def _more(self, start: float, at: float) -> bool:
        plan = self.plan
        if plan.requests and len(self.records) >= plan.requests:
            return False
        return not (plan.duration_s and at - start >= plan.duration_s)

    async def _closed(self, start: float) -> None:
        async def worker() -> None:
            while self._more(start, time.perf_counter()):
                record, body = self._new_record(time.perf_counter())
                await self._one(record, body)

        await asyncio.gather(*(worker() for _ in range(self.plan.concurrency)))

    async def _open(self, start: float) -> None:
        plan = self.plan
        gate = asyncio.Semaphore(plan.max_inflight) if plan.max_inflight else None
        tasks: set[asyncio.Task[None]] = set()

        async def gated(record: Record, body: bytes) -> None:
            assert gate is not None
            async with gate:
                await self._one(record, body)

        for offset in arrival_offsets(plan.rate, plan.arrivals, plan.seed):
            due = start + offset
            if not self._more(start, due):
                break
            wait = due - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            record, body = self._new_record(due)
            task = asyncio.ensure_future(gated(record, body) if gate else self._one(record, body))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        while tasks:
            await asyncio.gather(*tasks)

    async def run(self) -> RunResult:
        """Send the whole plan; returns once every request has ended."""
        probe = _LagProbe()
        probe.start()
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        try:
            if self.plan.open_loop:
                await self._open(start)
            else:
                await self._closed(start)
        finally:
            probe.stop()
            await self.sender.close()
        wall = time.perf_counter() - start
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        return RunResult(
            self.records, start, wall, cpu1.ru_utime - cpu0.ru_utime, cpu1.ru_stime - cpu0.ru_stime,
            probe.samples, self.peak_inflight,
        )
