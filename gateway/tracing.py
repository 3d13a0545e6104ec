"""OpenTelemetry tracing: a server span per request, a client span per pod attempt, W3C trace context
taken from the caller and handed on to the pod.

Imported only when ``tracing.enabled`` (the relay imports it lazily), so with tracing off no
``opentelemetry`` module is loaded and the request path pays one ``is not None`` check. Spans leave
through the SDK's ``BatchSpanProcessor``: ending a span appends it to a deque, and a worker thread
does the OTLP/HTTP export, so a slow or absent collector costs the event loop nothing; its errors
are logged at most once a minute per logger.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gateway.config import ConfigError, TracingConfig

if TYPE_CHECKING:
    from gateway.exchange import Exchange, Scope
    from gateway.pods.registry import Pod
    from gateway.request_head import RequestHead

try:
    from opentelemetry.context import Context
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError as exc:  # the optional extra is not installed
    _MISSING: ImportError | None = exc
else:
    _MISSING = None

log = logging.getLogger("sluicegate.tracing")
Headers = list[tuple[bytes, bytes]]

DEFAULT_ENDPOINT = "http://127.0.0.1:4318/v1/traces"
FLUSH_ON_CLOSE_S = 2.0  # at shutdown, spans still queued get this long to reach the collector
# The SDK's loggers that speak of a failed export (each batch, each retry): rate-limited.
_EXPORT_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.common.http",
    "opentelemetry.sdk._shared_internal",
)
_TRACE_HEADERS = (b"traceparent", b"tracestate")
# OpenTelemetry GenAI operation names (gen_ai.operation.name) of the OpenAI routes.
_OPERATIONS = {
    "chat": "chat",
    "completions": "text_completion",
    "responses": "chat",
    "embeddings": "embeddings",
}
_CLEAN = frozenset(("ok", "resumed", "preflight"))


def endpoint_of(config: TracingConfig, env: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """The traces URL: the config's ``tracing.endpoint`` when set; else the standard environment
    variables (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` as is, ``OTEL_EXPORTER_OTLP_ENDPOINT`` plus
    ``/v1/traces``); else a collector on this host."""
    if config.endpoint is not None:
        return config.endpoint
    traces = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if traces:
        return traces
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    if base:
        return base.rstrip("/") + "/v1/traces"
    return DEFAULT_ENDPOINT


def start_tracing(config: TracingConfig) -> Tracing:
    """The tracer for ``tracing.enabled``; a ``ConfigError`` (exit 2) when the SDK is not installed."""
    if _MISSING is not None:
        raise ConfigError(
            f"tracing.enabled is true but the OpenTelemetry SDK is not installed ({_MISSING}); "
            "install it with: pip install 'sluicegate[tracing]' (or set tracing.enabled: false)"
        )
    return Tracing(config)


class Tracing:
    """The process's tracer provider, its OTLP/HTTP exporter and the W3C propagator."""

    def __init__(self, config: TracingConfig) -> None:
        self.endpoint = endpoint_of(config)
        provider = TracerProvider(
            resource=Resource.create({"service.name": config.service_name}),
            sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),  # a caller's decision stands
            shutdown_on_exit=False,  # close() flushes, bounded; the SDK's atexit hook could wait 30 s
        )
        exporter = OTLPSpanExporter(
            endpoint=self.endpoint, headers=dict(config.headers) or None, timeout=config.export_timeout_s
        )
        provider.add_span_processor(BatchSpanProcessor(exporter))
        self._provider = provider
        self._tracer = provider.get_tracer("sluicegate")
        self._propagator = TraceContextTextMapPropagator()
        quiet = _OncePerInterval(60.0)
        for name in _EXPORT_LOGGERS:
            logging.getLogger(name).addFilter(quiet)
        log.info("tracing: OTLP/HTTP spans to %s, sampling %g", self.endpoint, config.sample_ratio)

    def start(self, ex: Exchange, head: RequestHead, scope: Scope) -> RequestSpan:
        """The request's server span, a child of the caller's ``traceparent`` when it sent one."""
        parent = Context()
        if head.traceparent is not None:
            carrier = {"traceparent": head.traceparent.decode("latin-1")}
            if head.tracestate is not None:
                carrier["tracestate"] = head.tracestate.decode("latin-1")
            parent = self._propagator.extract(carrier, context=parent)  # malformed: a new trace
        started_ns = time.time_ns()
        span = self._tracer.start_span(
            f"{scope['method']} {scope['path']}",
            context=parent,
            kind=SpanKind.SERVER,
            start_time=started_ns,
            attributes={
                "http.request.method": scope["method"],
                "url.path": scope["path"],
                "network.protocol.name": "http",
                "sluicegate.transport": ex.transport,
                "sluicegate.request_id": ex.rid,
            },
        )
        return RequestSpan(self, span, started_ns)

    def inject(self, span: Span) -> Headers:
        """``traceparent`` (and ``tracestate``) headers that make ``span`` the receiver's parent."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=set_span_in_context(span, Context()))
        return [(name.encode(), value.encode("latin-1")) for name, value in carrier.items()]

    async def close(self, timeout_s: float = FLUSH_ON_CLOSE_S) -> None:
        """Flush what is queued and stop the export thread, waiting at most ``timeout_s``: the SDK's
        own shutdown can wait 30 s on a collector that does not answer."""
        loop = asyncio.get_running_loop()
        done = asyncio.Event()

        def shutdown() -> None:
            try:
                self._provider.shutdown()
            finally:
                with contextlib.suppress(RuntimeError):  # the loop closed first
                    loop.call_soon_threadsafe(done.set)

        threading.Thread(target=shutdown, name="otel-shutdown", daemon=True).start()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), timeout_s)


class RequestSpan:
    """One request's server span and its pod attempts' client spans (``Exchange.span``)."""

    __slots__ = ("_attempt", "_attempt_resumes", "_started_ns", "_tracing", "span")

    def __init__(self, tracing: Tracing, span: Span, started_ns: int) -> None:
        self._tracing = tracing
        self.span = span
        self._started_ns = started_ns
        self._attempt: Span | None = None
        self._attempt_resumes = False  # the open attempt continues a stream on another pod

    def attempt(self, ex: Exchange, pod: Pod, headers: Headers) -> Headers:
        """A client span for this connection to ``pod``, and ``headers`` with its trace context in
        place of the caller's: the pod's own spans become its children."""
        if self._attempt is not None:
            # A new attempt after a failed one (the attempt phase recorded its outcome), or a resume
            # after the stream broke on that pod.
            self._end_attempt(ex.attempts[-1] if ex.status == 0 and ex.attempts else "interrupted")
        resumes = ex.status != 0  # the answer is under way: this is a resume's continuation
        span = self._tracing._tracer.start_span(
            f"attempt {pod.name}",
            context=set_span_in_context(self.span, Context()),
            kind=SpanKind.CLIENT,
            attributes={
                "server.address": pod.host,
                "server.port": pod.port,
                "sluicegate.pod": pod.name,
                "sluicegate.resume": resumes,
            },
        )
        self._attempt = span
        self._attempt_resumes = resumes
        out = [header for header in headers if header[0] not in _TRACE_HEADERS]
        out.extend(self._tracing.inject(span))
        return out

    def _end_attempt(self, outcome: str) -> None:
        span = self._attempt
        assert span is not None
        span.set_attribute("sluicegate.outcome", outcome)
        if outcome not in _CLEAN and outcome != "client_gone":
            span.set_status(Status(StatusCode.ERROR, outcome))
        span.end()
        self._attempt = None

    def end(self, ex: Exchange) -> None:
        """The finish phase: what the request became, then the spans end (and queue for export)."""
        if self._attempt is not None:
            last = ex.attempts[-1] if ex.attempts and not self._attempt_resumes else ex.detail
            self._end_attempt(ex.detail if last == "ok" else last)
        span = self.span
        if not span.is_recording():  # sampled out: nothing to describe
            span.end()
            return
        req = ex.req
        operation = _OPERATIONS.get(ex.route, ex.route)
        model = ex.public_model or (req.model if req is not None else "")
        if model:
            span.update_name(f"{operation} {model}")  # GenAI convention: "{operation} {model}"
            span.set_attribute("gen_ai.request.model", model)
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "http.response.status_code": ex.status,
            "sluicegate.outcome": ex.detail,
            "sluicegate.attempts": len(ex.attempts),
            "sluicegate.resumes": ex.resumes,
            "sluicegate.stream": bool(req and req.stream),
        }
        if req is not None and ex.variant is not None and req.model != model:
            attributes["sluicegate.upstream_model"] = req.model  # the variant's own model name
        if ex.variant is not None:
            attributes["sluicegate.variant"] = ex.variant
        if ex.pod is not None:
            attributes["sluicegate.pod"] = ex.pod.name
        if ex.tier is not None:
            attributes["sluicegate.tier"] = ex.tier
        if ex.usage is not None:
            attributes["gen_ai.usage.input_tokens"] = ex.usage[0]
            attributes["gen_ai.usage.output_tokens"] = ex.usage[1]
        if ex.ttft is not None:
            attributes["sluicegate.time_to_first_token_s"] = ex.ttft
            span.add_event("gen_ai.first_token", timestamp=self._started_ns + int(ex.ttft * 1e9))
        if ex.status >= 500 or (ex.status < 400 and ex.detail not in _CLEAN):
            attributes["error.type"] = str(ex.status) if ex.status >= 500 else ex.detail
            span.set_status(Status(StatusCode.ERROR, ex.detail))
        span.set_attributes(attributes)
        span.end()


class _OncePerInterval(logging.Filter):
    """Lets one record per logger through each ``interval_s``; says how many it held back meanwhile.
    A collector that is down makes the SDK log every batch and every retry."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._interval_s = interval_s
        self._clock = clock
        self._next: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()  # the export thread and the loop both log

    def filter(self, record: logging.LogRecord) -> bool:
        now = self._clock()
        with self._lock:
            if now < self._next.get(record.name, 0.0):
                self._held[record.name] = self._held.get(record.name, 0) + 1
                return False
            self._next[record.name] = now + self._interval_s
            held = self._held.pop(record.name, 0)
        if held:
            record.msg = f"{record.msg} ({held} similar messages held back since the last)"
        return True
