"""nginx as a pod that costs next to nothing: the same canned vLLM stream for every request.

For measuring the gateway where it, and not its neighbours, is what runs out of CPU
(``loadtest/bench_workers.py``): on this 2-core machine the pod simulator and a Python load
generator cost more per token than the gateway does, so a second gateway worker has no core to take.
nginx answers every ``POST /v1/chat/completions`` with one pre-rendered answer (a file) in vLLM's wire format
(``loadtest/podsim/wire.py``: a role chunk, ``tokens`` content chunks, the last with
``finish_reason``, the usage chunk, ``[DONE]``), whatever the request asked; ``/health``,
``/v1/models`` and ``/metrics`` (an idle pod) are what the gateway's probes and scrapes read.
"""

from __future__ import annotations

import os
import pwd
from pathlib import Path

from loadtest.nginx import NginxRun
from loadtest.podsim import wire

CREATED = 1761566772

CONFIG_TEMPLATE = """\
daemon off;
master_process on;
{user}worker_processes {workers};
pid {workdir}/nginx.pid;
error_log {workdir}/error.log warn;

events {{
    worker_connections 16384;
    multi_accept on;
}}

http {{
    access_log off;
    client_body_temp_path {workdir}/body;
    client_body_buffer_size 64k;
    keepalive_requests 1000000;
    keepalive_timeout 75s;

    server {{
        listen {listen} backlog=4096;
        location = /health {{ return 200; }}
        location = /v1/models {{ default_type application/json; return 200 {models}; }}
        location = /metrics {{ default_type "text/plain; version=0.0.4"; return 200 {metrics}; }}
        # POST answered from a file (a return text is at most 4 KB): the refusal of the method
        # becomes an internal GET of the answer, with status 200
        location = /v1/chat/completions {{ error_page 405 =200 /answer.sse; return 405; }}
        location = /answer.sse {{ internal; root {workdir}; types {{ }} default_type text/event-stream; }}
    }}
}}
"""


def canned_answer(model: str, tokens: int) -> bytes:
    """A whole streamed chat answer of ``tokens`` tokens, as vLLM sends it with usage asked for."""
    form = wire.StreamFormat(chat=True, request_id="chatcmpl-nginxpod", created=CREATED, model=model)
    words = [b" tok%d" % (i % 100) for i in range(tokens)]
    events = [form.first, *(form.token(w) for w in words[:-1]), form.final(words[-1], "length")]
    events.append(form.usage(8, tokens))
    events.append(b"data: [DONE]\n\n")
    return b"".join(events)


def idle_metrics(model: str) -> bytes:
    """vLLM's load gauges (``/metrics``) of a pod with nothing running, waiting or cached."""
    labels = f'{{engine="0",model_name="{model}"}}'
    lines = []
    for name, kind in (
        ("vllm:num_requests_running", "gauge"), ("vllm:num_requests_waiting", "gauge"),
        ("vllm:kv_cache_usage_perc", "gauge"),
    ):
        lines += [f"# TYPE {name} {kind}", f"{name}{labels} 0.0"]
    return ("\n".join(lines) + "\n").encode()


def _quoted(body: bytes) -> str:
    """``body`` as an nginx single-quoted string; ``$`` (a variable there) is refused, not escaped."""
    text = body.decode()
    if "$" in text:
        raise ValueError("an nginx return text cannot hold '$'")
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _same_user() -> str:
    """Under root, nginx's worker would read the answer as ``nobody``, who cannot enter a private
    scratch directory: it stays the user who started it."""
    if os.geteuid() != 0:
        return ""
    return f"user {pwd.getpwuid(os.geteuid()).pw_name};\n"


class NginxPod(NginxRun):
    """nginx in ``workdir`` serving the canned answer of ``tokens`` tokens on a free port (``url``)."""

    def __init__(
        self, workdir: Path, model: str, tokens: int, *, host: str = "127.0.0.1",
        command_prefix: list[str] | None = None, workers: int = 1,
    ) -> None:
        super().__init__(workdir, host=host, command_prefix=command_prefix)
        self.model = model
        self.tokens = tokens
        self.workers = workers  # nginx worker processes: more than one where the gateway has many cores

    def start(self, timeout_s: float = 10.0) -> NginxPod:
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "answer.sse").write_bytes(canned_answer(self.model, self.tokens))
        return super().start(timeout_s)

    def config(self) -> str:
        models = wire.model_list([self.model], CREATED, 8192, {self.model: "modelperm-nginxpod"})
        return CONFIG_TEMPLATE.format(
            user=_same_user(), workers=self.workers, workdir=self.workdir, listen=f"{self.host}:{self.port}",
            models=_quoted(models), metrics=_quoted(idle_metrics(self.model)),
        )
