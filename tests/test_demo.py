"""`make run`'s demo: the examples it prints work as printed, and everything stops together."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import unused_port

ROOT = Path(__file__).resolve().parents[1]


def _demo_config_on_free_ports(tmp_path: Path) -> tuple[Path, list[int]]:
    config = yaml.safe_load((ROOT / "config" / "demo.yaml").read_text())
    ports = [unused_port() for _ in range(5)]
    config["server"]["port"] = ports[0]
    tls_port = ports.pop()
    config["server"]["tls"].update(
        cert=str(tmp_path / "tls" / "cert.pem"), key=str(tmp_path / "tls" / "key.pem"), port=tls_port
    )
    for pod, port in zip(config["pods"], ports[1:], strict=True):
        pod["url"] = f"http://127.0.0.1:{port}"
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, ports


def _refuses(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.timeout(90)
def test_demo_serves_the_examples_it_prints(tmp_path: Path) -> None:
    config, ports = _demo_config_on_free_ports(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "demo", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        lines: list[str] = []
        for line in proc.stdout:
            lines.append(line)
            if "".join(lines).count("\nEOF\n") == 2:  # the end of the second (TLS) example
                break
        banner = "".join(lines)
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

        pods = httpx.get(f"http://127.0.0.1:{ports[0]}/admin/pods").json()["pods"]
        assert {p["mig"]["profile"] for p in pods} == {"3g.40gb", "2g.20gb", "1g.10gb"}
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    assert all(_refuses(port) for port in ports)
