"""nginx as the benchmark's floor: what a C proxy costs to relay the same token streams.

The configuration is the one a careful operator would write for SSE: ``proxy_buffering off`` so
every upstream read is forwarded at once, HTTP/1.1 with pooled keep-alive connections upstream,
one worker (the proxy gets one core in the benchmark), no access log, and a listen backlog and
connection limits large enough for 2000 concurrent streams. Debian's ``nginx-light`` is enough.

For the HTTP/2 comparison (``loadtest/bench_h2.py``) it also listens with ``http2``: cleartext h2c
with prior knowledge on ``h2c_port`` and HTTP/2 over TLS (ALPN) on ``tls_port``; upstream is the
same pooled HTTP/1.1.
"""

from __future__ import annotations

import os
import resource
import shutil
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Self
from urllib.parse import urlsplit

from loadtest.procs import terminate

# Idle upstream connections nginx keeps (``keepalive``): above the largest load's streams, so the
# warm-up's connections are all reused. ``bench.gateway_config`` gives the gateway the same pool.
UPSTREAM_KEEPALIVE = 4096

CONFIG_TEMPLATE = """\
daemon off;
master_process on;
worker_processes {workers};
worker_rlimit_nofile {nofile};
pid {workdir}/nginx.pid;
error_log {workdir}/error.log warn;

events {{
    worker_connections {connections};
    multi_accept on;
}}

http {{
    access_log off;
    client_body_temp_path {workdir}/body;
    proxy_temp_path {workdir}/proxy;
    keepalive_requests 1000000;
    keepalive_timeout 75s;

    upstream pod {{
        server {upstream};
        keepalive {keepalive};
        keepalive_requests 1000000;
        keepalive_timeout 75s;
    }}

    server {{
        listen {listen} backlog={backlog};
{h2_listens}        location / {{
            proxy_pass http://pod;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 600s;
            proxy_send_timeout 600s;
        }}
    }}
}}
"""


def nginx_binary() -> str | None:
    """Path of the nginx executable, or None when it is not installed."""
    found = shutil.which("nginx")
    if found:
        return found
    for candidate in ("/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/local/nginx/sbin/nginx"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel considers free right now (nginx cannot listen on port 0 and report it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _nofile_limit(wanted: int) -> int:
    """``wanted``, but no more than the hard limit: without CAP_SYS_RESOURCE nginx cannot exceed it."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)


def render_config(
    workdir: Path,
    listen: str,
    upstream: str,
    *,
    workers: int = 1,
    connections: int = 16384,
    keepalive: int = UPSTREAM_KEEPALIVE,
    backlog: int = 4096,
    h2c_listen: str | None = None,
    tls_listen: str | None = None,
    tls_files: tuple[Path, Path] | None = None,
) -> str:
    """nginx.conf text proxying ``listen`` (host:port) to ``upstream`` (host:port) without buffering;
    with ``h2c_listen`` and ``tls_listen`` (and ``tls_files``: certificate, key) also over HTTP/2."""
    h2_listens = ""
    if h2c_listen is not None:
        h2_listens += f"        listen {h2c_listen} http2 backlog={backlog};\n"
    if tls_listen is not None:
        if tls_files is None:
            raise ValueError("a TLS listener needs a certificate and key")
        h2_listens += (
            f"        listen {tls_listen} ssl http2 backlog={backlog};\n"
            f"        ssl_certificate {tls_files[0]};\n        ssl_certificate_key {tls_files[1]};\n"
        )
    return CONFIG_TEMPLATE.format(
        h2_listens=h2_listens,
        workdir=workdir,
        listen=listen,
        upstream=upstream,
        workers=workers,
        connections=connections,
        nofile=_nofile_limit(connections * 2 + 64),
        keepalive=keepalive,
        backlog=backlog,
    )


class NginxRun:
    """One nginx in the foreground (``daemon off``) in its own scratch directory, on ``host:port``;
    what it serves is the subclass's ``config()``.

    ``command_prefix`` is prepended to the command line, e.g. ``["taskset", "-c", "1"]``; the
    workers inherit the master's CPU affinity."""

    def __init__(
        self, workdir: Path, *, host: str = "127.0.0.1", port: int | None = None,
        command_prefix: list[str] | None = None, binary: str | None = None,
    ) -> None:
        found = binary or nginx_binary()
        if found is None:
            raise FileNotFoundError("nginx is not installed (Debian: apt-get install nginx-light)")
        self.binary = found
        self.workdir = workdir
        self.host = host
        self.port = port or free_port(host)
        self.prefix = list(command_prefix or [])
        self.proc: subprocess.Popen[bytes] | None = None

    def config(self) -> str:
        raise NotImplementedError

    @property
    def url(self) -> str:
        """Base URL clients use."""
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        """The master's pid (the workers are its children)."""
        if self.proc is None:
            raise RuntimeError("nginx is not running")
        return self.proc.pid

    def start(self, timeout_s: float = 10.0) -> Self:
        """Write the config, start nginx and wait until it accepts connections."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        for sub in ("body", "proxy"):
            (self.workdir / sub).mkdir(exist_ok=True)
        conf = self.workdir / "nginx.conf"
        conf.write_text(self.config())
        cmd = [*self.prefix, self.binary, "-p", str(self.workdir), "-c", str(conf), "-e",
               str(self.workdir / "error.log")]
        log = open(self.workdir / "stderr.log", "wb")  # noqa: SIM115 - handed to the child
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        finally:
            log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited with {self.proc.returncode}: {self.error_log()}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"nginx did not listen on {self.url} within {timeout_s} s: {self.error_log()}")

    def error_log(self) -> str:
        """nginx's own complaints, for error messages that say why it did not start."""
        texts = []
        for name in ("stderr.log", "error.log"):
            path = self.workdir / name
            if path.exists():
                texts.append(path.read_text(errors="replace").strip())
        return " | ".join(t for t in texts if t)[-2000:]

    def stop(self, timeout_s: float = 10.0) -> None:
        """Fast shutdown (SIGTERM), then SIGKILL if it lingers."""
        proc, self.proc = self.proc, None
        if proc is not None:
            terminate(proc, timeout_s)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class NginxProcess(NginxRun):
    """nginx proxying to ``upstream_url`` (see the module doc). ``http2``: also listen for h2c
    (``h2c_port``) and, with ``tls_files`` (certificate, key), for HTTP/2 over TLS (``tls_port``),
    each on a free port.
    """

    def __init__(
        self,
        upstream_url: str,
        workdir: Path,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        workers: int = 1,
        command_prefix: list[str] | None = None,
        binary: str | None = None,
        http2: bool = False,
        tls_files: tuple[Path, Path] | None = None,
    ) -> None:
        parts = urlsplit(upstream_url)
        if not parts.hostname or not parts.port:
            raise ValueError(f"upstream must be http://HOST:PORT, not {upstream_url!r}")
        super().__init__(workdir, host=host, port=port, command_prefix=command_prefix, binary=binary)
        self.upstream = f"{parts.hostname}:{parts.port}"
        self.workers = workers
        self.h2c_port = free_port(host) if http2 else None
        self.tls_port = free_port(host) if http2 and tls_files is not None else None
        self.tls_files = tls_files

    def config(self) -> str:
        h2c = f"{self.host}:{self.h2c_port}" if self.h2c_port else None
        tls = f"{self.host}:{self.tls_port}" if self.tls_port else None
        return render_config(
            self.workdir, f"{self.host}:{self.port}", self.upstream, workers=self.workers,
            h2c_listen=h2c, tls_listen=tls, tls_files=self.tls_files,
        )
