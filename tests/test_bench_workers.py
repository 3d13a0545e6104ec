"""``bench_workers``' memory columns: PSS over the gateway's processes, a worker's own memory (USS).

Read from real processes' ``/proc/PID/smaps_rollup``: a parent and a forked child share the pages
the parent had, so their PSS adds up to less than their RSS, and the template is never taken for a
worker."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

from loadtest import bench_workers
from loadtest.bench import process_tree


def _rss_mb(pid: int) -> float:
    return bench_workers._rollup_kb(pid)["Rss"] / 1024


def test_memory_counts_shared_pages_once_and_a_worker_alone() -> None:
    ballast = bytearray(os.urandom(64 << 20))  # 64 MB the child shares with us, unwritten
    pid = os.fork()
    if pid == 0:
        signal.pause()
        os._exit(0)
    try:
        pids = [os.getpid(), pid]
        memory = bench_workers._memory(os.getpid(), pids)
        rss = sum(_rss_mb(p) for p in pids)
        # the shared 64 MB counted once in PSS, twice in RSS
        assert rss - memory["pss_mb"] > 50, (rss, memory)
        # the worker (the child) holds little of its own: the ballast is shared
        assert memory["worker_uss_mb"] < 32, memory
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    del ballast


def test_the_template_is_not_a_worker() -> None:
    """A child named as the worker template (here holding 96 MB of its own) is left out of 'a
    worker's own'; a plain child is counted."""
    script = (
        "import os, sys, time; open('/proc/self/comm', 'w').write(sys.argv[1]); "
        "held = os.urandom(int(sys.argv[2]) << 20); print(1, flush=True); time.sleep(60)"
    )
    children = [
        subprocess.Popen([sys.executable, "-c", script, name, str(mb)], stdout=subprocess.PIPE)
        for name, mb in ((bench_workers.TEMPLATE, 96), ("worker", 0))
    ]
    try:
        for child in children:
            assert child.stdout is not None and child.stdout.readline()
        memory = bench_workers._memory(os.getpid(), process_tree(os.getpid()))
        assert 1 < memory["worker_uss_mb"] < 48, memory
    finally:
        for child in children:
            child.kill()
            child.wait()


def test_render_shows_memory_for_the_whole_host_rows() -> None:
    args = argparse.Namespace(repeats=1, setups=["podsim"], targets={"direct": 0, "2 workers": 2},
                              streams=8, stream_tokens=16, stream_requests=1)
    rows = [
        {"setup": "podsim", "target": "direct", "errors": 0, "tokens_per_s": 10.0,
         "cpu_ms_per_1k": None, "cores": None},
        {"setup": "podsim", "target": "2 workers", "errors": 0, "tokens_per_s": 5.0,
         "cpu_ms_per_1k": 7.0, "cores": 1.0, "pss_mb": 134.4, "worker_uss_mb": 25.6},
    ]
    table = bench_workers.render(rows, args, [])
    assert "| direct | 0 | 10 | — | — | — | — |" in table
    assert "| 2 workers | 0 | 5 | 7.0 | 1.00 | 134 | 26 |" in table
