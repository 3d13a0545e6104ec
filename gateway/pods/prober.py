"""Probes of a pod (``GET /health``, discovery's ``GET /v1/models``) timed on threads of their own,
not on the gateway's event loop.

Why: a probe awaited on the event loop is timed by the loop. At hundreds of concurrent streams the
loop is busy relaying tokens, and a probe whose answer sits in the socket buffer is not read until
the loop gets to it: the gateway then blames the pod for its own lag (measured in
``docs/benchmarks.md``). A blocking probe on a small thread pool sees the pod's real answer time:
the thread needs the interpreter lock only for a few microseconds between syscalls, and waits in
the kernel otherwise.

A probe's outcome says what kind of evidence it is: the pod *answered* (200 or not) or *refused*
the connection (``hard``: believed), or the probe *timed out* (soft: an overloaded pod is slow,
not broken).
"""

from __future__ import annotations

import http.client
import ssl
import time
from dataclasses import dataclass
from functools import lru_cache

from transports.tls import tls_reason

_HEADERS = {"user-agent": "sluicegate-probe", "connection": "close"}
_UNANSWERED_TLS = (
    "TLS: the pod closed the connection without answering "
    "(did it want a client certificate, or refuse ours? see upstream.tls.client_cert)"
)


@dataclass(frozen=True, slots=True)
class ProbeResult:
    ok: bool
    hard: bool  # the pod answered or refused; False for a timeout
    detail: str
    seconds: float
    body: bytes = b""

    @property
    def outcome(self) -> str:
        """A metric label: ok, failed (answered or refused) or timeout."""
        return "ok" if self.ok else "failed" if self.hard else "timeout"


@lru_cache(maxsize=1)
def _tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()


class _Https(http.client.HTTPConnection):
    """HTTPS with the name to verify given apart from the host to connect to (``server_name``):
    ``http.client.HTTPSConnection`` always checks the host it dialled."""

    def __init__(
        self, host: str, port: int, timeout: float, context: ssl.SSLContext, server_name: str | None
    ) -> None:
        super().__init__(host, port, timeout=timeout)
        self._context = context
        self._server_name = server_name or host

    def connect(self) -> None:
        super().connect()
        self.sock = self._context.wrap_socket(self.sock, server_hostname=self._server_name)


def probe_health(
    host: str, port: int, tls: ssl.SSLContext | bool | None, timeout_s: float, server_name: str | None = None
) -> ProbeResult:
    """One ``GET /health`` within ``timeout_s`` in all (blocking: run it on a thread). No
    credentials: vLLM's ``--api-key`` leaves ``/health`` open."""
    return probe_get(host, port, tls, "/health", timeout_s, server_name=server_name)


def probe_get(
    host: str,
    port: int,
    tls: ssl.SSLContext | bool | None,
    path: str,
    timeout_s: float,
    max_body: int = 4096,
    server_name: str | None = None,
    authorization: bytes | None = None,
) -> ProbeResult:
    """One ``GET path`` within ``timeout_s`` in all, keeping up to ``max_body`` bytes of the answer
    (blocking: run it on a thread). A longer body is a hard failure: the pod answered nonsense.

    ``tls``: the client context for an https:// pod (True: the system's trust store), whose
    certificate must name ``server_name`` (default: ``host``); ``authorization``: the header value
    to send, for paths a pod's API key guards."""
    started = time.perf_counter()
    deadline = started + timeout_s
    conn: http.client.HTTPConnection
    if tls:
        context = _tls_context() if tls is True else tls
        conn = _Https(host, port, timeout_s, context, server_name)  # type: ignore[arg-type]
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    headers = _HEADERS if authorization is None else {**_HEADERS, "authorization": authorization.decode()}
    try:
        conn.connect()
        assert conn.sock is not None
        conn.sock.settimeout(max(0.001, deadline - time.perf_counter()))
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        body = resp.read(max_body + 1)
        elapsed = time.perf_counter() - started
        if len(body) > max_body:
            return ProbeResult(False, True, f"answer larger than {max_body} bytes", elapsed)
        return ProbeResult(resp.status == 200, True, f"HTTP {resp.status}", elapsed, body)
    except TimeoutError:
        return ProbeResult(False, False, f"timed out after {timeout_s:g} s", time.perf_counter() - started)
    except ssl.SSLError as exc:
        return ProbeResult(False, True, f"TLS: {tls_reason(exc)}", time.perf_counter() - started)
    except http.client.RemoteDisconnected as exc:
        if not tls:
            return ProbeResult(False, True, str(exc), time.perf_counter() - started)
        # A pod that wants a client certificate checks it after TLS 1.3's handshake completed on
        # our side; uvicorn or aiohttp then close without the alert: all we see is the close.
        return ProbeResult(False, True, _UNANSWERED_TLS, time.perf_counter() - started)
    except (OSError, http.client.HTTPException) as exc:
        detail = str(exc) or type(exc).__name__
        return ProbeResult(False, True, detail, time.perf_counter() - started)
    finally:
        conn.close()
