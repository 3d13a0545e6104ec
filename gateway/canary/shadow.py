"""Shadow traffic: copies of a share of a canary route's requests, sent to one variant (the canary)
and their answers thrown away, so the canary is measured on real requests before anyone depends on it.

A copy is the least important work the gateway does, and it is built so that it can never cost a
caller anything:

- **never delays the client.** It starts after the client's request has its pod, runs on its own
  task over its own pod connection, and reads its answer into nothing (spliced into a no-op sink:
  no wake-up per chunk). The client's task never awaits it.
- **never refuses anybody.** It takes a pod of the shadow variant as *sheddable* work; when none
  would take that (saturated, ejected, half-open, unhealthy), or the route already has
  ``max_in_flight`` copies running (a slow canary cannot pile them up), the copy is skipped and
  counted (outcome ``skipped``), never answered with a 429.
- **never outlives its client.** When the client leaves, the relay cancels the copy, which closes
  its pod connection (that is how a pod learns to stop generating). Otherwise it ends by itself,
  within the request's own deadlines (first token, total).
- **never retried or resumed, never charged, never judged.** It is made after the limit phase and
  never goes through it (no quota), and it has no finish phase: the rollout judge compares what
  callers were *served*, and a copy's samples would count the canary twice for traffic it did not
  carry. Copies have their own series (``sluicegate_shadow_*``), beside the variant series.

Which requests: a draw from ``random.random()`` per request, not a hash of the request id. Nothing
has to agree on a copy (its answer reaches nobody, so there is no stickiness to keep), and the id is
the client's to choose (``x-request-id``): a client that reuses ids would be copied always or never.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

from gateway.admit import ROUTE_PATHS, InferenceRequest, encode_body
from gateway.canary.routing import Router
from gateway.config import Config
from gateway.config_routes import RouteConfig
from gateway.exchange import Exchange
from gateway.metrics import GatewayMetrics
from gateway.phases.attempt import upstream_headers
from gateway.pods.registry import Pod, PodRegistry
from gateway.pods.state import HALF_OPEN
from gateway.stream_relay import read_first_token
from transports import sse
from transports.pod_client import PodClient, PodResponse

_CLIENT_GONE = "client_gone"


def _discard(_chunk: bytes) -> None:
    """The sink of a copy's answer."""


class _Plan:
    """One route's shadow: the variant, its upstream model and pods, the share, the cap, its series."""

    __slots__ = ("duration", "in_flight", "max_in_flight", "metrics", "model", "outcomes", "percent",
                 "pods", "ttft", "variant")  # fmt: skip

    def __init__(self, route: str, config: RouteConfig, metrics: GatewayMetrics) -> None:
        shadow = config.shadow
        assert shadow is not None
        # The route's own choice for this variant, as an override would get it: its model and pods.
        choice = Router(route, config).choose(None, override=shadow.variant, may_override=True)
        self.variant = shadow.variant
        self.model = choice.model
        self.pods = choice.pods
        self.percent = shadow.percent
        self.max_in_flight = shadow.max_in_flight
        self.in_flight = 0
        self.metrics = metrics
        self.ttft = metrics.child(metrics.shadow_time_to_first_token, self.model, self.variant)
        self.duration = metrics.child(metrics.shadow_duration, self.model, self.variant)
        self.outcomes = {
            outcome: metrics.child(metrics.shadow_requests, self.model, self.variant, outcome)
            for outcome in ("ok", "error", "timeout", _CLIENT_GONE, "skipped")
        }


class Shadows:
    """The shadow copies of every route that has ``shadow`` configured; ``active`` when any has."""

    def __init__(
        self, config: Config, registry: PodRegistry, metrics: GatewayMetrics, client: Callable[[], PodClient]
    ) -> None:
        self._plans = {
            model: _Plan(model, route, metrics) for model, route in config.routes.items() if route.shadow
        }
        self.active = bool(self._plans)
        self._registry = registry
        self._client = client
        self._max_event_bytes = config.upstream.max_event_bytes
        self._tasks: set[asyncio.Task[None]] = set()

    def maybe_mirror(self, ex: Exchange, req: InferenceRequest, headers: list[tuple[bytes, bytes]]) -> None:
        """Start a copy of ``req`` (as admitted, before any degrade) when the draw selects it.

        Called once the client's request has its pod; returns at once. The copy's task is kept on
        ``ex.shadow`` so that the relay can end it with the client (``ended``).
        """
        plan = self._plans.get(ex.public_model)
        if plan is None or ex.variant == plan.variant:
            return
        if plan.percent < 100.0 and random.random() * 100.0 >= plan.percent:
            return
        if plan.in_flight >= plan.max_in_flight:
            plan.outcomes["skipped"].inc()
            return
        pod = self._registry.pick(plan.model, criticality="sheddable", pods=plan.pods)
        if pod is not None and pod.outlier.state == HALF_OPEN:
            # its single trial belongs to a caller's request, not to a copy nobody reads
            pod.outlier.trial_out = False
            pod = None
        if pod is None:
            plan.outcomes["skipped"].inc()
            return
        same = req.model == plan.model  # else the shadow variant's own upstream name
        body = req.body if same else encode_body({**req.payload, "model": plan.model})
        task = asyncio.create_task(self._copy(plan, ex, req, pod, body, headers), name=f"shadow {ex.rid}")
        ex.shadow = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    def ended(ex: Exchange) -> None:
        """The client's request is over: a client that left takes its copy with it; otherwise the
        copy goes on to its own end, within the request's deadline."""
        task = ex.shadow
        if task is not None and ex.detail == _CLIENT_GONE and not task.done():
            task.cancel(_CLIENT_GONE)

    def adopt(self, previous: Shadows) -> None:
        """A reload: the copies the previous config started stay this one's to end at ``close``."""
        self._tasks = previous._tasks

    def close(self) -> None:
        """The gateway stops: every copy still running ends now (uncounted)."""
        for task in list(self._tasks):
            task.cancel()

    async def _copy(
        self,
        plan: _Plan,
        ex: Exchange,
        req: InferenceRequest,
        pod: Pod,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
    ) -> None:
        """Send the copy, read its answer into nothing, and count how it went."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        budget = ex.budget
        assert budget is not None
        outcome = "error"
        resp: PodResponse | None = None
        pod.in_flight += 1  # real load on the pod: the picks of callers' requests should see it
        plan.in_flight += 1
        try:
            async with asyncio.timeout_at(ex.deadline):
                async with asyncio.timeout_at(min(start + budget.first_token_s, ex.deadline)):
                    resp = await self._client().request(
                        pod.host,
                        pod.port,
                        ROUTE_PATHS[req.route],
                        upstream_headers(headers, f"{ex.rid}-shadow", pod),
                        body,
                        pod.tls,
                        budget.connect_s,
                        server_hostname=pod.server_name,
                    )
                    if resp.status != 200:
                        return
                    streaming = req.stream and resp.headers.get("content-type", "").startswith(
                        "text/event-stream"
                    )
                    if streaming and not (await read_first_token(resp, self._max_event_bytes))[1]:
                        return
                if streaming:
                    plan.ttft.observe(loop.time() - start)
                resp.splice(_discard)
                await asyncio.wait((resp.done,))  # not awaited directly: a cancel must not cancel it
                if resp.complete:
                    outcome = "ok"
                    plan.duration.observe(loop.time() - start)
        except TimeoutError:
            outcome = "timeout"
        except (ConnectionError, sse.MalformedEvent):
            outcome = "error"  # no connection, a broken answer (PodConnectError, PodBrokenError), bad SSE
        except asyncio.CancelledError as cancel:
            outcome = _CLIENT_GONE if cancel.args == (_CLIENT_GONE,) else ""
            raise
        finally:
            if resp is not None:
                resp.release()  # a complete answer's connection back to the pool; else closed: the pod stops
            pod.in_flight -= 1
            plan.in_flight -= 1
            if outcome:
                plan.outcomes[outcome].inc()
