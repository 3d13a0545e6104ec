"""One config's request path: every phase object built from the same ``Config``, held together.

A reload (``gateway/reload.py``) builds a new ``RequestPath`` beside the running one and the relay
swaps it in with one assignment. Each request takes the path once, at its start, so it runs on one
config from its first phase to its last, and requests already in flight finish on the old path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gateway.canary.shadow import Shadows
from gateway.client_address import ClientAddress
from gateway.config import Config
from gateway.cors import CorsPolicy
from gateway.deadlines import TimeoutPolicy
from gateway.metrics import GatewayMetrics
from gateway.phases.attempt import Attempt
from gateway.phases.authenticate import Authenticate, KeyLookup
from gateway.phases.limit import Limit
from gateway.phases.pick import Pick
from gateway.phases.route import Route
from gateway.pods.registry import PodRegistry
from gateway.quota import Quotas
from gateway.request_head import HeadReader
from transports.pod_client import PodClient


@dataclass(frozen=True, slots=True)
class RequestPath:
    """The phases, in the order a request meets them, and the settings they read per request."""

    config: Config
    heads: HeadReader
    cors: CorsPolicy
    clients: ClientAddress
    authenticate: Authenticate
    route: Route
    timeouts: TimeoutPolicy
    limit: Limit
    pick: Pick
    attempt: Attempt
    shadow: Shadows
    log_access: bool
    log_json: bool
    max_body: int

    @classmethod
    def build(
        cls,
        config: Config,
        registry: PodRegistry,
        metrics: GatewayMetrics,
        client: Callable[[], PodClient],
        keys: KeyLookup | None,
        quotas: Quotas | None,
        previous: RequestPath | None = None,
    ) -> RequestPath:
        """The path for ``config``; with ``previous`` (a reload), what must outlive a config carries
        over: the retry budget's recent history, the hangup watcher, shadow copies under way."""
        pick = Pick(config, registry, metrics)
        attempt = Attempt(config, registry, metrics, client, pick)
        shadow = Shadows(config, registry, metrics, client)
        if previous is not None:
            if config.retries == previous.config.retries:
                pick.retry_budget = previous.pick.retry_budget
            attempt.hangups = previous.attempt.hangups
            shadow.adopt(previous.shadow)
        server = config.server
        cors_headers = (config.tier_header, config.shedding.criticality_header)
        return cls(
            config=config,
            heads=HeadReader(config),
            cors=CorsPolicy(server.cors, extra_headers=cors_headers),
            clients=ClientAddress(server.trusted_proxies),
            authenticate=Authenticate(config, keys),
            route=Route(config),
            timeouts=TimeoutPolicy(config),
            limit=Limit(config, quotas),
            pick=pick,
            attempt=attempt,
            shadow=shadow,
            log_access=server.access_log,
            log_json=server.access_log_format == "json",
            max_body=server.max_body_bytes,
        )
