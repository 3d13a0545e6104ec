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

_HEADERS = {"user-agent": "sluicegate-probe", "connection": "close"}


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


def probe_health(host: str, port: int, tls: bool, timeout_s: float) -> ProbeResult:
    """One ``GET /health`` within ``timeout_s`` in all (blocking: run it on a thread)."""
    return probe_get(host, port, tls, "/health", timeout_s)


def probe_get(
    host: str, port: int, tls: bool, path: str, timeout_s: float, max_body: int = 4096
) -> ProbeResult:
    """One ``GET path`` within ``timeout_s`` in all, keeping up to ``max_body`` bytes of the answer
    (blocking: run it on a thread). A longer body is a hard failure: the pod answered nonsense."""
    started = time.perf_counter()
    deadline = started + timeout_s
    conn: http.client.HTTPConnection
    if tls:
        conn = http.client.HTTPSConnection(host, port, timeout=timeout_s, context=_tls_context())
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.connect()
        assert conn.sock is not None
        conn.sock.settimeout(max(0.001, deadline - time.perf_counter()))
        conn.request("GET", path, headers=_HEADERS)
        resp = conn.getresponse()
        body = resp.read(max_body + 1)
        elapsed = time.perf_counter() - started
        if len(body) > max_body:
            return ProbeResult(False, True, f"answer larger than {max_body} bytes", elapsed)
        return ProbeResult(resp.status == 200, True, f"HTTP {resp.status}", elapsed, body)
    except TimeoutError:
        return ProbeResult(False, False, f"timed out after {timeout_s:g} s", time.perf_counter() - started)
    except (OSError, http.client.HTTPException) as exc:
        detail = str(exc) or type(exc).__name__
        return ProbeResult(False, True, detail, time.perf_counter() - started)
    finally:
        conn.close()
