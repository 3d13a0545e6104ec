"""OpenTelemetry tracing, end to end: a real gateway process exports its spans over OTLP/HTTP to a
receiver in this module, which decodes them with opentelemetry-proto (the wire format a collector
reads); a pod here records each request head, so the trace context it was handed can be checked.

Also: with tracing off nothing of OpenTelemetry is imported and the caller's ``traceparent`` reaches
the pod untouched; enabled without the SDK is one line and exit 2; a collector that is down or hangs
never fails or slows a request.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanProto
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from loadtest.procs import GatewayProcess
from tests.conftest import unused_port

ROOT = Path(__file__).resolve().parents[1]
MODEL = "llama-trace"
DEADLINE_S = 30.0  # generous: the machine is shared; every wait ends at its event


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind is not None else None


@dataclass
class ExportedSpan:
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    status: int
    events: list[str]
    resource: dict[str, Any]


class Collector:
    """An OTLP/HTTP traces receiver: ``POST /v1/traces`` with a protobuf ExportTraceServiceRequest."""

    def __init__(self) -> None:
        self.spans: list[ExportedSpan] = []
        self.changed = threading.Condition()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                ok = self.path == "/v1/traces" and self.headers["content-type"] == "application/x-protobuf"
                if ok:
                    collector.receive(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if ok else 400)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *_args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def receive(self, request: ExportTraceServiceRequest) -> None:
        found = []
        for resource_spans in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    found.append(ExportedSpan(
                        name=span.name,
                        kind=span.kind,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_id=span.parent_span_id.hex(),
                        attributes={kv.key: _value(kv.value) for kv in span.attributes},
                        status=span.status.code,
                        events=[event.name for event in span.events],
                        resource=resource,
                    ))
        with self.changed:
            self.spans.extend(found)
            self.changed.notify_all()

    def wait_for(self, match: Callable[[ExportedSpan], bool], count: int = 1) -> list[ExportedSpan]:
        """The first ``count`` exported spans that ``match``, as soon as they have arrived."""
        with self.changed:
            arrived = self.changed.wait_for(lambda: sum(map(match, self.spans)) >= count, DEADLINE_S)
            assert arrived, f"no such span in {DEADLINE_S} s; got: {[s.name for s in self.spans]}"
            return [span for span in self.spans if match(span)][:count]

    def request_spans(self, rid: str) -> tuple[ExportedSpan, list[ExportedSpan]]:
        """The server span of request ``rid`` and its attempt spans (all exported by then: they end first)."""
        server = self.wait_for(lambda s: s.attributes.get("sluicegate.request_id") == rid)[0]
        with self.changed:
            attempts = [s for s in self.spans if s.parent_id == server.span_id]
        return server, attempts

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class RecordingPod:
    """An OpenAI-compatible pod that answers every chat request at once and records its head;
    ``failing``: with vLLM's 503 (overloaded) instead."""

    def __init__(self, model: str = MODEL, failing: bool = False) -> None:
        self.heads: list[dict[str, str]] = []
        self.changed = threading.Condition()
        pod = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # discovery's /v1/models and the /health probe
                self._answer(200, {"object": "list", "data": [{"id": model, "object": "model"}]})

            def do_POST(self) -> None:
                request = json.loads(self.rfile.read(int(self.headers.get("content-length", "0"))))
                with pod.changed:
                    pod.heads.append({name.lower(): value for name, value in self.headers.items()})
                    pod.changed.notify_all()
                if failing:
                    error = {"message": "overloaded", "type": "service_unavailable", "code": 503}
                    self._answer(503, {"error": error})
                    return
                if request.get("stream"):
                    self._stream()
                    return
                self._answer(200, {
                    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": MODEL,
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": "hello"}}],
                    "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9},
                })

            def _stream(self) -> None:
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.end_headers()  # HTTP/1.0: the stream ends when the connection closes
                base = {"id": "chatcmpl-2", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
                for text in ("hel", "lo"):
                    delta = {"index": 0, "delta": {"content": text}, "finish_reason": None}
                    self.wfile.write(b"data: " + json.dumps({**base, "choices": [delta]}).encode() + b"\n\n")
                last = {"index": 0, "delta": {}, "finish_reason": "stop"}
                usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
                self.wfile.write(b"data: " + json.dumps({**base, "choices": [last], "usage": usage}).encode())
                self.wfile.write(b"\n\ndata: [DONE]\n\n")

            def _answer(self, status: int, payload: dict[str, Any]) -> None:
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def head_of(self, rid: str) -> dict[str, str]:
        with self.changed:
            assert self.changed.wait_for(
                lambda: any(h.get("x-request-id") == rid for h in self.heads), DEADLINE_S
            ), f"the pod never saw request {rid}"
            return next(h for h in self.heads if h.get("x-request-id") == rid)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def config_for(pod_url: str, tracing: dict[str, Any] | None, failing: str | None = None) -> dict[str, Any]:
    """``pod_url`` serves MODEL; ``failing`` (a refused port by default) serves "ghost"."""
    config: dict[str, Any] = {
        "server": {"host": "127.0.0.1"},
        "discovery": {"refresh_interval_s": 30, "retry_interval_s": 30},
        "health": {"probe": {"interval_s": 600}, "outlier": {"consecutive_failures": 1000}},
        "retries": {"backoff_base_s": 0.001},
        "pods": [
            {"name": "pod-rec", "url": pod_url, "models": [MODEL]},
            {"name": "pod-failing", "url": failing or f"http://127.0.0.1:{unused_port()}",
             "models": ["ghost"]},
        ],
    }
    if tracing is not None:
        config["tracing"] = tracing
    return config


@dataclass
class Traced:
    collector: Collector
    pod: RecordingPod
    gateway: GatewayProcess


@pytest.fixture(scope="module")
def pod() -> Iterator[RecordingPod]:
    pod = RecordingPod()
    yield pod
    pod.close()


@pytest.fixture(scope="module")
def traced(pod: RecordingPod) -> Iterator[Traced]:
    collector = Collector()
    failing = RecordingPod("ghost", failing=True)
    tracing = {"enabled": True, "endpoint": collector.url, "service_name": "sluicegate-test"}
    # The batch processor's delay (default 5 s) via the SDK's own variable: spans arrive in a blink.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        gateway = GatewayProcess(config_for(pod.url, tracing, failing.url)).start()
    try:
        yield Traced(collector, pod, gateway)
    finally:
        gateway.stop()
        collector.close()
        failing.close()


def chat(url: str, rid: str, model: str = MODEL, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-request-id": rid, **(headers or {})},
        timeout=DEADLINE_S,
    )


def _traceparent(value: str) -> tuple[str, str, str]:
    version, trace_id, parent_id, flags = value.split("-")
    assert version == "00" and len(trace_id) == 32 and len(parent_id) == 16
    return trace_id, parent_id, flags


def test_a_request_exports_a_server_span_with_what_it_became(traced: Traced) -> None:
    answer = chat(traced.gateway.url, "rid-span-a")
    assert answer.status_code == 200
    server, attempts = traced.collector.request_spans("rid-span-a")
    assert server.name == f"chat {MODEL}"  # GenAI: "{gen_ai.operation.name} {gen_ai.request.model}"
    assert server.kind == SpanProto.SPAN_KIND_SERVER
    assert server.parent_id == ""  # the caller sent no trace context: a new trace
    assert server.resource["service.name"] == "sluicegate-test"
    attributes = server.attributes
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == MODEL
    assert attributes["http.response.status_code"] == 200
    assert attributes["sluicegate.outcome"] == "ok"
    assert attributes["sluicegate.pod"] == "pod-rec"
    assert attributes["sluicegate.attempts"] == 1
    assert (attributes["gen_ai.usage.input_tokens"], attributes["gen_ai.usage.output_tokens"]) == (7, 2)
    assert server.status != Status.STATUS_CODE_ERROR
    (attempt,) = attempts
    assert attempt.kind == SpanProto.SPAN_KIND_CLIENT
    assert attempt.attributes["sluicegate.pod"] == "pod-rec"
    assert attempt.attributes["sluicegate.outcome"] == "ok"


def test_a_stream_records_its_time_to_first_token(traced: Traced) -> None:
    with httpx.stream(
        "POST", f"{traced.gateway.url}/v1/chat/completions", timeout=DEADLINE_S,
        json={"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-request-id": "rid-span-stream"},
    ) as answer:
        assert answer.status_code == 200
        body = answer.read()
    assert b"[DONE]" in body
    server, _attempts = traced.collector.request_spans("rid-span-stream")
    assert server.attributes["sluicegate.stream"] is True
    assert server.attributes["sluicegate.outcome"] == "ok"
    assert 0 < server.attributes["sluicegate.time_to_first_token_s"] < DEADLINE_S
    assert "gen_ai.first_token" in server.events


def test_the_callers_trace_context_is_the_parent_and_the_pod_gets_the_gateways(traced: Traced) -> None:
    caller_trace, caller_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    answer = chat(traced.gateway.url, "rid-span-b", headers={
        "traceparent": f"00-{caller_trace}-{caller_span}-01", "tracestate": "vendor=opaque",
    })
    assert answer.status_code == 200
    server, attempts = traced.collector.request_spans("rid-span-b")
    assert (server.trace_id, server.parent_id) == (caller_trace, caller_span)
    (attempt,) = attempts
    assert attempt.trace_id == caller_trace
    # The pod's parent is the gateway's attempt span (a child of its server span), not the caller's.
    trace_id, parent_id, flags = _traceparent(traced.pod.head_of("rid-span-b")["traceparent"])
    assert (trace_id, parent_id, flags) == (caller_trace, attempt.span_id, "01")
    assert parent_id != caller_span
    assert traced.pod.head_of("rid-span-b")["tracestate"] == "vendor=opaque"  # the caller's vendors' state


def test_a_request_without_trace_context_hands_the_pod_the_gateways_trace(traced: Traced) -> None:
    assert chat(traced.gateway.url, "rid-span-c").status_code == 200
    server, (attempt,) = traced.collector.request_spans("rid-span-c")
    trace_id, parent_id, _flags = _traceparent(traced.pod.head_of("rid-span-c")["traceparent"])
    assert (trace_id, parent_id) == (server.trace_id, attempt.span_id)


def test_a_failed_request_ends_its_span_in_error(traced: Traced) -> None:
    answer = chat(traced.gateway.url, "rid-span-d", model="ghost")  # its only pod answers 503
    assert answer.status_code in (502, 503)
    assert "error" in answer.json()
    server, attempts = traced.collector.request_spans("rid-span-d")
    assert server.status == Status.STATUS_CODE_ERROR
    assert server.attributes["http.response.status_code"] == answer.status_code
    assert server.attributes["error.type"] == str(answer.status_code)
    assert server.attributes["sluicegate.outcome"] != "ok"
    assert attempts, "the attempt on the dead pod has its span"
    assert all(span.status == Status.STATUS_CODE_ERROR for span in attempts)
    assert {span.attributes["sluicegate.pod"] for span in attempts} == {"pod-failing"}
    assert attempts[0].attributes["sluicegate.outcome"] == "status_503"


def test_an_unsampled_callers_trace_is_not_recorded_but_still_handed_on(traced: Traced) -> None:
    caller_trace = "0af7651916cd43dd8448eb211c80319c"
    unsampled = f"00-{caller_trace}-b7ad6b7169203331-00"
    answer = chat(traced.gateway.url, "rid-span-e", headers={"traceparent": unsampled})
    assert answer.status_code == 200
    trace_id, _parent, flags = _traceparent(traced.pod.head_of("rid-span-e")["traceparent"])
    assert (trace_id, flags) == (caller_trace, "00")  # parent-based sampling: the caller's "no" stands
    # Spans of later requests arrive while this one's never does.
    assert chat(traced.gateway.url, "rid-span-e2").status_code == 200
    traced.collector.request_spans("rid-span-e2")
    assert not [s for s in traced.collector.spans if s.trace_id == caller_trace]


PROBE_IMPORTS = textwrap.dedent(
    """
    import sys
    import gateway.app, gateway.cli, gateway.relay, gateway.server
    from gateway.app import Gateway
    from gateway.config_load import parse_config
    Gateway(parse_config({"pods": [{"name": "p", "url": "http://127.0.0.1:1", "models": ["m"]}],
                          "auth": {"enabled": False}}))
    tracing = ("gateway.tracing", "opentelemetry.sdk.trace", "opentelemetry.exporter",
               "opentelemetry.trace.propagation.tracecontext")
    print(sorted(m for m in sys.modules if m.startswith(tracing)))
    """
)


def test_tracing_off_imports_nothing_of_opentelemetry_tracing() -> None:
    # Not "no opentelemetry module at all": redis-py 8 imports opentelemetry.sdk.metrics by itself
    # whenever the SDK is installed (its own optional metrics), whatever the gateway does.
    probe = subprocess.run(
        [sys.executable, "-c", PROBE_IMPORTS], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "[]"


def test_tracing_off_hands_the_callers_traceparent_to_the_pod_untouched(pod: RecordingPod) -> None:
    sent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    with GatewayProcess(config_for(pod.url, None)) as gateway:
        answer = chat(gateway.url, "rid-off", headers={"traceparent": sent, "tracestate": "vendor=x"})
    assert answer.status_code == 200
    head = pod.head_of("rid-off")
    assert (head["traceparent"], head["tracestate"]) == (sent, "vendor=x")


def test_enabled_without_the_sdk_is_one_line_and_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    config = config_for("http://127.0.0.1:1", {"enabled": True})
    path.write_text(yaml.safe_dump({**config, "auth": {"enabled": False}, "admin": {"port": 0}}))
    blocked = (  # as if the extra were not installed: importing opentelemetry fails
        "import sys; sys.modules['opentelemetry'] = None\n"
        "from gateway.cli import main\n"
        f"sys.exit(main(['serve', '--config', {str(path)!r}, '--port', '0']))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", blocked], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    assert "pip install 'sluicegate[tracing]'" in run.stderr
    assert "tracing.enabled" in run.stderr


def _blackhole() -> socket.socket:
    """A listener that never accepts: a client's connect succeeds (the kernel's queue) and its
    request is never answered — the worst a collector can do."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


@pytest.mark.parametrize("collector", ["refusing", "hanging"])
def test_a_collector_down_never_fails_or_slows_a_request(pod: RecordingPod, collector: str) -> None:
    hole = _blackhole()
    port = hole.getsockname()[1] if collector == "hanging" else unused_port()
    tracing = {"enabled": True, "endpoint": f"http://127.0.0.1:{port}/v1/traces", "export_timeout_s": 20}
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
            gateway = GatewayProcess(config_for(pod.url, tracing)).start()
        try:
            assert chat(gateway.url, f"rid-down-{collector}-0").status_code == 200
            if collector == "hanging":
                # The exporter has connected and now waits on an answer that never comes (up to 20 s).
                hole.settimeout(DEADLINE_S)
                hole.accept()[0].close()
            slowest = 0.0
            for n in range(1, 40):
                started = time.perf_counter()
                answer = chat(gateway.url, f"rid-down-{collector}-{n}")
                slowest = max(slowest, time.perf_counter() - started)
                assert answer.status_code == 200
            # An export on the event loop would hold a request for the export's 20 s timeout.
            assert slowest < 5.0, f"a request took {slowest:.2f} s while the collector was down"
            answered = chat(gateway.url, f"rid-down-{collector}-last")
            assert answered.status_code == 200
            stopped = time.perf_counter()
            assert gateway.stop(timeout_s=15) == 0  # shutdown waits on the export a bounded time
            assert time.perf_counter() - stopped < 12
            log = gateway.log()
            export_lines = [line for line in log.splitlines() if "opentelemetry" in line]
            assert len(export_lines) <= 4, "\n".join(export_lines)  # rate-limited, one per logger a minute
            if collector == "refusing":  # (a hanging export has not timed out yet)
                assert export_lines, "the failed export is logged"
        finally:
            gateway.stop()
    finally:
        hole.close()


def test_the_endpoint_comes_from_config_then_the_standard_variables() -> None:
    from gateway.config import TracingConfig
    from gateway.tracing import DEFAULT_ENDPOINT, endpoint_of

    unset = TracingConfig()
    assert endpoint_of(unset, {}) == DEFAULT_ENDPOINT
    assert endpoint_of(unset, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}) == "http://c:4318/v1/traces"
    both = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t/x"}
    assert endpoint_of(unset, both) == "http://t/x"
    assert endpoint_of(TracingConfig(endpoint="http://mine:4318/v1/traces"), both) == "http://mine:4318/v1/traces"


def test_export_complaints_are_rate_limited() -> None:
    from gateway.tracing import _OncePerInterval

    records = []
    logger = logging.getLogger("test_tracing.export")
    logger.propagate = False
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    now = [100.0]
    logger.addFilter(_OncePerInterval(60.0, clock=lambda: now[0]))
    for n in range(50):
        logger.warning("export failed %d", n)
    now[0] += 59.0
    logger.warning("still failing")
    assert [r.getMessage() for r in records] == ["export failed 0"]
    now[0] += 1.0
    logger.warning("export failed again")
    assert records[1].getMessage() == "export failed again (50 similar messages held back since the last)"
