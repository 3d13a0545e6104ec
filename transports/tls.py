"""TLS for the gateway's listeners (the server context, ALPN h2 and http/1.1; a self-signed pair)
and for its connections to pods (the client context, with an optional client certificate).

One certificate and key serve both TLS listeners: TCP (HTTP/1.1 and HTTP/2, chosen by ALPN) and
QUIC (HTTP/3, whose TLS 1.3 handshake aioquic does itself from the same PEM files).
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from pathlib import Path

ALPN_TCP = ["h2", "http/1.1"]


class TlsFilesError(ValueError):
    """The certificate or key cannot be read or does not form a usable pair."""


def server_context(cert: str | Path, key: str | Path, alpn: list[str] | None = None) -> ssl.SSLContext:
    """A server ``SSLContext`` from PEM ``cert`` (chain) and ``key`` files, offering ``alpn``.

    TLS 1.2 at least (HTTP/2 requires it, RFC 9113 section 9.2); compression and renegotiation off.
    Raises ``TlsFilesError`` naming the file that could not be used.
    """
    _readable(cert, "certificate")
    _readable(key, "key")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.options |= ssl.OP_NO_COMPRESSION | getattr(ssl, "OP_NO_RENEGOTIATION", 0)
    try:
        context.load_cert_chain(str(cert), str(key))
    except (ssl.SSLError, OSError) as exc:
        raise TlsFilesError(
            f"cannot use certificate {str(cert)!r} with key {str(key)!r}: {exc.strerror or exc}"
        ) from None
    context.set_alpn_protocols(ALPN_TCP if alpn is None else alpn)
    return context


def tls_reason(exc: ssl.SSLError) -> str:
    """A TLS failure in a few words: OpenSSL's reason and, for a certificate, the verifier's why."""
    why = getattr(exc, "verify_message", None)
    reason = exc.reason or str(exc)
    return f"{reason} ({why})" if why else reason


def _readable(path: str | Path, what: str) -> None:
    try:
        with open(path, "rb") as handle:
            handle.read(1)
    except OSError as exc:
        raise TlsFilesError(f"cannot read the TLS {what} file {str(path)!r}: {exc.strerror or exc}") from None


def self_signed(
    directory: str | Path,
    hosts: tuple[str, ...] = ("localhost", "127.0.0.1", "::1"),
    days: int = 30,
) -> tuple[Path, Path]:
    """Write a fresh self-signed certificate and its key (PEM) into ``directory``: (cert, key).

    For demos and tests. The certificate names each of ``hosts`` (DNS names and IP addresses) as a
    subject alternative name and is its own CA, so a client can verify it by trusting the file.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0] if hosts else "sluicegate")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cert_path = directory / "cert.pem"
    key_path = directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    return cert_path, key_path


def client_context(
    ca_bundle: str | Path | None = None,
    client_cert: str | Path | None = None,
    client_key: str | Path | None = None,
    alpn: list[str] | None = None,
) -> ssl.SSLContext:
    """A client ``SSLContext`` that verifies servers against ``ca_bundle`` (PEM; else the system's
    trust store) and, for mutual TLS, presents ``client_cert`` with ``client_key``.

    Built once and shared by every connection: each new context would load the trust store again.
    Hostnames are checked (the caller passes the name as ``server_hostname``). TLS 1.2 at least.
    Raises ``TlsFilesError`` naming the file that could not be used.
    """
    if (client_cert is None) != (client_key is None):
        raise TlsFilesError("a client certificate needs its key, and a key its certificate")
    if ca_bundle is not None:
        _readable(ca_bundle, "CA bundle")
    try:
        context = ssl.create_default_context(
            ssl.Purpose.SERVER_AUTH, cafile=None if ca_bundle is None else str(ca_bundle)
        )
    except (ssl.SSLError, OSError) as exc:
        raise TlsFilesError(f"cannot use CA bundle {str(ca_bundle)!r}: {exc.strerror or exc}") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.options |= ssl.OP_NO_COMPRESSION | getattr(ssl, "OP_NO_RENEGOTIATION", 0)
    if client_cert is not None and client_key is not None:
        _readable(client_cert, "client certificate")
        _readable(client_key, "client key")
        try:
            context.load_cert_chain(str(client_cert), str(client_key))
        except (ssl.SSLError, OSError) as exc:
            raise TlsFilesError(
                f"cannot use client certificate {str(client_cert)!r} with key {str(client_key)!r}: "
                f"{exc.strerror or exc}"
            ) from None
    if alpn:
        context.set_alpn_protocols(alpn)
    return context
