"""Builds the request path's modules as C extensions with mypyc; everything else is in pyproject.toml.

The gateway's cost per token and per request is its own Python: many small calls, each ~1-2 k
instructions in CPython 3.11's eval loop. mypyc compiles the same typed source to C (attributes in
structs, calls between compiled functions without frames), and the code stays the Python that is
read, tested and profiled. Only the modules every request or every token runs through are compiled:
the rest (config, discovery, the admin plane, the HTTP/2 and HTTP/3 stacks) is start-up or side work.

``SLUICEGATE_PURE_PYTHON=1`` skips it (a platform without a C compiler); the gateway behaves the same,
only slower. ``make native`` compiles in place for the development tree.
"""

from __future__ import annotations

import os

from setuptools import setup

# The request path: every request runs these, every token the first six.
NATIVE_MODULES = [
    "transports/sse.py",
    "transports/pod_client.py",
    "transports/client_socket.py",
    "gateway/resume.py",
    "gateway/usage.py",
    "gateway/stream_relay.py",
    "transports/deadline.py",
    "transports/same_delay_timers.py",
    "transports/h1_limits.py",
    "transports/h1_disconnect.py",
    "transports/json_bytes.py",
    "transports/hangups.py",
    "transports/light_event.py",
    "gateway/relay.py",
    "gateway/phases/attempt.py",
    "gateway/phases/authenticate.py",
    "gateway/phases/finish.py",
    "gateway/phases/limit.py",
    "gateway/phases/path.py",
    "gateway/phases/pick.py",
    "gateway/phases/route.py",
    "gateway/exchange.py",
    "gateway/admit.py",
    "gateway/quota/gate.py",
    "gateway/quota/estimate.py",
    "gateway/quota/memory.py",
    "gateway/quota/headers.py",
    "gateway/quota/decision.py",
    "gateway/pods/registry.py",
    "gateway/pods/state.py",
    "gateway/metrics.py",
    "gateway/access_log.py",
    "gateway/request_head.py",
    "gateway/disconnect_watch.py",
    "gateway/deadlines.py",
    "gateway/retries.py",
    "gateway/completeness.py",
]


def native_extensions() -> list:
    if os.environ.get("SLUICEGATE_PURE_PYTHON") == "1":
        return []
    from mypyc.build import mypycify

    return mypycify(NATIVE_MODULES, opt_level="3")


setup(ext_modules=native_extensions())
