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
from pathlib import Path
from urllib.parse import urlsplit

from gateway.config import Config, PodConfig, TlsConfig
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


def ensure_certificate(tls: TlsConfig) -> bool:
    """Make a self-signed certificate and key at the configured paths when either is missing.

    True when a new pair was made. The pair names localhost, 127.0.0.1 and ::1 and is its own CA, so
    a client trusts it by trusting the file.
    """
    cert, key = Path(tls.cert), Path(tls.key)
    if cert.is_file() and key.is_file():
        return False
    from transports.tls import self_signed

    made_cert, made_key = self_signed(cert.parent, days=365)
    if made_cert != cert:
        made_cert.replace(cert)
    if made_key != key:
        key.parent.mkdir(parents=True, exist_ok=True)
        made_key.replace(key)
    return True


def tls_examples(tls: TlsConfig, model: str) -> str:
    """How to trust the demo's certificate, and a request over each TLS transport."""
    cert_path = str(Path(tls.cert).resolve())
    cert = shlex.quote(cert_path)
    base = f"https://localhost:{tls.port}"
    h3 = f"HTTP/3 on UDP {tls.h3_port or tls.port}" if tls.h3 else "no HTTP/3"
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_tokens": 8},
        separators=(",", ":"),
    )
    hi = "[{'role': 'user', 'content': 'Hi'}]"
    client = (
        "from transports.client import SyncSluicegateClient\n"
        f"with SyncSluicegateClient('{base}', verify={cert_path!r}) as client:\n"
        "    for _ in range(2):  # the first answer advertises HTTP/3 (Alt-Svc); the second uses it\n"
        f"        with client.stream_chat('{model}', {hi}, max_tokens=8) as stream:\n"
        "            print(''.join(stream), '<- over', stream.transport)\n"
    )
    python = shlex.quote(sys.executable)
    trust_system = "/usr/local/share/ca-certificates/sluicegate-demo.crt && sudo update-ca-certificates"
    return (
        f"\nOver TLS at {base} (HTTP/1.1 or HTTP/2 by ALPN; {h3}), with a self-signed certificate.\n"
        f"Trust it: curl --cacert {cert}; Python: SSL_CERT_FILE={cert}; system-wide on Debian:\n"
        f"  sudo cp {cert} {trust_system}\n\n"
        f"  curl -N --http2 --cacert {cert} {base}/v1/chat/completions \\\n"
        f"    -H 'content-type: application/json' -d '{body}'\n\n"
        f"  {python} - <<'EOF'\n{client}EOF\n"
    )


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
    tls = config.server.tls
    if tls is not None and ensure_certificate(tls):
        print(f"made a self-signed certificate for the demo: {Path(tls.cert).resolve()}", flush=True)
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
        text = examples(config.server.host, config.server.port, model)
        if config.server.tls is not None:
            text += tls_examples(config.server.tls, model)
        print(text, flush=True)
    else:
        listening.cancel()
    await serving
