"""``sluicegate demo``: simulated pods on MIG slices plus the gateway, in one command.

For each configured pod on a loopback address, a pod simulator is started with that pod's port,
models and MIG identity; then the gateway serves in front of them and prints examples that work
as printed, with the address it listens on (not a name that may resolve elsewhere: browsers send
``localhost`` to ``::1`` too). With auth on (as in ``config/demo.yaml``), each start writes a fresh
key store with a demo key and an admin key, and prints both with the examples that use them: a key
is shown once and stored only as its hash, so old demo keys stop working. Everything stops together
on Ctrl-C. A demo that cannot start (a
port taken, say by another demo; a simulator that fails) says why in one line, stops the pods it
had started and exits 3.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import json
import shlex
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from gateway.auth.keystore import hash_key, new_key, write_file
from gateway.config import AdminConfig, Config, ConfigError, PodConfig, TlsConfig
from gateway.rlimits import raise_open_file_limit
from gateway.server import build_server
from loadtest.podsim.launch import PodsimProcess, PodsimStartError

# Realistic-looking speeds for a person watching tokens arrive.
DEMO_SPEEDS = ("--ttft-ms", "120", "--itl-ms", "40")
CERT_HOSTS = ("localhost", "127.0.0.1", "::1")
START_FAILURE = 3  # as `sluicegate serve` when a port is taken
DEMO_TIER = "demo"  # the tier of the demo key, when the config has one


@dataclass(frozen=True)
class DemoKeys:
    """The keys a demo start made: shown once, in the printed examples."""

    demo: str  # inference, in the demo tier
    admin: str  # the admin API (the admin right), on the admin listener


def write_demo_keys(config: Config) -> DemoKeys | None:
    """A fresh key store at ``auth.keys_file`` holding a demo key and an admin key (None when auth is
    off). Written whole (``os.replace``), so it replaces a previous demo's keys atomically."""
    if not config.auth.enabled:
        return None
    keys = DemoKeys(demo=new_key(), admin=new_key())
    tier = DEMO_TIER if DEMO_TIER in config.tiers else None
    records = [
        {"id": "demo", "hash": hash_key(keys.demo), "tier": tier, "models": None, "rights": [],
         "expires": None, "quota": None},
        {"id": "demo-admin", "hash": hash_key(keys.admin), "tier": None, "models": None,
         "rights": ["admin"], "expires": None, "quota": None},
    ]
    try:
        write_file(Path(config.auth.keys_file), records)
    except OSError as exc:
        raise DemoStartError(
            f"cannot write the demo's key store {config.auth.keys_file!r}: {exc.strerror or exc}"
        ) from None
    return keys


class DemoStartError(Exception):
    """Why the demo cannot start, in one line for the operator."""


def advertised_host(host: str) -> str:
    """How to reach a listener bound to ``host`` in a URL: the address itself (a wildcard through
    its family's loopback), IPv6 in brackets."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"[{host}]" if ":" in host else host


def _bind_error(host: str, port: int, kind: socket.SocketKind) -> str | None:
    """Why ``host``:``port`` cannot be bound (None when it can), tried the way the servers bind."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=kind, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"cannot resolve {host!r}: {exc.strerror}"
    for family, _, _, _, address in infos:
        with socket.socket(family, kind) as sock:
            if kind == socket.SOCK_STREAM:  # as asyncio and uvicorn do: TIME_WAIT is no obstacle
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                    continue  # e.g. ::1 on a machine without IPv6: nothing would listen there
                return "in use" if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc)
    return None


def check_ports(config: Config, simulated: list[PodConfig]) -> None:
    """Raise ``DemoStartError`` naming every port the demo needs that cannot be bound now, before
    anything starts (a second demo finds them all taken by the first)."""
    wanted: list[tuple[str, int, socket.SocketKind, str]] = []
    for pod in simulated:
        parts = urlsplit(pod.url)
        wanted.append((parts.hostname or "127.0.0.1", parts.port or 80, socket.SOCK_STREAM, pod.name))
    server = config.server
    wanted.append((server.host, server.port, socket.SOCK_STREAM, "the gateway"))
    if server.tls is not None:
        wanted.append((server.host, server.tls.port, socket.SOCK_STREAM, "the gateway, TLS"))
        if server.tls.h3:
            h3_port = server.tls.h3_port if server.tls.h3_port is not None else server.tls.port
            wanted.append((server.host, h3_port, socket.SOCK_DGRAM, "the gateway, HTTP/3"))
    if config.admin.enabled:
        wanted.append((config.admin.host, config.admin.port, socket.SOCK_STREAM, "the admin listener"))
    problems: dict[str, list[str]] = {}
    for host, port, kind, what in wanted:
        if port == 0:
            continue
        error = _bind_error(host, port, kind)
        if error is not None:
            proto = "udp" if kind == socket.SOCK_DGRAM else "tcp"
            problems.setdefault(error, []).append(f"{proto} {advertised_host(host)}:{port} ({what})")
    if not problems:
        return
    text = "; ".join(f"{', '.join(where)}: {error}" for error, where in problems.items())
    hint = ""
    if "in use" in problems:
        hint = (
            " - is another `sluicegate demo` running? Stop it, or give this one other ports "
            "(--port for the gateway, a --config FILE for the rest)"
        )
    raise DemoStartError(f"cannot listen on {text}{hint}")


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


def ensure_certificate(tls: TlsConfig, host: str = "127.0.0.1") -> bool:
    """Make a self-signed certificate and key at the configured paths when either is missing.

    True when a new pair was made. The pair names localhost, 127.0.0.1, ::1 and the listening
    ``host`` (as IP addresses, so that a client of the printed https://127.0.0.1 URL can check it),
    and is its own CA, so a client trusts it by trusting the file.
    """
    cert, key = Path(tls.cert), Path(tls.key)
    if cert.is_file() and key.is_file():
        return False
    from transports.tls import self_signed

    listening = advertised_host(host).strip("[]")
    hosts = CERT_HOSTS if listening in CERT_HOSTS else (*CERT_HOSTS, listening)
    made_cert, made_key = self_signed(cert.parent, hosts=hosts, days=365)
    if made_cert != cert:
        made_cert.replace(cert)
    if made_key != key:
        key.parent.mkdir(parents=True, exist_ok=True)
        made_key.replace(key)
    return True


def _auth_header(api_key: str | None) -> str:
    """curl's flag carrying the key (nothing with auth off)."""
    return f" -H 'Authorization: Bearer {api_key}'" if api_key else ""


def tls_examples(tls: TlsConfig, model: str, host: str = "127.0.0.1", api_key: str | None = None) -> str:
    """How to trust the demo's certificate, and a request over each TLS transport."""
    cert_path = str(Path(tls.cert).resolve())
    cert = shlex.quote(cert_path)
    base = f"https://{advertised_host(host)}:{tls.port}"
    h3 = f"HTTP/3 on UDP {tls.h3_port or tls.port}" if tls.h3 else "no HTTP/3"
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_tokens": 8},
        separators=(",", ":"),
    )
    hi = "[{'role': 'user', 'content': 'Hi'}]"
    client = (
        "from transports.client import SyncSluicegateClient\n"
        f"with SyncSluicegateClient('{base}', verify={cert_path!r}{_key_argument(api_key)}) as client:\n"
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
        f"    -H 'content-type: application/json'{_auth_header(api_key)} -d '{body}'\n\n"
        f"  {python} - <<'EOF'\n{client}EOF\n"
    )


def _key_argument(api_key: str | None) -> str:
    return f", api_key={api_key!r}" if api_key else ""


def examples(host: str, port: int, model: str, keys: DemoKeys | None = None,
             admin: AdminConfig | None = None) -> str:
    """The requests printed once the gateway listens: curl, the OpenAI SDK and gRPC-Web (the
    negotiating client), with the demo key; the admin API with the admin key."""
    base = f"http://{advertised_host(host)}:{port}"
    api_key = keys.demo if keys else None
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
        f"client = OpenAI(base_url='{base}/v1', api_key={api_key or 'unused'!r})\n"
        f"stream = client.chat.completions.create(model='{model}', stream=True, max_tokens=24,\n"
        "    messages=[{'role': 'user', 'content': 'Tell me about MIG slices.'}])\n"
        "for chunk in stream:\n"
        "    if chunk.choices:\n"
        "        print(chunk.choices[0].delta.content or '', end='', flush=True)\n"
        "print()\n"
    )
    hi = "[{'role': 'user', 'content': 'Hi'}]"
    grpc_web = (
        "from transports.client import SyncSluicegateClient\n"
        f"with SyncSluicegateClient('{base}'{_key_argument(api_key)}, transport='grpc-web') as client:\n"
        f"    with client.stream_chat('{model}', {hi}, max_tokens=8) as stream:\n"
        "        print(''.join(stream), '<- over', stream.transport)\n"
    )
    python = shlex.quote(sys.executable)
    text = f"\nSluicegate is serving on {base} in front of simulated pods.\n"
    if keys is not None:
        text += f"Demo API key (tier {DEMO_TIER}; shown once, new at every start): {keys.demo}\n"
    text += (
        f"\n  curl -N {base}/v1/chat/completions -H 'content-type: application/json'"
        f"{_auth_header(api_key)} \\\n"
        f"    -d '{body}'\n\n"
        f"  {python} - <<'EOF'\n{sdk}EOF\n\n"
        f"gRPC-Web (what a browser page speaks), with the negotiating client:\n\n"
        f"  {python} - <<'EOF'\n{grpc_web}EOF\n"
    )
    if admin is not None and admin.enabled:
        admin_base = f"http://{advertised_host(admin.host)}:{admin.port}"
        text += f"\nThe admin API and metrics listen on {admin_base} only"
        text += f", with the admin key: {keys.admin}\n\n" if keys is not None else ":\n\n"
        text += (
            f"  curl{_auth_header(keys.admin if keys else None)} {admin_base}/admin/pods"
            "     # pods, MIG slices and live state\n"
            f"  curl {admin_base}/metrics        # Prometheus metrics\n"
        )
    return text


def run_demo(config: Config, log_level: str = "info") -> int:
    """Run until Ctrl-C (0); a start that fails is one line on stderr and status 3 (2: bad TLS files)."""
    raise_open_file_limit()
    simulated = [pod for pod in config.pods if _is_loopback(pod.url)]
    sims: list[PodsimProcess] = []
    try:
        check_ports(config, simulated)
        keys = write_demo_keys(config)  # after the port check: a second demo leaves the first's keys
        tls = config.server.tls
        if tls is not None and _make_certificate(tls, config.server.host):
            print(f"made a self-signed certificate for the demo: {Path(tls.cert).resolve()}", flush=True)
        for pod in simulated:
            sim = _start_pod(pod)
            sims.append(sim)
            mig = f" on {pod.mig.profile} slice {pod.mig.mig_uuid}" if pod.mig else ""
            print(f"simulated pod {pod.name} at {sim.url}{mig}", flush=True)
        model = next((m for pod in config.pods for m in pod.models), "llama-8b")
        asyncio.run(_serve_and_announce(config, log_level, model, keys))
    except KeyboardInterrupt:
        pass  # Ctrl-C, while starting or serving: everything stops below
    except DemoStartError as exc:
        print(f"sluicegate demo: {exc}", file=sys.stderr, flush=True)
        return START_FAILURE
    except ConfigError as exc:  # the TLS pair cannot be used
        print(f"sluicegate demo: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        for sim in sims:
            sim.close()
    return 0


def _make_certificate(tls: TlsConfig, host: str) -> bool:
    try:
        return ensure_certificate(tls, host)
    except OSError as exc:
        raise DemoStartError(
            f"cannot write the demo's certificate {tls.cert!r}: {exc.strerror or exc}"
        ) from None


def _start_pod(pod: PodConfig) -> PodsimProcess:
    """A running simulator for ``pod``, or ``DemoStartError`` with the simulator's own last words."""
    sim = PodsimProcess(podsim_args(pod))
    try:
        return sim.start()
    except PodsimStartError:
        code = sim.proc.returncode if sim.proc is not None else None
        lines = [line.strip() for line in sim.stderr_text().splitlines() if line.strip()]
        sim.close()
        why = lines[-1] if lines else (f"exited with code {code}" if code is not None else "did not listen")
        raise DemoStartError(f"simulated pod {pod.name} ({pod.url}) did not start: {why}") from None


async def _serve_and_announce(config: Config, log_level: str, model: str, keys: DemoKeys | None) -> None:
    server = build_server(config, log_level)
    serving = asyncio.create_task(server.serve())
    listening = asyncio.create_task(server.listening.wait())
    await asyncio.wait((serving, listening), return_when=asyncio.FIRST_COMPLETED)
    if listening.done():
        text = examples(config.server.host, config.server.port, model, keys, config.admin)
        if config.server.tls is not None:
            text += tls_examples(config.server.tls, model, config.server.host, keys.demo if keys else None)
        print(text, flush=True)
    else:
        listening.cancel()
    await serving
