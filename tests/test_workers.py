"""``serve --workers 2`` as one gateway: real supervisor and worker processes, real sockets.

Both workers serve (the merged /metrics names each by a ``worker`` label), each pod is probed once per
interval whatever the number of workers, a quota is exact across workers (the private redis-server),
SIGTERM drains the streams in flight on both workers and exits 0, and bad input is one line, exit 2/3.
"""

from __future__ import annotations

import functools
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from gateway.cli import main
from loadtest.nginx import free_port
from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from tests.conftest import wait_for
from tests.redis_server import needs_redis_server

PROBE_S = 0.25
CHAT = {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


class _Counting(BaseHTTPRequestHandler):
    """A pod that only answers probes, and counts them."""

    probes = 0

    def do_GET(self) -> None:
        if self.path == "/health":
            type(self).probes += 1
            body = b"{}"
        elif self.path == "/v1/models":
            body = b'{"object": "list", "data": [{"id": "counted", "object": "model"}]}'
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: object) -> None:
        pass


@pytest.fixture(scope="module")
def counting_pod() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Counting)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def pod() -> Iterator[PodsimProcess]:
    with PodsimProcess(["--model", "llama-8b", "--ttft-ms", "5", "--itl-ms", "20"]) as sim:
        yield sim


def _config(pod: PodsimProcess, counting: str) -> dict:
    return {
        "server": {"host": "127.0.0.1", "access_log": False},
        "health": {"probe": {"interval_s": PROBE_S}},
        "tiers": {"limited": {"quota": {"requests_per_minute": 4}}},
        "pods": [
            {"name": "sim", "url": pod.url, "models": ["llama-8b"]},
            {"name": "counted", "url": counting, "models": ["counted"]},
        ],
    }


@pytest.fixture(scope="module")
def gateway(pod: PodsimProcess, counting_pod: str) -> Iterator[GatewayProcess]:
    with GatewayProcess(_config(pod, counting_pod), extra_args=["--workers", "2"]) as gw:
        yield gw


def _by_worker(admin_url: str, family: str) -> dict[str, float]:
    totals: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(admin_url + "/metrics", timeout=5).text):
        if fam.name == family:
            for s in fam.samples:
                if not s.name.endswith("_created"):
                    totals[s.labels["worker"]] = totals.get(s.labels["worker"], 0.0) + s.value
    return totals


def _fresh(url: str, path: str, json: dict, headers: dict | None = None) -> httpx.Response:
    """One request on a connection of its own (SO_REUSEPORT spreads connections, not requests)."""
    with httpx.Client(timeout=10) as client:
        return client.post(url + path, json=json, headers=headers or {})


@needs_redis_server()
def test_both_workers_serve_and_metrics_name_each(gateway: GatewayProcess) -> None:
    for _ in range(20):
        assert _fresh(gateway.url, "/v1/chat/completions", CHAT).status_code == 200
    served = _by_worker(gateway.admin_url, "sluicegate_requests")
    assert set(served) == {"0", "1"} and sum(served.values()) == 20, served
    # the merged page is in the same exposition format, so it says the same as one process's page
    assert httpx.get(gateway.admin_url + "/metrics").headers["content-type"] == CONTENT_TYPE_LATEST
    assert httpx.get(gateway.url + "/readyz").json()["status"] == "ready"
    pods = httpx.get(gateway.admin_url + "/admin/pods").json()["pods"]
    assert {p["name"]: p["state"]["health"] for p in pods} == {"sim": "healthy", "counted": "healthy"}


@needs_redis_server()
def test_each_pod_is_probed_once_per_interval(gateway: GatewayProcess) -> None:
    """Over a few intervals the pod counts about one probe per interval, not one per worker."""
    start, began = _Counting.probes, time.monotonic()
    time.sleep(8 * PROBE_S)  # a measurement window, not a wait for an event
    probes, elapsed = _Counting.probes - start, time.monotonic() - began
    intervals = elapsed / PROBE_S
    # at most one per interval (two workers probing would make ~2 per interval); at least half of them,
    # for a starved machine's late rounds
    assert intervals / 2 <= probes <= intervals + 1, (probes, intervals)


@needs_redis_server()
def test_a_quota_is_exact_across_workers(gateway: GatewayProcess) -> None:
    headers = {"x-sluicegate-tier": "limited"}
    before = _by_worker(gateway.admin_url, "sluicegate_requests")
    statuses = [
        _fresh(gateway.url, "/v1/chat/completions", CHAT, headers).status_code for _ in range(12)
    ]
    assert statuses.count(200) == 4 and statuses.count(429) == 8, statuses
    after = _by_worker(gateway.admin_url, "sluicegate_requests")
    assert all(after[w] > before.get(w, 0) for w in ("0", "1")), (before, after)


def _stream(url: str, done: list[bool]) -> None:
    body = {**CHAT, "stream": True, "max_tokens": 150}  # 3 s at the pod's 20 ms a token
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
        text = "".join(r.iter_text())
    done.append(r.status_code == 200 and "data: [DONE]" in text)


def _in_flight(gw: GatewayProcess) -> dict[str, float]:
    return _by_worker(gw.admin_url, "sluicegate_in_flight_requests")


@needs_redis_server()
def test_sigterm_drains_streams_on_both_workers(pod: PodsimProcess, counting_pod: str) -> None:
    with GatewayProcess(_config(pod, counting_pod), extra_args=["--workers", "2"]) as gw:
        done: list[bool] = []
        threads: list[threading.Thread] = []
        while len(threads) < 30:
            thread = threading.Thread(target=_stream, args=(gw.url, done))
            thread.start()
            threads.append(thread)
            started = len(threads)
            # every stream started and not yet done is counted in flight (the workers' snapshots lag
            # a little; a stream that has ended meanwhile, on a loaded machine, is not waited for)
            assert wait_for(lambda started=started: sum(_in_flight(gw).values()) >= started - len(done))
            in_flight = _in_flight(gw)
            if len(in_flight) == 2 and all(v > 0 for v in in_flight.values()):
                break
        assert all(v > 0 for v in in_flight.values()) and len(in_flight) == 2, in_flight
        assert gw.stop(timeout_s=20) == 0, gw.log()
        for thread in threads:
            thread.join(10)
        assert done == [True] * len(threads), gw.log()


@pytest.mark.parametrize("value", ["x", "-1", "1.5"])
def test_a_bad_workers_value_is_one_line_and_exit_2(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--upstream", "http://127.0.0.1:9", "--workers", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--workers" in err[0] and "auto" in err[0], err


def test_a_taken_port_is_exit_3_before_any_worker(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = tmp_path / "c.yaml"
        config.write_text(yaml.safe_dump({
            "server": {"host": "127.0.0.1", "port": port}, "auth": {"enabled": False},
            "admin": {"enabled": False},
            "pods": [{"name": "p", "url": "http://127.0.0.1:9", "models": ["m"]}],
        }))
        result = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--workers", "2"],
            capture_output=True, text=True, timeout=30,
        )
    assert result.returncode == 3, result.stderr
    assert "cannot listen" in result.stderr and "worker" not in result.stderr, result.stderr


@needs_redis_server()
def test_a_pod_added_to_the_config_file_stays_in_every_worker(pod: PodsimProcess, counting_pod: str) -> None:
    """Each worker re-reads a changed file by itself; the supervisor must too, or its next snapshot
    would take the new pod out of them again. Its probes of the new pod show it has the pod."""
    config = _config(pod, counting_pod)
    config["reload"] = {"interval_s": 0.1}
    added = config["pods"].pop()
    with GatewayProcess(config, extra_args=["--workers", "2"]) as gw:
        config["pods"].append(added)
        config_file = Path(gw._dir.name) / "config.yaml"
        start = _Counting.probes
        config_file.write_text(yaml.safe_dump(config))
        assert wait_for(lambda: _Counting.probes >= start + 3, timeout_s=10)  # the supervisor probes it
        for _ in range(10):  # several snapshots later, on fresh connections (either worker)
            with httpx.Client(timeout=5) as client:
                models = {m["id"] for m in client.get(gw.url + "/v1/models").json()["data"]}
            assert models == {"llama-8b", "counted"}


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _python_children(pid: int) -> list[int]:
    """``pid``'s children running the gateway (not the private redis-server)."""
    return [p for p in _children(pid) if b"gateway.cli" in Path(f"/proc/{p}/cmdline").read_bytes()]


def _gauge(admin_url: str, name: str) -> float:
    for fam in text_string_to_metric_families(httpx.get(admin_url + "/metrics", timeout=5).text):
        for sample in fam.samples:
            if sample.name == name and "worker" not in sample.labels:
                return sample.value
    return 0.0


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


@needs_redis_server()
def test_workers_are_forked_from_one_template_and_one_killed_is_forked_again(
    pod: PodsimProcess, counting_pod: str
) -> None:
    """The workers share the template's imported gateway (docs/operations.md): each is its child, not
    a fresh interpreter; a worker that dies is forked again and serves, and SIGTERM leaves nothing."""
    with GatewayProcess(_config(pod, counting_pod), extra_args=["--workers", "2"]) as gw:
        (template,) = _python_children(gw.pid)
        workers = _python_children(template)
        assert len(workers) == 2, workers
        victim = workers[0]
        subprocess.run(["kill", "-KILL", str(victim)], check=True)
        assert wait_for(lambda: _gauge(gw.admin_url, "sluicegate_worker_restarts_total") == 1, timeout_s=20)
        assert wait_for(lambda: _gauge(gw.admin_url, "sluicegate_workers") == 2, timeout_s=20)
        again = _python_children(template)
        assert len(again) == 2 and victim not in again, again
        assert "status -9" in gw.log(), gw.log()
        for _ in range(10):
            assert _fresh(gw.url, "/v1/chat/completions", CHAT).status_code == 200
        assert gw.stop(timeout_s=20) == 0, gw.log()
    assert not any(_alive(p) for p in (template, *again)), "a worker or the template outlived the supervisor"


@needs_redis_server()
def test_without_the_template_workers_are_still_watched_and_started(
    pod: PodsimProcess, counting_pod: str
) -> None:
    """The template killed: the supervisor still learns of its workers' exits and starts them with exec."""
    with GatewayProcess(_config(pod, counting_pod), extra_args=["--workers", "2"]) as gw:
        (template,) = _python_children(gw.pid)
        workers = _python_children(template)
        subprocess.run(["kill", "-KILL", str(template)], check=True)
        assert wait_for(lambda: "worker template" in gw.log(), timeout_s=10), gw.log()
        subprocess.run(["kill", "-KILL", str(workers[0])], check=True)
        assert wait_for(lambda: _gauge(gw.admin_url, "sluicegate_worker_restarts_total") == 1, timeout_s=20)
        assert wait_for(lambda: _gauge(gw.admin_url, "sluicegate_workers") == 2, timeout_s=20)
        (started,) = _python_children(gw.pid)  # exec'd: the supervisor's own child now
        assert started not in workers
        for _ in range(10):
            assert _fresh(gw.url, "/v1/chat/completions", CHAT).status_code == 200
        assert gw.stop(timeout_s=20) == 0, gw.log()
    assert not any(_alive(p) for p in (started, workers[1])), "a worker outlived the supervisor"


@needs_redis_server()
def test_request_ids_are_unique_across_forked_workers(gateway: GatewayProcess) -> None:
    """Each worker makes its own ids (a prefix of its own and a counter): forked from one template,
    they must not start from the same prefix, or their first requests would share ids."""
    ids = [_fresh(gateway.url, "/v1/chat/completions", CHAT).headers["x-request-id"] for _ in range(20)]
    served = _by_worker(gateway.admin_url, "sluicegate_requests")
    assert len(served) == 2, served  # both workers answered some of them
    assert len(set(ids)) == len(ids), ids
    assert len({rid[:16] for rid in ids}) == 2, ids


@needs_redis_server()
@pytest.mark.parametrize("template", ["alive", "killed"])
def test_nothing_is_left_behind_when_the_supervisor_is_killed(
    pod: PodsimProcess, counting_pod: str, template: str
) -> None:
    """SIGKILL (the OOM killer, a hard stop) leaves the supervisor no chance to tell anyone or
    clean up: its workers see it gone (the supervisor itself, not their parent, the template),
    drain and exit; the supervisor's directory of sockets is removed, by the template or, where
    the template died before (one worker then exec'd), by the last worker out; and the private
    redis-server the workers shared quotas through goes with the supervisor."""
    with GatewayProcess(_config(pod, counting_pod), extra_args=["--workers", "2"]) as gw:
        (forker,) = _python_children(gw.pid)
        workers = _python_children(forker)
        assert len(workers) == 2, workers
        (redis,) = set(_children(gw.pid)) - {forker}
        assert b"redis-server" in Path(f"/proc/{redis}/cmdline").read_bytes()
        (url,) = re.findall(r"private redis-server at unix://(\S+)", gw.log())
        directory = Path(url).parent
        assert directory.name.startswith("sluicegate-workers-") and (directory / "feed.sock").exists()
        if template == "killed":
            subprocess.run(["kill", "-KILL", str(forker)], check=True)
            assert wait_for(lambda: "worker template" in gw.log(), timeout_s=10), gw.log()
            subprocess.run(["kill", "-KILL", str(workers[0])], check=True)
            restarts = functools.partial(_gauge, gw.admin_url, "sluicegate_worker_restarts_total")
            assert wait_for(lambda: restarts() == 1, timeout_s=20)
            assert wait_for(lambda: _gauge(gw.admin_url, "sluicegate_workers") == 2, timeout_s=20)
            (exec_d,) = set(_python_children(gw.pid)) - {forker}
            workers = [exec_d, workers[1]]
        gw.proc.kill()  # type: ignore[union-attr]
        gw.proc.wait()  # type: ignore[union-attr]
        left = (forker, *workers, redis)
        gone = wait_for(lambda: not any(_alive(p) for p in left), timeout_s=20)
        assert gone, ([*map(_alive, left)], gw.log())
        assert gw.log().count("the supervisor exited; draining") == 2, gw.log()
        assert not directory.exists(), sorted(p.name for p in directory.iterdir())


_MANY_SPAWNS = """
import asyncio, json, sys
from gateway.workers.template import PRELOAD, WorkerTemplate

template = WorkerTemplate.start(PRELOAD)
assert template is not None

async def one(env):
    worker = await template.spawn(["--version"], env)
    line = (await worker.stdout.readline()).decode().strip()
    return worker.pid, line, await worker.wait()

async def main():
    env = {"BIG": "x" * 20000, "PATH": "/usr/bin:/bin"}  # 30 of these do not fit one socket buffer
    return await asyncio.gather(*(one(env) for _ in range(30)))

results = asyncio.run(main())
template.close()
print(json.dumps(results))
"""


def test_many_workers_with_a_large_environment_are_all_forked() -> None:
    """``--workers auto`` on a large node starts its workers at once, each with the whole environment:
    every one must be forked (not refused by a full socket buffer and exec'd instead), each answers as
    ``python -m gateway.cli`` would, and each exit status comes back."""
    result = subprocess.run([sys.executable, "-c", _MANY_SPAWNS], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    results = json.loads(result.stdout)
    assert len({pid for pid, _, _ in results}) == 30
    assert all(line.startswith("sluicegate ") and status == 0 for _, line, status in results), results


def test_workers_serve_when_the_supervisor_has_no_stdout(
    pod: PodsimProcess, counting_pod: str, tmp_path: Path
) -> None:
    """Started with its stdout closed (as some service managers do), the supervisor still forks its
    workers, they serve, and SIGTERM drains them: nothing depends on descriptor 1 being open."""
    port = free_port()
    config = _config(pod, counting_pod)
    del config["tiers"]
    config["server"] = {**config["server"], "port": port}
    config["admin"] = {"enabled": False}
    config["auth"] = {"enabled": False}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--workers", "2"],
        stderr=subprocess.PIPE, text=True, preexec_fn=lambda: os.close(1),
    )
    try:
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            try:
                return httpx.get(url + "/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_for(ready, timeout_s=30), "not ready"
        (template,) = _python_children(proc.pid)
        assert len(_python_children(template)) == 2
        for _ in range(6):
            assert _fresh(url, "/v1/chat/completions", CHAT).status_code == 200
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        stderr = proc.communicate()[1]
    assert "Traceback" not in stderr, stderr[-3000:]
