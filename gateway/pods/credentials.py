"""What the gateway shows pods: its own API key (vLLM's ``--api-key``) and its TLS client context.

Both are resolved once at start, so a missing environment variable, an unreadable key file or a
CA bundle that is not PEM stops the gateway with one message naming the config key, instead of
surfacing as 401s or handshake failures on the first requests. A key from a file (a mounted
Kubernetes Secret) is looked at again at most once a second, by its ``stat``, and re-read only when
it changed: a rotated Secret takes effect without a restart, and the request path pays a clock
read. The client's own key never goes to a pod (the relay strips ``authorization``); only these do.
"""

from __future__ import annotations

import logging
import os
import ssl
import time
from collections.abc import Callable, Iterable

from gateway.config import Config, ConfigError, PodCredentials, UpstreamConfig, UpstreamTlsConfig
from transports.tls import TlsFilesError, client_context

log = logging.getLogger("sluicegate.pods")

RECHECK_S = 1.0  # how stale a key file's key may be after the file changed


def _header(key: str) -> bytes:
    """``Bearer KEY`` as header bytes, or ValueError for a key no header can carry."""
    key = key.strip()
    if not key:
        raise ValueError("is empty")
    if any(not 0x20 <= ord(c) < 0x7F for c in key):
        raise ValueError("holds characters an HTTP header cannot carry (only printable ASCII)")
    return b"Bearer " + key.encode("ascii")


class ApiKey:
    """One pod API key as the ``authorization`` header value; from a file, kept current."""

    __slots__ = ("_clock", "_header", "_next_check", "_stamp", "path", "source")

    def __init__(
        self,
        header: bytes,
        source: str,
        path: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._header = header
        self.source = source  # the config key it came from, for log lines
        self.path = path
        self._clock = clock
        self._stamp = _stamp(path) if path is not None else None
        self._next_check = clock() + RECHECK_S

    @classmethod
    def resolve(
        cls, credentials: PodCredentials, where: str, clock: Callable[[], float] = time.monotonic
    ) -> ApiKey:
        """The key ``credentials`` name; ``ConfigError`` naming ``where`` when it cannot be had."""
        if credentials.api_key_env is not None:
            name = credentials.api_key_env
            value = os.environ.get(name)
            if value is None:
                raise ConfigError(
                    f"{where}.api_key_env: the environment variable {name} is not set "
                    "(it should hold the pod's API key)."
                )
            try:
                return cls(_header(value), f"{where}.api_key_env", clock=clock)
            except ValueError as exc:
                raise ConfigError(f"{where}.api_key_env: the environment variable {name} {exc}.") from None
        path = credentials.api_key_file
        assert path is not None  # PodCredentials holds exactly one source
        try:
            header = _header(_read(path))
        except OSError as exc:
            raise ConfigError(
                f"{where}.api_key_file: cannot read the pod API key file {path}: {exc.strerror or exc}."
            ) from None
        except ValueError as exc:
            raise ConfigError(f"{where}.api_key_file: the pod API key file {path} {exc}.") from None
        return cls(header, f"{where}.api_key_file", path, clock)

    @property
    def header(self) -> bytes:
        """``Bearer KEY``; for a key file, what the file held at most ``RECHECK_S`` ago."""
        if self.path is not None:
            now = self._clock()
            if now >= self._next_check:
                self._next_check = now + RECHECK_S
                self._reload()
        return self._header

    def _reload(self) -> None:
        assert self.path is not None
        try:
            stamp = _stamp(self.path)
            if stamp == self._stamp:
                return
            header = _header(_read(self.path))
        except (OSError, ValueError) as exc:
            # Mid-rotation (a Secret's symlink swap) or a bad edit: the last good key is the best bet.
            reason = getattr(exc, "strerror", None) or str(exc)
            log.warning("pod API key file %s: %s; keeping the key read before", self.path, reason)
            self._stamp = None  # look again next time
            return
        self._stamp = stamp
        if header != self._header:
            self._header = header
            log.info("pod API key file %s changed: new key in use (%s)", self.path, self.source)


def _read(path: str) -> str:
    with open(path, encoding="ascii", errors="replace") as handle:
        return handle.read(64 * 1024)


def _stamp(path: str) -> tuple[int, int, int]:
    """What changes when the file does: a Secret update swaps a symlink (a new inode), an editor
    rewrites in place (a new mtime or size)."""
    st = os.stat(path)
    return (st.st_ino, st.st_mtime_ns, st.st_size)


class PodAccess:
    """The gateway's credentials and TLS context for pods, resolved once at start.

    ``key_for`` gives the key a pod's config names, else the default (``upstream.credentials``);
    ``context`` the one client ``SSLContext`` every https:// connection (requests, probes,
    discovery, scrapes) shares; ``server_name`` the name its certificate must carry, when not the host.
    """

    def __init__(
        self,
        default: ApiKey | None = None,
        keys: dict[PodCredentials, ApiKey] | None = None,
        tls: UpstreamTlsConfig | None = None,
        context: ssl.SSLContext | None = None,
    ) -> None:
        self.default = default
        self._keys = dict(keys or {})
        self.server_name = tls.server_name if tls is not None else None
        self._context = context

    @classmethod
    def from_config(cls, config: Config) -> PodAccess:
        """Every key the config names (pods, ``upstream``, discovery sources) and the TLS context;
        ``ConfigError`` naming the key or file that cannot be used."""
        upstream: UpstreamConfig = config.upstream
        named: list[tuple[PodCredentials | None, str]] = [(upstream.credentials, "upstream.credentials")]
        named += [(pod.credentials, f"pods.{i}.credentials") for i, pod in enumerate(config.pods)]
        discovery = config.discovery
        if discovery.kubernetes is not None:
            named.append((discovery.kubernetes.credentials, "discovery.kubernetes.credentials"))
        if discovery.dns is not None:
            named.append((discovery.dns.credentials, "discovery.dns.credentials"))
        keys = _resolve_all(named)
        tls = upstream.tls
        try:
            context = client_context(tls.ca_bundle, tls.client_cert, tls.client_key, alpn=["http/1.1"])
        except TlsFilesError as exc:
            raise ConfigError(f"upstream.tls: {exc}.") from None
        default = keys.get(upstream.credentials) if upstream.credentials is not None else None
        return cls(default, keys, tls, context)

    @property
    def context(self) -> ssl.SSLContext:
        """The client context for https:// pods (the system's trust store when none was configured)."""
        if self._context is None:
            self._context = client_context(alpn=["http/1.1"])
        return self._context

    def key_for(self, credentials: PodCredentials | None) -> ApiKey | None:
        """The key for a pod whose config names ``credentials`` (None: the default, if any)."""
        if credentials is None:
            return self.default
        key = self._keys.get(credentials)
        if key is None:  # a pod config built after start (tests, or a source not in the config)
            key = self._keys[credentials] = ApiKey.resolve(credentials, "credentials")
        return key


def _resolve_all(named: Iterable[tuple[PodCredentials | None, str]]) -> dict[PodCredentials, ApiKey]:
    keys: dict[PodCredentials, ApiKey] = {}
    for credentials, where in named:
        if credentials is not None and credentials not in keys:
            keys[credentials] = ApiKey.resolve(credentials, where)
    return keys
