"""One inference request's context, carried through the relay's phases.

Each phase (admit, pick, connect, first token, relay, finish) writes what it learned here; the
finish phase turns it into the request's metrics and access-log line.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from gateway.admit import InferenceRequest
from gateway.deadlines import Budget, timed_out
from gateway.errors import GatewayError
from gateway.metrics import GatewayMetrics
from gateway.pods.registry import Pod
from transports.pod_client import PodResponse

if TYPE_CHECKING:
    from gateway.disconnect_watch import DisconnectWatch

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class Exchange:
    """One request's context: what it asked, where it went, what happened (for logs and metrics)."""

    __slots__ = (
        "admission",
        "affinity",
        "alt_svc",
        "answer_headers",
        "attempts",
        "budget",
        "caller",
        "chunks",
        "client",
        "criticality",
        "cut",
        "deadline",
        "degraded",
        "detail",
        "first_token_at",
        "headers",
        "held",
        "model_label",
        "pod",
        "prompt_estimate",
        "public_model",
        "req",
        "resumes",
        "rid",
        "route",
        "selector",
        "send",
        "shadow",
        "span",
        "started",
        "status",
        "t0",
        "task",
        "tier",
        "tokens_relayed",
        "transport",
        "tried",
        "ttft",
        "usage",
        "usage_injected",
        "variant",
        "watch",
    )

    def __init__(
        self, route: str, rid: str, send: Send, transport: str = "h1", task: asyncio.Task[Any] | None = None
    ) -> None:
        task = task or asyncio.current_task()
        assert task is not None
        self.task = task  # the request's task: what its deadlines cancel (``transports.deadline``)
        self.route = route
        self.transport = transport
        self.alt_svc: bytes | None = None  # the Alt-Svc value to send, over TCP when HTTP/3 is offered
        self.rid = rid
        self.send = send
        self.started = time.perf_counter()
        self.t0 = task.get_loop().time()  # deadlines are on the loop's clock
        self.budget: Budget | None = None
        self.tier: str | None = None
        self.criticality = "standard"
        self.affinity: str | None = None  # the request's affinity key, when affinity is configured
        self.degraded: bool | None = None  # served without streaming: whether a usage chunk is wanted
        self.deadline = self.first_token_at = 0.0
        self.req: InferenceRequest | None = None
        self.model_label = "unknown"  # a metric label: only models some pod serves
        self.pod: Pod | None = None
        self.watch: DisconnectWatch | None = None
        self.status = 0  # 0 until the status line has been sent
        self.ttft: float | None = None
        self.chunks = 0
        self.detail = "ok"
        self.cut: GatewayError | None = None  # set when the gateway itself ends the request
        self.attempts: list[str] = []  # one outcome per pod tried
        self.tried: list[Pod] = []
        self.resumes = 0
        self.held: list[tuple[Pod, PodResponse]] = []  # continuation pods and their answers
        self.headers: list[tuple[bytes, bytes]] = []
        self.client = "-"  # the client's address (X-Forwarded-For only from a trusted proxy)
        self.caller: Any = None  # gateway.auth Caller: the key's id, tier, models and rights
        self.admission: Any = None  # gateway.quota Admission: what was reserved, settled at the end
        self.usage_injected = False  # usage asked of the pod for quotas: strip it from the answer
        self.usage: tuple[int, int] | None = None  # (prompt, completion) tokens the pods reported
        self.tokens_relayed = 0  # content events passed to the client (the charge when it leaves early)
        self.prompt_estimate = 0  # the prompt's tokens as admission estimated them
        self.answer_headers: list[tuple[bytes, bytes]] = []  # on every answer: CORS, x-ratelimit-*
        self.variant: str | None = None  # the canary route's variant (stable, canary, ...)
        self.public_model = ""  # the model the client named (a canary variant may rename it)
        self.selector: Any = None  # that variant's pods (a PodSelector), for every pick of the request
        self.shadow: asyncio.Task[None] | None = None  # the request's shadow copy (gateway.canary.shadow)
        self.span: Any = None  # gateway.tracing RequestSpan, only with tracing on

    def set_budget(self, budget: Budget) -> None:
        self.budget = budget
        self.deadline = self.t0 + budget.total_s
        self.first_token_at = self.t0 + budget.first_token_s

    def response_headers(self, content_type: bytes) -> list[tuple[bytes, bytes]]:
        assert self.pod is not None
        headers = [
            (b"content-type", content_type),
            (b"x-request-id", self.rid.encode()),
            (b"x-sluicegate-pod", self.pod.name.encode()),
        ]
        if self.variant is not None:  # a canary route's variant: load tests and clients break down by it
            headers.append((b"x-sluicegate-variant", self.variant.encode()))
        if self.alt_svc is not None:
            headers.append((b"alt-svc", self.alt_svc))
        if self.answer_headers:
            headers.extend(self.answer_headers)
        return headers

    def timeout(self, stage: str, metrics: GatewayMetrics) -> GatewayError:
        """The error for an expired stage; counted here when it ends a stream already under way."""
        assert self.budget is not None
        seconds = {
            "connect": self.budget.connect_s,
            "first_token": self.budget.first_token_s,
            "stall": self.budget.stall_s,
            "total": self.budget.total_s,
        }[stage]
        if self.status:  # mid-stream: no status code left to carry it, so count it now
            metrics.timeouts.labels(stage).inc()
            self.detail = f"timeout_{stage}"
        return timed_out(stage, seconds)

    def time_per_output_token(self, elapsed_s: float) -> float | None:
        """(duration - TTFT) / (output tokens - 1), OpenTelemetry's per-request inter-token latency;
        output tokens from the pods' usage, else the reads relayed (an approximation). None when
        the request had no first token or fewer than two tokens."""
        if self.ttft is None or elapsed_s <= self.ttft:
            return None
        tokens = self.usage[1] if self.usage is not None else self.chunks
        return (elapsed_s - self.ttft) / (tokens - 1) if tokens > 1 else None

    def count_tokens(self, metrics: GatewayMetrics, usage: Any) -> None:
        """Add the answer's usage object (when it has one) to the token counters."""
        if not isinstance(usage, dict):
            return
        for kind, field in _TOKEN_KINDS:
            value = usage.get(field)
            if type(value) is int and 0 < value < 1 << 53:  # a float counter: a pod's 10**400 would overflow
                metrics.child(metrics.tokens, self.model_label, kind).inc(value)


_TOKEN_KINDS = (("prompt", "prompt_tokens"), ("completion", "completion_tokens"))
_TRANSPORTS = {"1.1": "h1", "1.0": "h1", "2": "h2", "3": "h3"}


def transport_of(scope: Scope) -> str:
    """The client's transport, a metric label: a handler that translates another protocol (gRPC-Web)
    names itself in ``scope["sluicegate.transport"]``; otherwise the HTTP version."""
    named = scope.get("sluicegate.transport")
    if named is not None:
        return str(named)
    return _TRANSPORTS.get(scope.get("http_version", "1.1"), "h1")
