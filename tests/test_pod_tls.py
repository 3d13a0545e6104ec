"""TLS to https:// pods: the gateway verifies the pod against ``upstream.tls.ca_bundle`` and shows
its client certificate (mTLS) on every connection it makes to a pod: requests, health probes,
discovery's ``/v1/models`` and ``/metrics`` scrapes. The pod here is the simulator serving HTTPS
with vLLM's ``--ssl-*`` flags and requiring a client certificate (``--ssl-cert-reqs 2``)."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gateway.config import ConfigError
from gateway.config_load import parse_config
from gateway.pods.credentials import PodAccess
from gateway.pods.prober import probe_get
from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from tests.conftest import FAST, pod_state, wait_for
from transports.pod_client import PodBrokenError, PodClient, PodConnectError

_Key = ec.EllipticCurvePrivateKey

# gateway/app.py (the lead's) must build the registry with PodAccess.from_config(config) and hand the
# discovery sources their credentials; until it does, the gateway process sends no pod key and has
# no TLS settings, and these tests say so. Drop the marker with that wiring.


def _write(path: Path, cert: x509.Certificate, key: _Key) -> tuple[Path, Path]:
    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ))  # fmt: skip
    return path.with_suffix(".pem"), path.with_suffix(".key")


def _cert(
    name: str,
    key: _Key,
    issuer: tuple[x509.Certificate, _Key] | None,
    usage: x509.ObjectIdentifier | None = None,
    sans: list[x509.GeneralName] | None = None,
) -> x509.Certificate:
    """A certificate for ``key``: a CA's own when ``issuer`` is None, else a leaf it signs."""
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer_name, signer = (subject, key) if issuer is None else (issuer[0].subject, issuer[1])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if issuer is None:
        usages = dict.fromkeys(("content_commitment", "key_encipherment", "data_encipherment",
                                "key_agreement", "encipher_only", "decipher_only"), False)  # fmt: skip
        builder = builder.add_extension(
            x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, **usages), critical=True
        ).add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    else:
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(signer.public_key()), critical=False
        )
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(signer, hashes.SHA256())


def _ca(name: str) -> tuple[x509.Certificate, _Key]:
    key = ec.generate_private_key(ec.SECP256R1())
    return _cert(name, key, None), key


def _leaf(
    ca: tuple[x509.Certificate, _Key], name: str, usage: x509.ObjectIdentifier, sans: list[x509.GeneralName]
) -> tuple[x509.Certificate, _Key]:
    key = ec.generate_private_key(ec.SECP256R1())
    return _cert(name, key, ca, usage, sans), key


@dataclass
class Pki:
    ca: Path  # the pods' and the gateway's CA
    server: tuple[Path, Path]  # the pod's certificate: 127.0.0.1 and vllm.internal
    client: tuple[Path, Path]  # the gateway's client certificate
    other_ca: Path  # a CA that signed neither
    other_client: tuple[Path, Path]  # a client certificate from the other CA


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    root = tmp_path_factory.mktemp("pki")
    ca = _ca("sluicegate test pods CA")
    other = _ca("someone else's CA")
    sans = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("vllm.internal")]
    server = _write(root / "server", *_leaf(ca, "pod", ExtendedKeyUsageOID.SERVER_AUTH, sans))
    client = _write(root / "client", *_leaf(ca, "sluicegate", ExtendedKeyUsageOID.CLIENT_AUTH, []))
    intruder = _leaf(other, "intruder", ExtendedKeyUsageOID.CLIENT_AUTH, [])
    other_client = _write(root / "other-client", *intruder)
    ca_path, _ = _write(root / "ca", *ca)
    other_path, _ = _write(root / "other-ca", *other)
    return Pki(ca_path, server, client, other_path, other_client)


@pytest.fixture(scope="module")
def tls_pod(pki: Pki) -> Iterator[PodsimProcess]:
    cert, key = pki.server
    args = ["--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--ssl-ca-certs", str(pki.ca),
            "--ssl-cert-reqs", "2", *FAST]  # fmt: skip
    with PodsimProcess(args) as pod:
        assert pod.url.startswith("https://127.0.0.1:")
        yield pod


def _gateway(pod_url: str, models: tuple[str, ...] = (), **tls: Any) -> GatewayProcess:
    """A gateway before the pod; without ``models``, they come from its /v1/models, over TLS (and
    discovery asks every pod, to learn whether it is reachable, either way)."""
    return GatewayProcess({
        "server": {"host": "127.0.0.1"},
        "discovery": {"refresh_interval_s": 60, "retry_interval_s": 60},
        "upstream": {"tls": {k: str(v) for k, v in tls.items()}},
        "pods": [{"name": "tls-pod", "url": pod_url, "models": list(models)}],
    })  # fmt: skip


def _stream(url: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    chunks = client.chat.completions.create(
        model="llama-8b", messages=[{"role": "user", "content": "hello"}], max_tokens=4, stream=True
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_the_pod_requires_a_client_certificate(tls_pod: PodsimProcess, pki: Pki) -> None:
    """The test's pod is what it claims: no certificate, no answer; the right one, an answer."""
    with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
        httpx.get(tls_pod.url + "/health", verify=ssl.create_default_context(cafile=pki.ca))
    context = ssl.create_default_context(cafile=pki.ca)
    context.load_cert_chain(*pki.client)
    assert httpx.get(tls_pod.url + "/health", verify=context).status_code == 200


def test_with_the_ca_and_a_client_certificate_the_gateway_streams(tls_pod: PodsimProcess, pki: Pki) -> None:
    cert, key = pki.client
    with _gateway(tls_pod.url, ca_bundle=pki.ca, client_cert=cert, client_key=key) as gw:
        state = pod_state(gw.admin_url, "tls-pod")
        assert state["reachable"] and state["last_error"] is None  # discovery over mTLS
        assert _stream(gw.url)
        # the health probes and the /metrics scrapes get through too
        assert wait_for(lambda: pod_state(gw.admin_url, "tls-pod")["last_probe_age_s"] is not None)
        assert wait_for(lambda: pod_state(gw.admin_url, "tls-pod")["load"]["fresh"], timeout_s=10)
        assert pod_state(gw.admin_url, "tls-pod")["health"] == "healthy"


def test_a_certificate_naming_another_host_is_checked_against_server_name(
    tls_pod: PodsimProcess, pki: Pki
) -> None:
    cert, key = pki.client
    localhost = tls_pod.url.replace("127.0.0.1", "localhost")  # not among the certificate's names
    with _gateway(localhost, ca_bundle=pki.ca, client_cert=cert, client_key=key) as gw:
        error = pod_state(gw.admin_url, "tls-pod")["last_error"]
        assert "CERTIFICATE_VERIFY_FAILED" in error and "localhost" in error
    named = {"server_name": "vllm.internal"}
    with _gateway(localhost, ca_bundle=pki.ca, client_cert=cert, client_key=key, **named) as gw:
        assert pod_state(gw.admin_url, "tls-pod")["reachable"]
        assert _stream(gw.url)


def test_without_a_client_certificate_the_pod_is_unreachable_and_says_why(
    tls_pod: PodsimProcess, pki: Pki
) -> None:
    with _gateway(tls_pod.url, ("llama-8b",), ca_bundle=pki.ca) as gw:
        state = pod_state(gw.admin_url, "tls-pod")
        assert not state["reachable"]
        # TLS 1.3: the pod checks the (absent) certificate after our side of the handshake is done,
        # and closes, with the alert or (uvicorn, aiohttp) without it
        assert state["last_error"].startswith("/v1/models: TLS: ")
        assert any(why in state["last_error"] for why in ("CERTIFICATE_REQUIRED", "client certificate"))
        with pytest.raises(openai.APIStatusError) as err:
            _stream(gw.url)
        assert err.value.status_code == 503  # no pod can take it: the model's only pod is unreachable


@pytest.mark.parametrize("whose", ["no CA", "another CA"])
def test_a_pod_certificate_from_an_untrusted_ca_fails_the_handshake(
    tls_pod: PodsimProcess, pki: Pki, whose: str
) -> None:
    cert, key = pki.client
    trust = {} if whose == "no CA" else {"ca_bundle": pki.other_ca}  # no CA: the system's store
    with _gateway(tls_pod.url, client_cert=cert, client_key=key, **trust) as gw:
        state = pod_state(gw.admin_url, "tls-pod")
        assert not state["reachable"]
        assert state["last_error"].startswith("/v1/models: TLS: CERTIFICATE_VERIFY_FAILED")


def test_a_client_certificate_from_another_ca_is_refused_by_the_pod(tls_pod: PodsimProcess, pki: Pki) -> None:
    cert, key = pki.other_client
    with _gateway(tls_pod.url, ca_bundle=pki.ca, client_cert=cert, client_key=key) as gw:
        state = pod_state(gw.admin_url, "tls-pod")
        assert not state["reachable"] and "TLS: " in state["last_error"]


def test_the_probe_thread_uses_the_shared_context(tls_pod: PodsimProcess, pki: Pki) -> None:
    config = parse_config({"upstream": {"tls": {"ca_bundle": str(pki.ca), "client_cert": str(pki.client[0]),
                                                "client_key": str(pki.client[1])}}})  # fmt: skip
    context = PodAccess.from_config(config).context
    result = probe_get(tls_pod.host, tls_pod.port, context, "/health", 5.0)
    assert result.ok, result.detail
    plain = probe_get(tls_pod.host, tls_pod.port, ssl.create_default_context(cafile=pki.ca), "/health", 5.0)
    assert not plain.ok and plain.hard and plain.detail.startswith("TLS: ")


def _context(pki: Pki, ca: Path | None = None, client: tuple[Path, Path] | None = None) -> ssl.SSLContext:
    config = {"ca_bundle": str(ca or pki.ca)}
    if client is not None:
        config |= {"client_cert": str(client[0]), "client_key": str(client[1])}
    return PodAccess.from_config(parse_config({"upstream": {"tls": config}})).context


_CHAT = b'{"model":"llama-8b","messages":[{"role":"user","content":"hi"}],"max_tokens":3,"stream":true}'


async def test_the_pod_client_streams_over_mtls_and_names_what_failed(
    tls_pod: PodsimProcess, pki: Pki
) -> None:
    client = PodClient(5.0, 30.0)
    mtls = _context(pki, client=pki.client)
    path = "/v1/chat/completions"
    try:
        resp = await client.request(tls_pod.host, tls_pod.port, path, [], _CHAT, mtls)
        assert resp.status == 200 and (await resp.read_all()).endswith(b"data: [DONE]\n\n")
        resp.release()
        # a certificate for another name than the one dialled: refused unless told which name to check
        with pytest.raises(PodConnectError, match="TLS handshake failed: CERTIFICATE_VERIFY_FAILED"):
            await client.request("localhost", tls_pod.port, path, [], _CHAT, mtls)
        named = await client.request(
            "localhost", tls_pod.port, path, [], _CHAT, mtls, server_hostname="vllm.internal"
        )
        assert named.status == 200
        named.close()
        untrusting = _context(pki, ca=pki.other_ca, client=pki.client)
        with pytest.raises(PodConnectError, match="TLS handshake failed: CERTIFICATE_VERIFY_FAILED"):
            await client.request(tls_pod.host, tls_pod.port, path, [], _CHAT, untrusting)
        with pytest.raises(PodBrokenError, match="closed the TLS connection without answering"):
            await client.request(tls_pod.host, tls_pod.port, path, [], _CHAT, _context(pki))
    finally:
        await client.close()


# --- bad files stop the gateway at start, naming the file ----------------------------------------


@pytest.mark.parametrize("which", ["ca_bundle", "client_cert", "client_key"])
def test_an_unusable_tls_file_is_a_config_error_naming_it(pki: Pki, tmp_path: Path, which: str) -> None:
    files = {"ca_bundle": str(pki.ca), "client_cert": str(pki.client[0]), "client_key": str(pki.client[1])}
    bad = tmp_path / f"{which}.pem"
    bad.write_text("not PEM\n")
    for path in (str(tmp_path / "missing.pem"), str(bad)):
        config = parse_config({"upstream": {"tls": {**files, which: path}}})
        with pytest.raises(ConfigError) as err:
            PodAccess.from_config(config)
        assert str(err.value).startswith("upstream.tls: ") and path in str(err.value)


def test_the_gateway_refuses_to_start_with_an_unreadable_ca_bundle(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-ca.pem"
    config = {"upstream": {"tls": {"ca_bundle": str(missing)}},
              "pods": [{"name": "p", "url": "https://127.0.0.1:1", "models": ["m"]}]}  # fmt: skip
    gateway = GatewayProcess(config, startup_timeout_s=15)
    with pytest.raises(RuntimeError) as err:
        gateway.start()
    assert f"upstream.tls: cannot read the TLS CA bundle file '{missing}'" in str(err.value)
    assert "Traceback" not in str(err.value)
