"""Reaction benchmark: how long a slice that just failed, or just filled up, keeps getting requests.

Three simulated pods, each on a MIG slice of its own GPU behind a fake dcgm-exporter (DCGM reports
XIDs per GPU, so pods on one GPU would all go out together), a gateway that reads the exporter and
every pod's ``/metrics`` once per ``--interval``, and ``--clients`` clients sending short chat streams
without pause. In each round, at T0, one pod's slice gets a critical XID (``xid``: dcgmsim
``POST /faults``) or its KV cache is reported 97 % full (``pressure``: podsim ``POST /admin/faults``).

Measured per round, on CLOCK_MONOTONIC (``time.monotonic()``, one clock for every process here):

- **last routed**: the arrival, at the pod, of the last request it received (podsim's
  ``GET /podsim/arrivals``) minus T0. The gateway routed that request a little earlier, so this is an
  upper bound of the time the gateway last chose the pod; the client's send time of the last request
  the pod answered is a lower bound, reported beside it.
- **shown out**: when ``GET /admin/pods`` (polled every 10 ms) first showed the pod unroutable
  (``xid``) or its pressure breaker open (``pressure``) minus T0.

T0 is taken just before the fault is injected (so the injection's own round trip counts against the
gateway). Each round starts at a random phase of the gateway's polling loop; between rounds the fault
is cleared (dcgmsim ``DELETE /faults`` plus ``POST /admin/pods/NAME/clear`` for the sticky device
fault; ``DELETE /admin/faults`` on the pod) and the pod must be back in ``/admin/pods`` and serving
before the next round; after an XID, the next one also waits an interval + 100 ms, so that the gateway
has read the exporter's reset (DCGM's gauge holds the last XID: a new 79 read before the reset is
indistinguishable from the one just cleared). Target (issue 4): last routed <= one interval + 100 ms.

    python -m loadtest.bench_reaction [--rounds 10] [--interval 1.0] [--clients 20] [--write-md FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import platform
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from loadtest.bench import LOAD_CORE, PROXY_CORE, can_pin
from loadtest.dcgmsim import DcgmsimProcess
from loadtest.loadgen import percentile
from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from loadtest.report import command_line, publish

MODEL = "llama-8b"
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 8,
    "stream": True,
}
POD_PACE = ["--ttft-ms", "20", "--itl-ms", "10", "--itl-per-seq-ms", "0"]  # ~100 ms per answer
SCENARIOS = ("xid", "pressure")
XID = 79  # GPU fell off the bus: critical (gateway.health.xid.is_critical)
FULL_KV = 0.97  # above the pressure breaker's kv_high (0.92)
POLL_S = 0.01
SETTLE_S = 0.5  # traffic keeps running this long after the pod is shown out
STRAGGLER_S = 0.25  # a request arriving this long after "shown out" was routed after the change
GPUS = [f"GPU-7e1d0c{i:02d}-5b2a-4c3d-8e9f-0a1b2c3d4e5f" for i in range(3)]
MIGS = [f"MIG-3a9c51{i:02d}-d2e4-5f60-a1b2-c3d4e5f6a7b8" for i in range(3)]
GPU_INSTANCE_ID = 9
VICTIM = 0  # the same pod every round: its slice faults, is cleared, faults again


@dataclass
class Round:
    scenario: str
    t0: float
    inject_rtt_s: float = 0.0
    shown_out_s: float | None = None  # /admin/pods showed it out (response received) - T0
    last_arrival_s: float | None = None  # the pod's own arrival time of its last request - T0
    last_sent_s: float | None = None  # client send time of the last request the pod answered - T0
    served_before: int = 0  # requests the pod received in the second before T0
    stragglers: int = 0  # arrivals at the pod later than STRAGGLER_S after it was shown out
    answered_after: int = 0  # answers from the pod (its x-sluicegate-pod) to requests sent that late
    back_s: float | None = None  # from clearing to routable again in /admin/pods


@dataclass
class Traffic:
    """Clients sending chat streams back to back; what each got, on the machine-wide clock."""

    url: str
    clients: int
    sent: list[tuple[float, str]] = field(default_factory=list)  # (send time, pod), answered requests
    statuses: dict[str, int] = field(default_factory=dict)
    last_by_pod: dict[str, float] = field(default_factory=dict)  # pod -> latest send time answered
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    async def run(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        await asyncio.gather(*(self._client(session, stop) for _ in range(self.clients)))

    async def _client(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        while not stop.is_set():
            rid = f"reaction-{next(self._ids)}"
            sent = time.monotonic()
            try:
                async with session.post(
                    self.url + "/v1/chat/completions", json=CHAT, headers={"X-Request-Id": rid}
                ) as resp:
                    body = await resp.read()
                    pod = resp.headers.get("x-sluicegate-pod", "-")
                    ok = resp.status == 200 and body.rstrip().endswith(b"data: [DONE]")
                    key = str(resp.status) if ok or resp.status != 200 else "200 incomplete"
            except (aiohttp.ClientError, TimeoutError) as exc:
                key, ok, pod = type(exc).__name__, False, "-"
            self.statuses[key] = self.statuses.get(key, 0) + 1
            if ok:
                self.sent.append((sent, pod))
                self.last_by_pod[pod] = max(sent, self.last_by_pod.get(pod, 0.0))


class Bench:
    def __init__(self, session: aiohttp.ClientSession, admin: str, pods: list[str], dcgm: str) -> None:
        self.session = session
        self.admin = admin  # the gateway's admin listener, where /admin/pods is
        self.pods = pods  # URLs, pod-0 .. pod-2
        self.dcgm = dcgm
        self.next_fault_at = 0.0  # no fault before this (see clear)

    async def _json(self, method: str, url: str, **kwargs: Any) -> Any:
        async with self.session.request(method, url, **kwargs) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{method} {url}: HTTP {resp.status}: {await resp.text()}")
            return await resp.json()

    async def state(self, name: str) -> dict[str, Any]:
        pods = (await self._json("GET", self.admin + "/admin/pods"))["pods"]
        return next(p for p in pods if p["name"] == name)["state"]

    @staticmethod
    def out(scenario: str, state: dict[str, Any]) -> bool:
        if scenario == "xid":
            return not state["routable"]
        return state["breaker"]["pressure"] == "open"

    @staticmethod
    def back(state: dict[str, Any]) -> bool:
        return state["routable"] and state["breaker"]["pressure"] == "closed" and state["load"]["fresh"]

    async def wait_state(self, name: str, want: Any, timeout_s: float) -> float | None:
        """Poll /admin/pods until ``want(state)``; the time the answer came, or None after the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = await self.state(name)
            now = time.monotonic()
            if want(state):
                return now
            if now > deadline:
                return None
            await asyncio.sleep(POLL_S)

    async def inject(self, scenario: str) -> None:
        if scenario == "xid":
            fault = {"gpu_uuid": GPUS[VICTIM], "gpu_instance_id": GPU_INSTANCE_ID, "xid": XID}
            await self._json("POST", self.dcgm + "/faults", json=fault)
        else:
            await self._json("POST", self.pods[VICTIM] + "/admin/faults", json={"kv_usage": FULL_KV})

    async def clear(self, scenario: str, interval_s: float) -> None:
        if scenario == "xid":  # the exporter's gauge is reset (a driver reload), an operator clears the pod
            await self._json("DELETE", self.dcgm + "/faults")
            await self._json("POST", self.admin + f"/admin/pods/pod-{VICTIM}/clear")
            # DCGM's gauge holds the *last* XID: until the gateway has read the reset page, a new XID 79
            # looks like the one the operator just cleared, and is rightly ignored. Nothing outside the
            # gateway shows when it read the exporter, so the next fault waits one reading interval.
            self.next_fault_at = time.monotonic() + interval_s + 0.1
        else:
            await self._json("DELETE", self.pods[VICTIM] + "/admin/faults")

    async def arrivals(self, since: float) -> list[float]:
        got = await self._json("GET", self.pods[VICTIM] + "/podsim/arrivals", params={"since": str(since)})
        return [a["at"] for a in got["arrivals"] if a["id"].startswith("reaction-")]

    async def serving(self, traffic: Traffic, since: float, timeout_s: float) -> bool:
        """Wait until the victim has answered a request sent after ``since``."""
        deadline = time.monotonic() + timeout_s
        while traffic.last_by_pod.get(f"pod-{VICTIM}", 0.0) <= since:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(POLL_S)
        return True

    async def round(self, scenario: str, traffic: Traffic, interval_s: float) -> Round:
        name = f"pod-{VICTIM}"
        await asyncio.sleep(max(0.0, self.next_fault_at - time.monotonic()))
        await asyncio.sleep(random.uniform(0, interval_s))  # a random phase of the gateway's loops
        t0 = time.monotonic()
        await self.inject(scenario)
        result = Round(scenario, t0, inject_rtt_s=time.monotonic() - t0)
        timeout = 5 * interval_s + 2.0
        shown = await self.wait_state(name, lambda s: self.out(scenario, s), timeout)
        settled_until = (shown if shown is not None else time.monotonic()) + SETTLE_S
        await asyncio.sleep(max(0.0, settled_until - time.monotonic()))
        arrivals = await self.arrivals(t0 - 1.0)
        result.served_before = sum(at < t0 for at in arrivals)
        if shown is not None:
            result.shown_out_s = shown - t0
            result.stragglers = sum(at > shown + STRAGGLER_S for at in arrivals)
        if arrivals:
            result.last_arrival_s = max(arrivals) - t0
        answered = [sent for sent, pod in traffic.sent if pod == name and sent >= t0 - 1.0]
        if answered:
            result.last_sent_s = max(answered) - t0
        if shown is not None:
            result.answered_after = sum(sent > shown + STRAGGLER_S for sent in answered)
        cleared = time.monotonic()
        await self.clear(scenario, interval_s)
        back = await self.wait_state(name, self.back, timeout)
        if back is None or not await self.serving(traffic, back, timeout):
            raise RuntimeError(f"{name} did not come back after the {scenario} fault was cleared")
        result.back_s = back - cleared
        return result


def _pod_args(i: int) -> list[str]:
    mig = ["--gpu-uuid", GPUS[i], "--mig-uuid", MIGS[i], "--mig-profile", "1g.10gb"]
    return ["--model", MODEL, *mig, *POD_PACE]


def gateway_config(pods: list[str], dcgm_url: str, interval_s: float) -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "access_log": False},
        "health": {
            "scrape": {"interval_s": interval_s},
            "devices": {"dcgm_urls": [dcgm_url + "/metrics"], "interval_s": interval_s},
        },
        "pods": [
            {
                "name": f"pod-{i}",
                "url": url,
                "models": [MODEL],
                "mig": {
                    "gpu_uuid": GPUS[i],
                    "gpu_instance_id": GPU_INSTANCE_ID,
                    "mig_uuid": MIGS[i],
                    "profile": "1g.10gb",
                },
            }
            for i, url in enumerate(pods)
        ],
    }


async def _measure(
    gateway: str,
    admin: str,
    pods: list[str],
    dcgm: str,
    rounds: int,
    interval_s: float,
    clients: int,
    scenarios: tuple[str, ...],
) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        bench = Bench(session, admin, pods, dcgm)
        for i in range(len(pods)):
            if await bench.wait_state(f"pod-{i}", bench.back, 10 * interval_s + 5) is None:
                raise RuntimeError(f"pod-{i} never became routable with fresh metrics")
        traffic = Traffic(gateway, clients)
        stop = asyncio.Event()
        clients_task = asyncio.create_task(traffic.run(session, stop))
        started = time.monotonic()
        try:
            if not await bench.serving(traffic, started, 10.0):
                raise RuntimeError("the victim pod never got traffic")
            results: dict[str, list[Round]] = {s: [] for s in scenarios}
            for scenario in scenarios:
                for _ in range(rounds):
                    results[scenario].append(await bench.round(scenario, traffic, interval_s))
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(clients_task, 30)
        elapsed = time.monotonic() - started
        return {
            "rounds": results,
            "statuses": dict(traffic.statuses),
            "requests": sum(traffic.statuses.values()),
            "elapsed_s": elapsed,
        }


def run(
    rounds: int = 10,
    interval_s: float = 1.0,
    clients: int = 20,
    scenarios: tuple[str, ...] = SCENARIOS,
    pin: bool = False,
) -> dict[str, Any]:
    """Start the fleet, measure, stop it; the raw results (see :func:`render`)."""
    load_before = os.getloadavg()[0]
    gpus = [f"{GPUS[i]}:1g.10gb@{GPU_INSTANCE_ID}" for i in range(3)]
    dcgm = DcgmsimProcess([arg for gpu in gpus for arg in ("--gpu", gpu)])
    pods = [PodsimProcess(_pod_args(i)) for i in range(3)]
    with dcgm:
        for pod in pods:
            pod.start()
        try:
            config = gateway_config([p.url for p in pods], dcgm.url, interval_s)
            with GatewayProcess(config, cpu=PROXY_CORE if pin else None) as gw:
                pod_urls = [p.url for p in pods]
                result = asyncio.run(
                    _measure(gw.url, gw.admin_url, pod_urls, dcgm.url, rounds, interval_s, clients, scenarios)
                )
        finally:
            for pod in pods:
                pod.close()
    result.update(
        interval_s=interval_s,
        clients=clients,
        pin=pin,
        load_before=load_before,
        load_after=os.getloadavg()[0],
    )
    return result


def problems(result: dict[str, Any]) -> list[str]:
    """What went wrong beyond timing: a fault never acted on, traffic after it, failed requests."""
    found = []
    for scenario, rounds in result["rounds"].items():
        for i, r in enumerate(rounds, 1):
            if r.shown_out_s is None:
                found.append(f"{scenario} round {i}: /admin/pods never showed the pod out")
            if r.stragglers or r.answered_after:
                found.append(
                    f"{scenario} round {i}: requests reached the pod after it was out "
                    f"({r.stragglers} by the pod's log, {r.answered_after} answered from it)"
                )
            if not r.served_before:
                found.append(f"{scenario} round {i}: the pod had no traffic before T0")
    bad = {k: n for k, n in result["statuses"].items() if k != "200"}
    if bad:
        found.append(f"requests that failed: {bad}")
    return found


def _ms(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value * 1000:.1f}" if abs(value) < 0.01 else f"{value * 1000:.0f}"


def _p50_max(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "—"
    missing = f" ({len(values) - len(known)} never)" if len(known) < len(values) else ""
    return f"{_ms(percentile(known, 50))} / {_ms(max(known))}{missing}"


def render(result: dict[str, Any], command: str) -> str:
    interval = result["interval_s"]
    target = interval + 0.1
    every = [r for rounds in result["rounds"].values() for r in rounds]
    pinning = "no pinning"
    if result["pin"]:
        pinning = "gateway alone on core 1; clients, pods and exporter on core 0"
    lines = [
        f"Command: `{command}`  ",
        f"Machine: {os.cpu_count()} cores, Linux {platform.release()}, Python {platform.python_version()}; "
        f"{pinning}; 1-min load average {result['load_before']:.2f} at start, {result['load_after']:.2f} "
        "at the end  ",
        f"Gateway: pod `/metrics` and dcgm-exporter read every {interval:g} s; {result['clients']} clients, "
        f"{result['requests']} chat streams of 8 tokens in {result['elapsed_s']:.0f} s "
        f"({', '.join(f'{n} x {k}' for k, n in sorted(result['statuses'].items()))}); "
        f"injecting a fault took {_p50_max([r.inject_rtt_s for r in every])} ms (p50 / max), "
        "counted against the gateway.",
        "",
        "| at T0 | rounds | last request routed there, p50 / max ms | client-side lower bound, p50 / max ms "
        "| /admin/pods shows it out, p50 / max ms | target ms | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    what = {"xid": f"XID {XID} on the pod's slice", "pressure": f"pod's KV cache {FULL_KV:.0%} full"}
    for scenario, rounds in result["rounds"].items():
        last = [r.last_arrival_s for r in rounds]
        known = [v for v in last if v is not None]
        met = len(known) == len(rounds) and all(r.shown_out_s is not None for r in rounds)
        verdict = "met" if met and max(known) <= target else "missed"
        lines.append(
            f"| {what[scenario]} | {len(rounds)} | {_p50_max(last)} | "
            f"{_p50_max([r.last_sent_s for r in rounds])} | {_p50_max([r.shown_out_s for r in rounds])} | "
            f"{target * 1000:.0f} | {verdict} |"
        )
    lines.append("")
    for scenario, rounds in result["rounds"].items():
        per_round = ", ".join(f"{_ms(r.last_arrival_s)}" for r in rounds)
        late = sum(r.stragglers + r.answered_after for r in rounds)
        lines.append(f"{scenario}: last routed per round (ms) {per_round}; routed there once out: {late}  ")
    found = problems(result)
    if found:
        lines += ["", "Problems:", "", *(f"- {p}" for p in found)]
    return "\n".join(lines).rstrip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_reaction", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--rounds", type=int, default=10, help="rounds per scenario (default 10)")
    parser.add_argument("--interval", type=float, default=1.0, help="the gateway's scrape interval, s")
    parser.add_argument("--clients", type=int, default=20, help="concurrent clients (default 20)")
    parser.add_argument("--scenario", choices=SCENARIOS, action="append", help="default: both")
    parser.add_argument("--write-md", metavar="FILE")
    args = parser.parse_args(argv)
    pin = can_pin()
    if pin:  # the gateway alone on its core; this process and the simulators (its children) on the other
        os.sched_setaffinity(0, {LOAD_CORE})
    result = run(args.rounds, args.interval, args.clients, tuple(args.scenario or SCENARIOS), pin)
    command = command_line("loadtest.bench_reaction", argv)
    publish(render(result, command), args.write_md, "reaction")
    return 1 if problems(result) else 0


if __name__ == "__main__":
    sys.exit(main())
