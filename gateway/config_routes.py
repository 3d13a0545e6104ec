"""The canary routes' schema (``routes:``): a public model split into variants, each variant's pods
and weight, its rollout plan and judge, and its shadow traffic.

One concept, apart from the rest of the config because it is read by one part of the gateway
(``gateway/canary/``) and is the part operators edit most (weights, steps) and reload.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from gateway.config_base import Frozen

# Variant names end up in metric labels, log lines and the override header: keep them plain.
_VARIANT_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
MAX_VARIANTS = 8  # one 64-byte blake2b digest gives each variant its own 64-bit hash


class VariantConfig(Frozen):
    """One version of a route's model: the pods that serve it, the model name they know, its share."""

    pods: dict[str, str] = Field(
        default_factory=dict,
        description="pod label selector (all must match); empty: the pods no other variant selects",
    )
    model: str | None = Field(default=None, min_length=1, description="upstream model; default: the route's")
    weight: float = Field(default=0.0, ge=0, allow_inf_nan=False, description="relative share of callers")


class RolloutJudgeConfig(Frozen):
    """The judge's knobs (``gateway.canary.judge.JudgeConfig``), kept here so config stays data."""

    alpha: float = Field(default=0.01, gt=0, lt=1, description="bound on ever failing a good canary per step")
    ttft_tolerance: float = Field(default=0.10, ge=0, allow_inf_nan=False)
    itl_tolerance: float = Field(default=0.10, ge=0, allow_inf_nan=False)
    rate_tolerance: float = Field(default=0.10, ge=0, allow_inf_nan=False)
    rate_margin: float = Field(default=0.005, ge=0, allow_inf_nan=False)
    tau_latency: float = Field(default=0.3, gt=0, allow_inf_nan=False)
    min_samples_to_fail: int = Field(default=20, ge=2)


class RolloutConfig(Frozen):
    """A route's rollout plan (``gateway.canary.rollout``): the canary's weight steps, and the hold and
    sample each step needs before the judge may pass it."""

    steps: tuple[float, ...] = Field(default=(1.0, 5.0, 25.0, 50.0, 100.0), min_length=1)
    min_hold_s: float = Field(default=60.0, ge=0, allow_inf_nan=False)
    min_samples: int = Field(default=100, ge=1, description="clean streams per variant, per step")
    canary: str = Field(default="canary", description="the variant under test")
    judge: RolloutJudgeConfig = RolloutJudgeConfig()
    on_rollback: Literal["finish", "resume"] = "finish"

    @field_validator("steps")
    @classmethod
    def _increasing(cls, steps: tuple[float, ...]) -> tuple[float, ...]:
        if any(not 0.0 < step <= 100.0 for step in steps):
            raise ValueError("rollout steps are canary percentages in (0, 100]")
        if list(steps) != sorted(set(steps)):
            raise ValueError("rollout steps must be strictly increasing")
        if steps[0] >= 100.0:
            raise ValueError("the first rollout step must be below 100: at 100 no stable is left to judge")
        return steps


class ShadowConfig(Frozen):
    """Copies of a share of a route's requests for one variant, answers discarded (``canary/shadow.py``)."""

    variant: str = Field(default="canary", description="the variant that gets the copies")
    percent: float = Field(
        default=100.0, ge=0, le=100, allow_inf_nan=False,
        description="share of the requests some other variant serves that are mirrored",
    )
    max_in_flight: int = Field(default=32, ge=1, description="shadows at once per route; beyond: skipped")


class RouteConfig(Frozen):
    """A public model name split into variants, with sticky cohorts (``gateway.canary.routing``).

    The baseline is the variant named ``stable`` (required): naming it, rather than taking the
    first listed, keeps the baseline from changing when someone reorders the YAML.
    """

    variants: dict[str, VariantConfig]
    sticky: str = Field(
        default="conversation", pattern=r"^(key|user|conversation|header:[a-z0-9-]+)$",
        description="what keeps a caller on its variant",
    )
    override_header: str = Field(default="x-sluicegate-variant", pattern=r"^[a-z0-9-]+$")
    conversation_messages: int = Field(default=2, ge=1, le=64, description="sticky: conversation")
    rollout: RolloutConfig | None = None
    shadow: ShadowConfig | None = None

    @field_validator("variants")
    @classmethod
    def _variants(cls, variants: dict[str, VariantConfig]) -> dict[str, VariantConfig]:
        bad = [name for name in variants if not _VARIANT_NAME.match(name)]
        if bad:
            raise ValueError(
                f"variant name(s) {', '.join(repr(name) for name in bad)} must be lowercase letters, digits "
                "and '_', starting with a letter, at most 32 characters (they become metric labels)"
            )
        if "stable" not in variants:
            named = ", ".join(variants) or "none"
            raise ValueError(f"a route needs a variant named 'stable' (the baseline); it has: {named}")
        if len(variants) > MAX_VARIANTS:
            raise ValueError(f"a route has at most {MAX_VARIANTS} variants, not {len(variants)}")
        if not any(variant.weight > 0 for variant in variants.values()):
            raise ValueError("at least one variant needs a weight above 0, or no caller can be served")
        rest = [name for name, variant in variants.items() if not variant.pods]
        if len(rest) > 1:
            raise ValueError(
                f"variants {', '.join(rest)} all have empty 'pods'; only one may (it takes the pods that "
                "no other variant selects)"
            )
        return variants

    @model_validator(mode="after")
    def _rollout_variants(self) -> RouteConfig:
        # The judge compares two variants; a third would take traffic the plan does not account for.
        if self.rollout is not None:
            canary = self.rollout.canary
            if canary == "stable" or set(self.variants) != {"stable", canary}:
                raise ValueError(
                    f"a rollout needs exactly the variants 'stable' and {canary!r} (rollout.canary); "
                    f"this route has: {', '.join(self.variants)}"
                )
        return self

    @model_validator(mode="after")
    def _shadow_variant(self) -> RouteConfig:
        # Copies come only from requests another variant serves: the route needs one besides it.
        if self.shadow is not None:
            name = self.shadow.variant
            if name not in self.variants or len(self.variants) < 2:
                raise ValueError(
                    f"shadow.variant {name!r} must be one of this route's variants, with another one to "
                    f"serve the requests it copies; this route has: {', '.join(self.variants)}"
                )
        return self
