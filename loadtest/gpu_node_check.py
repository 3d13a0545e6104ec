"""On a GPU node: the mig-agent on the real NVML, and a gateway that routes by what it reports.

CI has no GPU, so ``tests/test_migagent.py`` runs the agent on a fake NVML. This script is the check
for a machine that has one (``python -m loadtest.gpu_node_check --out FILE``), read-only towards the
GPU: it changes no setting and injects nothing. It

1. starts ``sluicegate mig-agent`` (real pynvml) and reads ``/healthz`` and ``/v1/devices``;
2. starts a simulated pod labelled with the first GPU's UUID (and its first MIG slice, if MIG is on),
   and a gateway whose ``health.devices.agent_urls`` is that agent;
3. waits for the gateway's device polls, then checks the pod is routable (no device fault) and that
   a stream through the gateway ends in ``[DONE]``;
4. stops the agent with SIGTERM and checks it exits 0.

``--fake-nvml SPEC`` runs the same steps on the fake (to try the script where no GPU is). The
summary is printed as JSON and, with ``--out``, written there; the exit code is 1 when a step failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from gateway.migagent import READY_PREFIX
from loadtest.announced import AnnouncedServer, StartError
from loadtest.bench import MODEL, stream_once
from loadtest.loadgen import count_tokens
from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess

DEVICE_POLL_S = 0.2


class MigAgentProcess(AnnouncedServer):
    """``python -m gateway.migagent ARGS`` (see :class:`AnnouncedServer`)."""

    module = "gateway.migagent"
    ready_prefix = READY_PREFIX


def identity(doc: dict[str, Any]) -> dict[str, str]:
    """The first GPU's identity, and its first slice's where MIG is on."""
    gpu = doc["gpus"][0]
    ident = {"gpu_uuid": gpu["uuid"]}
    slices = [s for s in doc["slices"] if s["gpu_uuid"] == gpu["uuid"]]
    if slices:
        ident["mig_uuid"] = slices[0]["mig_uuid"]
    return ident


def pod_state(admin_url: str, name: str) -> dict[str, Any]:
    pods = httpx.get(admin_url + "/admin/pods", timeout=5).json()["pods"]
    return next(p for p in pods if p["name"] == name)["state"]


def run(fake_spec: str | None) -> dict[str, Any]:
    summary: dict[str, Any] = {"ok": False}
    agent_args = ["--host", "127.0.0.1", "--poll-ms", "500", "--node-name", "gpu-node-check"]
    agent = MigAgentProcess([*agent_args, *(["--fake-nvml", fake_spec] if fake_spec else [])]).start()
    try:
        summary["agent_healthz"] = httpx.get(agent.url + "/healthz", timeout=5).status_code
        doc = httpx.get(agent.url + "/v1/devices", timeout=5).json()
        summary["devices"] = doc
        ident = identity(doc)
        summary["pod_identity"] = ident
        pod_args = ["--model", MODEL, "--gpu-uuid", ident["gpu_uuid"], "--ttft-ms", "5", "--itl-ms", "2"]
        if "mig_uuid" in ident:
            pod_args += ["--mig-uuid", ident["mig_uuid"]]
        config = {
            "server": {"host": "127.0.0.1"},
            "health": {"devices": {"agent_urls": [agent.url], "interval_s": DEVICE_POLL_S}},
            "pods": [{"name": "on-gpu", "url": "", "models": [MODEL], "mig": ident}],
        }
        with PodsimProcess(pod_args) as pod:
            config["pods"][0]["url"] = pod.url
            with GatewayProcess(config) as gw:
                time.sleep(5 * DEVICE_POLL_S)  # a few device polls of the agent (no event to await)
                summary["gateway_pod_state"] = pod_state(gw.admin_url, "on-gpu")
                try:
                    summary["stream"] = {"done": True, "tokens": count_tokens(stream_once(gw.url, 8))}
                except RuntimeError as exc:  # not a 200 ending in [DONE]
                    summary["stream"] = {"done": False, "error": str(exc)}
                summary["gateway_log_device_warnings"] = [
                    line for line in gw.log().splitlines() if "device source" in line
                ]
    finally:
        summary["agent_exit_on_sigterm"] = agent.stop()
        agent.close()
    state = summary["gateway_pod_state"]
    summary["ok"] = (
        summary["agent_healthz"] == 200
        and state.get("device_fault") is None
        and summary["stream"]["done"]
        and not summary["gateway_log_device_warnings"]
        and summary["agent_exit_on_sigterm"] == 0
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fake-nvml", default=None, help="a fake NVML spec (loadtest/fakenvml.py) instead")
    parser.add_argument("--out", default=None, help="also write the JSON summary to this file")
    args = parser.parse_args(argv)
    try:
        summary = run(args.fake_nvml)
    except StartError as exc:  # the agent (no driver: exit 2) or the pod did not start
        print(f"gpu_node_check: {exc}", file=sys.stderr)
        return 1
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
