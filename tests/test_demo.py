"""`make run`'s demo: the examples it prints work as printed, at addresses it listens on, with the
keys it prints; everything stops together; a demo that cannot start says why in one line."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from gateway.auth.keystore import KeyStore, hash_key
from tests.conftest import unused_port
from transports.h3_client import H3ClientConnection

ROOT = Path(__file__).resolve().parents[1]


def _demo_config_on_free_ports(tmp_path: Path) -> tuple[Path, list[int]]:
    """demo.yaml on free ports, its certificate and key store in ``tmp_path``; the ports: the
    gateway's, the pods', the admin listener's."""
    config = yaml.safe_load((ROOT / "config" / "demo.yaml").read_text())
    ports = [unused_port() for _ in range(6)]
    config["admin"]["port"] = ports.pop()
    config["auth"]["keys_file"] = str(tmp_path / "keys" / "keys.yaml")
    config["server"]["port"] = ports[0]
    tls_port = ports.pop()
    config["server"]["tls"].update(
        cert=str(tmp_path / "tls" / "cert.pem"), key=str(tmp_path / "tls" / "key.pem"), port=tls_port
    )
    for pod, port in zip(config["pods"], ports[1:], strict=True):
        pod["url"] = f"http://127.0.0.1:{port}"
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, [*ports, config["admin"]["port"]]


def _refuses(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def _demo(config: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "demo", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _run_demo(config: Path) -> subprocess.CompletedProcess[str]:
    """A demo that is expected not to start: it must end by itself."""
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "demo", "--config", str(config)],
        capture_output=True, text=True, timeout=90, cwd=ROOT,
    )


@dataclass
class Demo:
    proc: subprocess.Popen[str]
    banner: str
    config: Path
    ports: list[int]  # the gateway's, the pods', the admin listener's
    cert: Path
    keys_file: Path

    def printed_key(self, label: str) -> str:
        """The key printed after ``label`` (on the rest of its line)."""
        match = re.search(re.escape(label) + r"[^\n]*?: (sk-sg-[A-Za-z0-9_-]+)\n", self.banner)
        assert match, f"no {label!r} key in the banner:\n{self.banner}"
        return match.group(1)

    def admin_pods(self) -> list[dict[str, object]]:
        admin = self.printed_key("with the admin key")
        answer = httpx.get(
            f"http://127.0.0.1:{self.ports[-1]}/admin/pods", headers={"authorization": f"Bearer {admin}"}
        )
        assert answer.status_code == 200, answer.text
        return answer.json()["pods"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Demo]:
    """One demo for the module; stopping it with Ctrl-C must exit 0 and free every port."""
    tmp_path = tmp_path_factory.mktemp("demo")
    config, ports = _demo_config_on_free_ports(tmp_path)
    proc = _demo(config)
    try:
        lines: list[str] = []
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "".join(lines).count("\nEOF\n") == 3:  # the end of the last (TLS) example
                break
        keys_file = tmp_path / "keys" / "keys.yaml"
        yield Demo(proc, "".join(lines), config, ports, tmp_path / "tls" / "cert.pem", keys_file)
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    assert all(_refuses(port) for port in ports)


@pytest.mark.timeout(90)
def test_demo_serves_the_examples_it_prints(demo: Demo) -> None:
    banner = demo.banner
    assert banner.count("simulated pod pod-") == 3 and "1g.10gb" in banner

    curl = banner[banner.index("curl -N") : banner.index("}'\n") + 2]
    out = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.rstrip().endswith("data: [DONE]")
    assert out.stdout.count('"content":"') > 20

    marker = banner.index(" - <<'EOF'\n")
    start = banner.rindex("\n", 0, marker) + 1
    printed = banner[start : banner.index("\nEOF\n", marker) + 5]  # the python command and its heredoc
    sdk = subprocess.run(["bash", "-c", printed], capture_output=True, text=True, timeout=30)
    assert sdk.returncode == 0, sdk.stderr
    assert len(sdk.stdout.split()) == 24

    # gRPC-Web, as a browser page would speak it, by the negotiating client
    marker = banner.index(" - <<'EOF'\n", banner.index("gRPC-Web"))
    start = banner.rindex("\n", 0, marker) + 1
    printed = banner[start : banner.index("\nEOF\n", marker) + 5]
    grpc = subprocess.run(["bash", "-c", printed], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert grpc.returncode == 0, grpc.stderr
    assert grpc.stdout.rstrip().endswith("<- over grpc-web") and len(grpc.stdout.split()) > 3

    # over TLS: the certificate was made for the demo; curl speaks HTTP/2 to it, and the
    # transports client moves to HTTP/3 once the first answer has advertised it
    assert "made a self-signed certificate" in banner
    tls_curl = banner[banner.index("curl -N --http2") : banner.index("}'\n", banner.index("--http2")) + 2]
    out = subprocess.run(["bash", "-c", tls_curl + " -v"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.rstrip().endswith("data: [DONE]"), out.stderr
    assert "using HTTP/2" in out.stderr
    marker = banner.index(" - <<'EOF'\n", banner.index("--http2"))
    start = banner.rindex("\n", 0, marker) + 1
    printed = banner[start : banner.index("\nEOF\n", marker) + 5]
    client = subprocess.run(["bash", "-c", printed], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert client.returncode == 0, client.stderr
    first, second = client.stdout.splitlines()
    assert first.endswith("<- over h2") and second.endswith("<- over h3")
    assert first.split(" <- ")[0] and first.split(" <- ")[0] == second.split(" <- ")[0]

    # the admin API, on its own listener, as printed with the admin key
    admin = demo.printed_key("with the admin key")
    admin_curl = next(line.split("#")[0] for line in banner.splitlines() if "/admin/pods" in line)
    assert f":{demo.ports[-1]}/admin/pods" in admin_curl and admin in admin_curl
    out = subprocess.run(
        ["bash", "-c", admin_curl + " -sS --fail"], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    pods = json.loads(out.stdout)["pods"]
    assert {p["mig"]["profile"] for p in pods} == {"3g.40gb", "2g.20gb", "1g.10gb"}


def test_the_demo_prints_fresh_keys_and_stores_only_their_hashes(demo: Demo) -> None:
    key, admin = demo.printed_key("Demo API key"), demo.printed_key("with the admin key")
    assert key != admin
    # every example carries the demo key
    assert demo.banner.count(f"Authorization: Bearer {key}") == 2  # curl, cleartext and TLS
    assert demo.banner.count(f"api_key={key!r}") == 3  # the OpenAI SDK, gRPC-Web, the TLS client
    text = demo.keys_file.read_text()
    assert key not in text and admin not in text
    assert hash_key(key) in text and hash_key(admin) in text
    assert demo.keys_file.stat().st_mode & 0o777 == 0o600
    store = KeyStore.load(demo.keys_file, ["demo"])
    record, admin_record = store.lookup(key), store.lookup(admin)
    assert record is not None and record.tier == "demo" and not record.has_right("admin")
    assert admin_record is not None and admin_record.has_right("admin")


def _addresses(host: str) -> list[str]:
    """Where a browser sends a host name: ``localhost`` is both loopbacks (Chromium resolves it
    itself, and for QUIC tries ``::1``), anything else what the resolver says."""
    if host == "localhost":
        return ["127.0.0.1", "::1"]
    return sorted({info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)})


@pytest.mark.timeout(90)
def test_every_printed_url_is_answered_at_every_address_of_its_host(demo: Demo) -> None:
    urls = {
        (parts.scheme, parts.hostname, parts.port)
        for parts in map(urlsplit, re.findall(r"https?://[^/\s'\"]+", demo.banner))
    }
    assert {scheme for scheme, _, _ in urls} == {"http", "https"}
    context = ssl.create_default_context(cafile=str(demo.cert))  # checks the printed host is named
    alt_svc = ""
    for scheme, host, port in sorted(urls):
        assert host is not None and port is not None
        for address in _addresses(host):
            with socket.create_connection((address, port), timeout=5) as sock:
                if scheme == "https":
                    with context.wrap_socket(sock, server_hostname=host):
                        pass
        if scheme == "https":
            chat = {"model": "llama-8b", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
            auth = {"authorization": f"Bearer {demo.printed_key('Demo API key')}"}
            answer = httpx.post(
                f"https://{host}:{port}/v1/chat/completions", json=chat, headers=auth, verify=context
            )
            alt_svc = answer.headers["alt-svc"]  # inference answers advertise HTTP/3
            h3_port = int(re.fullmatch(r'h3=":(\d+)"; ma=\d+', alt_svc).group(1))

            async def quic_handshakes(host: str = host, h3_port: int = h3_port) -> None:
                for address in _addresses(host):  # Alt-Svc keeps the origin's host: same addresses
                    conn = await H3ClientConnection.connect(
                        address, h3_port, server_name=host, verify=demo.cert, handshake_timeout=5
                    )
                    await conn.aclose()

            asyncio.run(quic_handshakes())
    assert alt_svc, "an https URL was printed and it advertised HTTP/3"


@pytest.mark.timeout(120)
def test_a_second_demo_says_why_in_one_line_and_leaves_the_first_alone(demo: Demo) -> None:
    keys = demo.keys_file.read_text()
    second = _run_demo(demo.config)
    assert second.returncode == 3
    assert "Traceback" not in second.stderr
    assert second.stderr.count("\n") == 1, second.stderr  # one line
    message = second.stderr
    assert message.startswith("sluicegate demo: cannot listen on ") and "in use" in message
    assert "another `sluicegate demo`" in message
    for port in demo.ports:  # the gateway's and each pod's port are named
        assert f":{port} " in message
    assert "udp 127.0.0.1:" in message  # HTTP/3
    assert f":{demo.ports[-1]} (the admin listener)" in message
    # the first demo, its keys and its pods are untouched
    assert demo.keys_file.read_text() == keys
    assert len(demo.admin_pods()) == 3
    for port in demo.ports[1:-1]:
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 200


@pytest.mark.timeout(120)
def test_a_pod_simulator_that_fails_stops_the_pods_already_started(tmp_path: Path) -> None:
    config, ports = _demo_config_on_free_ports(tmp_path)
    data = yaml.safe_load(config.read_text())
    data["pods"][2]["mig"]["profile"] = "1g.0gb"  # a valid config, but no KV cache for the simulator
    config.write_text(yaml.safe_dump(data))
    result = _run_demo(config)
    assert result.returncode == 3
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"sluicegate demo: simulated pod pod-c (http://127.0.0.1:{ports[3]})")
    assert "must be positive" in result.stderr  # the simulator's own reason
    # pod-a and pod-b had started (and said so), and are stopped again
    assert "simulated pod pod-a" in result.stdout and "simulated pod pod-b" in result.stdout
    assert all(_refuses(port) for port in ports)


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("127.0.0.1", {"DNS:localhost", "IP:127.0.0.1", "IP:::1"}),
        ("0.0.0.0", {"DNS:localhost", "IP:127.0.0.1", "IP:::1"}),
        ("10.1.2.3", {"DNS:localhost", "IP:127.0.0.1", "IP:::1", "IP:10.1.2.3"}),
    ],
)
def test_the_demo_certificate_names_the_addresses_it_is_reached_at(
    tmp_path: Path, host: str, expected: set[str]
) -> None:
    from cryptography import x509

    from gateway.config import TlsConfig
    from gateway.demo import ensure_certificate

    tls = TlsConfig(cert=str(tmp_path / "c" / "cert.pem"), key=str(tmp_path / "k" / "key.pem"))
    assert ensure_certificate(tls, host) and not ensure_certificate(tls, host)
    cert = x509.load_pem_x509_certificate(Path(tls.cert).read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    found = {f"DNS:{name}" for name in names.get_values_for_type(x509.DNSName)}
    found |= {f"IP:{address}" for address in names.get_values_for_type(x509.IPAddress)}
    assert found == expected
