"""Route: a public model name to one of its variants (stable, canary, ...), for a canary rollout.

The decision itself is ``gateway.canary.routing`` (sans-IO): sticky cohorts by weighted rendezvous
hashing, so every replica agrees without talking and callers only ever move into a growing canary.
This phase reads what it needs from the request (the cohort's key, the override header and whether
the caller's key may use it), records the variant on the exchange, restricts the later picks (the
first, retries and resumes) to the variant's pods, and renames the model when the variant serves it
under another name. Models without a route pass through untouched, at the cost of one dict lookup.
"""

from __future__ import annotations

from gateway.admit import InferenceRequest, encode_body
from gateway.canary.routing import Router, routers
from gateway.config import Config
from gateway.exchange import Exchange
from gateway.phases.authenticate import has_right
from gateway.request_head import RequestHead


class Route:
    """The route phase over ``config.routes`` (one ``Router`` per public model)."""

    def __init__(self, config: Config) -> None:
        self.routers: dict[str, Router] = routers(config.routes)
        # per route, the header names it reads (its sticky header, its override header), as bytes once
        self._headers = {model: _header_names(router) for model, router in self.routers.items()}

    def choose(self, ex: Exchange, req: InferenceRequest, head: RequestHead) -> InferenceRequest:
        """``req`` as its variant's pods get it; ``ex.variant`` and ``ex.selector`` set."""
        router = self.routers.get(req.model)
        if router is None:
            return req
        sticky_key, override_key = self._headers[req.model]
        sticky = override = None
        if sticky_key is not None or override_key is not None:
            for name, value in head.headers:
                if name == sticky_key:
                    sticky = value
                elif name == override_key:
                    override = value.decode("latin-1").strip()
        caller = ex.caller
        key_id = caller.key_id if caller is not None else None
        cohort = router.cohort_key(key_id, req.payload, sticky)
        may_override = caller is not None and has_right(caller, "variant_override")
        choice = router.choose(cohort, override=override, may_override=may_override)
        ex.public_model = req.model
        ex.variant = choice.variant
        ex.selector = choice.pods
        if choice.model == req.model:
            return req
        payload = {**req.payload, "model": choice.model}
        return InferenceRequest(req.route, choice.model, req.stream, encode_body(payload), payload)


def _header_names(router: Router) -> tuple[bytes | None, bytes | None]:
    sticky, override = router.header_name, router.override_header
    return (
        sticky.lower().encode() if sticky is not None else None,
        override.lower().encode() if override else None,
    )
