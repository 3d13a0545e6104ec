"""Pods from DNS: a headless Service's name resolves to one address per ready pod.

Why: not every deployment lets the gateway read the Kubernetes API (no RBAC, another orchestrator, a
plain DNS round-robin name), but almost every one can resolve a name. DNS says nothing about models,
MIG slices or device health, so those come from config or the pods' ``/v1/models``; this only keeps
the address set current by resolving again every ``interval_s``, reporting only when it changes.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Mapping, Sequence

from gateway.config import PodCredentials
from gateway.pods.found import KubePod
from gateway.side_server import url_of

log = logging.getLogger("sluicegate.dns")

# "No such name" and "no addresses for it": a headless Service with no ready pods, not a DNS failure.
_EMPTY = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


class DnsDiscovery:
    """Resolves ``host`` (A and AAAA) and reports its pods, named by address, served on ``port``."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        models: Sequence[str] = (),
        labels: Mapping[str, str] | None = None,
        interval_s: float = 5.0,
        credentials: PodCredentials | None = None,
    ) -> None:
        self.host = host
        self.credentials = credentials  # carried into every pod's config
        self.port = port
        self.models = tuple(models)
        self.labels = dict(labels or {})
        self.interval_s = interval_s

    async def resolve(self) -> list[str] | None:
        """The name's addresses, sorted; ``[]`` when it has none, None when DNS could not answer."""
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            if exc.errno in _EMPTY:
                return []
            log.warning("cannot resolve %s: %s; keeping the last pod list", self.host, exc.strerror or exc)
            return None
        return sorted({str(info[4][0]) for info in infos})

    def pods(self, addresses: Sequence[str]) -> list[KubePod]:
        return [
            KubePod(
                name=address,
                url=url_of(address, self.port),
                models=self.models,
                labels=dict(self.labels),
                credentials=self.credentials,
            )
            for address in addresses
        ]

    async def run(self, on_update: Callable[[list[KubePod]], None]) -> None:
        """Resolve until cancelled; ``on_update`` gets the first answer, then each changed address set."""
        last: list[str] | None = None
        while True:
            addresses = await self.resolve()
            if addresses is not None and addresses != last:
                last = addresses
                try:
                    on_update(self.pods(addresses))
                except Exception:
                    log.exception("the pod-list callback failed")
            await asyncio.sleep(self.interval_s)
