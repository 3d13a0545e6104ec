"""``sluicegate demo``: simulated pods on MIG slices plus the gateway, in one command.

For each configured pod on a loopback address, a pod simulator is started with that pod's port,
models and MIG identity; then the gateway serves in front of them and prints examples that work
as printed. Everything stops together on Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import shlex
import sys
from urllib.parse import urlsplit

from gateway.config import Config, PodConfig
from gateway.rlimits import raise_open_file_limit
from gateway.server import build_server
from loadtest.podsim.launch import PodsimProcess

# Realistic-looking speeds for a person watching tokens arrive.
DEMO_SPEEDS = ("--ttft-ms", "120", "--itl-ms", "40")


def _is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def podsim_args(pod: PodConfig) -> list[str]:
    """The simulator flags that make a pod simulator look like ``pod``."""
    parts = urlsplit(pod.url)
    args = ["--host", parts.hostname or "127.0.0.1", "--port", str(parts.port or 80)]
    for model in pod.models or ("llama-8b",):
        args += ["--model", model]
    if pod.mig:
        if pod.mig.gpu_uuid:
            args += ["--gpu-uuid", pod.mig.gpu_uuid]
        if pod.mig.mig_uuid:
            args += ["--mig-uuid", pod.mig.mig_uuid]
        if pod.mig.profile:
            args += ["--mig-profile", pod.mig.profile]
    return [*args, *DEMO_SPEEDS]


def examples(host: str, port: int, model: str) -> str:
    base = f"http://{host}:{port}"
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "Tell me about MIG slices."}],
            "stream": True,
            "max_tokens": 24,
        },
        separators=(",", ":"),
    )
    sdk = (
        "from openai import OpenAI\n"
        f"client = OpenAI(base_url='{base}/v1', api_key='unused')\n"
        f"stream = client.chat.completions.create(model='{model}', stream=True, max_tokens=24,\n"
        "    messages=[{'role': 'user', 'content': 'Tell me about MIG slices.'}])\n"
        "for chunk in stream:\n"
        "    if chunk.choices:\n"
        "        print(chunk.choices[0].delta.content or '', end='', flush=True)\n"
        "print()\n"
    )
    python = shlex.quote(sys.executable)
    return (
        f"\nSluicegate is serving on {base} in front of simulated pods.\n\n"
        f"  curl -N {base}/v1/chat/completions -H 'content-type: application/json' \\\n"
        f"    -d '{body}'\n\n"
        f"  {python} - <<'EOF'\n{sdk}EOF\n\n"
        f"  curl {base}/admin/pods     # pods, MIG slices and live state\n"
        f"  curl {base}/metrics        # Prometheus metrics\n"
    )


def run_demo(config: Config, log_level: str = "info") -> int:
    raise_open_file_limit()
    simulated = [pod for pod in config.pods if _is_loopback(pod.url)]
    sims = [PodsimProcess(podsim_args(pod)) for pod in simulated]
    try:
        for sim in sims:
            sim.start()
        for pod, sim in zip(simulated, sims, strict=True):
            mig = f" on {pod.mig.profile} slice {pod.mig.mig_uuid}" if pod.mig else ""
            print(f"simulated pod {pod.name} at {sim.url}{mig}", flush=True)
        model = next((m for pod in config.pods for m in pod.models), "llama-8b")
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_serve_and_announce(config, log_level, model))
    finally:
        for sim in sims:
            sim.stop()
    return 0


async def _serve_and_announce(config: Config, log_level: str, model: str) -> None:
    server = build_server(config, log_level)
    serving = asyncio.create_task(server.serve())
    listening = asyncio.create_task(server.listening.wait())
    await asyncio.wait((serving, listening), return_when=asyncio.FIRST_COMPLETED)
    if listening.done():
        print(examples(config.server.host, config.server.port, model), flush=True)
    else:
        listening.cancel()
    await serving
