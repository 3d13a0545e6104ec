"""Which variant of a route serves a request: sticky cohorts by a stable hash, without I/O.

Every replica must put a caller on the same variant without talking to the others, and a caller
must keep its variant for a whole rollout step (a conversation that flips between models loses
its prompt cache and mixes two versions' answers). So the choice is a pure function of the
caller's cohort key, the route's salt and the weights.

**Weighted rendezvous hashing.** Each variant gets its own 64-bit hash of the key, read as a
point ``u`` in (0, 1), and the caller goes to the variant with the largest ``ln(u) / weight``.
That picks variant *v* with probability ``weight_v / sum(weights)`` exactly, and a variant's
score depends only on its own weight. Hence, when the canary's weight grows, the canary's score
rises for everyone and nobody else's changes: callers only ever move *into* the canary, and no
caller moves between the other variants (a stable caller never lands on a third, "control"
variant). At weight 0 the canary is out of the race, and each of its callers goes back to the
variant it held before it joined: the whole cohort moves back at once. Cumulative ranges over a
single point do the same for two variants, but with three or more, growing one shifts the
boundaries of the others; rendezvous has no such boundaries.

**Salt.** The hash is keyed with the route's name and a salt fixed for the *rollout*, not per
step. A per-step salt would reshuffle the cohorts at every step, sending callers out of the
canary and back (the move-into guarantee holds only because the points stay put). A new rollout
takes a new salt so that it does not try its canary on the same first 1% of callers as the last
one did; the route name in the key does the same across routes.

A caller with no cohort key (no ``user`` field, no header, auth off) is placed per request at
random; a permitted override header forces a variant.
"""

from __future__ import annotations

import hashlib
import math
import random
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from gateway.config_routes import RouteConfig

Reason = Literal["sticky", "random", "override", "only"]
Refusal = Literal["not_permitted", "unknown_variant"]

_REASONS: tuple[Reason, ...] = ("sticky", "random", "only", "override")
_STICKY, _RANDOM, _ONLY, _OVERRIDE = range(4)
_REFUSALS: tuple[Refusal | None, ...] = (None, "not_permitted", "unknown_variant")
_NOT_PERMITTED, _UNKNOWN = 1, 2
_TO_UNIT = 2.0**-53  # 53 bits: exact in a float, so a point is never 0 or 1


@dataclass(frozen=True, slots=True)
class PodSelector:
    """The pods of a variant: every label in ``labels`` must match; with none, the pods that no
    selector in ``excluded`` (the route's other variants) matches."""

    labels: tuple[tuple[str, str], ...]
    excluded: tuple[tuple[tuple[str, str], ...], ...] = ()

    def matches(self, pod_labels: Mapping[str, str]) -> bool:
        if self.labels:
            return _all_match(self.labels, pod_labels)
        return not any(_all_match(other, pod_labels) for other in self.excluded)


def _all_match(wanted: tuple[tuple[str, str], ...], pod_labels: Mapping[str, str]) -> bool:
    return all(pod_labels.get(name) == value for name, value in wanted)


@dataclass(frozen=True, slots=True)
class Choice:
    """A routing decision. ``model`` is the name to send upstream (the route's own when the
    variant renames nothing); ``refused`` says why an override header was ignored."""

    route: str
    variant: str
    model: str
    pods: PodSelector
    reason: Reason
    refused: Refusal | None = None

    @property
    def override_refused(self) -> bool:
        return self.refused is not None


def cohort_key(
    sticky: str,
    key_id: str | None,
    payload: Mapping[str, Any],
    header: bytes | str | None,
    *,
    conversation_messages: int = 2,
) -> str | None:
    """The caller's cohort under ``sticky`` (``RouteConfig.sticky``), or None: placed at random.

    ``key``: the API key's id. ``user``: the OpenAI ``user`` field. ``header:NAME``: that header's
    value (``header``). ``conversation``: a hash of the conversation's opening, the first
    ``conversation_messages`` messages (role and text) before the first assistant reply, which
    every later turn repeats unchanged; a completions request's ``prompt`` counts as one message.
    """
    if sticky == "key":
        return key_id or None
    if sticky == "user":
        user = payload.get("user")
        return user if isinstance(user, str) and user else None
    if sticky.startswith("header:"):
        if isinstance(header, bytes):
            header = header.decode("latin-1")
        return header or None
    if sticky == "conversation":
        return _conversation(payload, conversation_messages)
    raise ValueError(f"unknown sticky kind {sticky!r}")


def _conversation(payload: Mapping[str, Any], limit: int) -> str | None:
    digest = hashlib.blake2b(digest_size=16)
    messages = payload.get("messages")
    if isinstance(messages, list):
        taken = 0
        for message in messages:
            if taken >= limit or not isinstance(message, dict):
                break
            role = message.get("role")
            if role == "assistant" and taken:
                break  # the first reply: turn 1 had only what comes before it
            text = f"{role}\x00{_text_of(message.get('content'))}\x1e"
            digest.update(text.encode("utf-8", "surrogatepass"))
            taken += 1
        return digest.hexdigest() if taken else None
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        digest.update(prompt.encode("utf-8", "surrogatepass"))
        return digest.hexdigest()
    return None


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"] for part in content
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        )
    return ""


class Router:
    """One route's variants and weights, immutable: ``with_weights`` builds the next one, so a
    weight change is a single reference swap and a request sees the old or the new, never half."""

    __slots__ = (
        "_choices",
        "_cumulative",
        "_hasher",
        "_index",
        "_only",
        "_race",
        "_rng",
        "_total",
        "_unpack",
        "config",
        "route",
        "salt",
        "weights",
    )

    def __init__(
        self,
        route: str,
        config: RouteConfig,
        *,
        salt: str = "",
        rng: Callable[[], float] = random.random,
        weights: Mapping[str, float] | None = None,
    ) -> None:
        self.route = route
        self.config = config
        self.salt = salt
        merged = {name: variant.weight for name, variant in config.variants.items()}
        if weights is not None:
            merged.update(_checked(weights, merged))
        self.weights: Mapping[str, float] = MappingProxyType(merged)
        self._rng = rng
        names = list(config.variants)
        self._index = {name: i for i, name in enumerate(names)}
        # Keyed once per Router; each choice copies the keyed state (cheaper than re-keying).
        key = hashlib.blake2b(f"{route}\x00{salt}".encode(), digest_size=32).digest()
        self._hasher = hashlib.blake2b(key=key, digest_size=8 * len(names))
        self._unpack = struct.Struct(f"<{len(names)}Q").unpack
        live = [(i, merged[name]) for i, name in enumerate(names) if merged[name] > 0]
        self._race = tuple((i, 1.0 / weight) for i, weight in live)
        self._total = sum(weight for _, weight in live)
        running, cumulative = 0.0, []
        for i, weight in live:
            running += weight
            cumulative.append((running, i))
        self._cumulative = tuple(cumulative)
        self._only = live[0][0] if len(live) == 1 else None
        self._choices = tuple(
            tuple(
                tuple(
                    Choice(route, name, variant.model or route, _selector(config, name), reason, refused)
                    for refused in _REFUSALS
                )
                for reason in _REASONS
            )
            for name, variant in config.variants.items()
        )

    @property
    def sticky(self) -> str:
        return self.config.sticky

    @property
    def header_name(self) -> str | None:
        """The request header ``cohort_key`` needs (sticky ``header:NAME``), else None."""
        sticky = self.config.sticky
        return sticky.removeprefix("header:") if sticky.startswith("header:") else None

    @property
    def override_header(self) -> str:
        return self.config.override_header

    def cohort_key(
        self, key_id: str | None, payload: Mapping[str, Any], header: bytes | str | None
    ) -> str | None:
        """``cohort_key`` under this route's sticky setting."""
        return cohort_key(
            self.config.sticky, key_id, payload, header,
            conversation_messages=self.config.conversation_messages,
        )

    def choose(
        self, cohort: str | None, *, override: str | None = None, may_override: bool = False
    ) -> Choice:
        """The variant for a caller with cohort key ``cohort`` (None: at random, per request).

        ``override`` (the override header's value) wins only when ``may_override`` (the key holds
        the ``variant_override`` right) and names a variant of this route, whatever its weight: a
        tester can reach a canary that takes no traffic yet. Otherwise the Choice says why not.
        """
        refused = 0
        if override:
            index = self._index.get(override)
            if index is not None and may_override:
                return self._choices[index][_OVERRIDE][0]
            refused = _UNKNOWN if may_override else _NOT_PERMITTED
        if self._only is not None:
            return self._choices[self._only][_ONLY][refused]
        if cohort is None:
            point = self._rng() * self._total
            for bound, index in self._cumulative:
                if point < bound:
                    return self._choices[index][_RANDOM][refused]
            return self._choices[self._cumulative[-1][1]][_RANDOM][refused]
        hasher = self._hasher.copy()
        hasher.update(cohort.encode("utf-8", "surrogatepass"))
        words = self._unpack(hasher.digest())
        best, best_score = 0, -math.inf
        for index, inverse_weight in self._race:
            score = math.log(((words[index] >> 11) + 0.5) * _TO_UNIT) * inverse_weight
            if score > best_score:
                best, best_score = index, score
        return self._choices[best][_STICKY][refused]

    def with_weights(self, weights: Mapping[str, float]) -> Router:
        """A Router with these variants' weights changed (others keep theirs), same salt and RNG."""
        return Router(
            self.route, self.config, salt=self.salt, rng=self._rng, weights={**self.weights, **weights}
        )

    def with_salt(self, salt: str) -> Router:
        """The same route and weights under a new salt: for a new rollout, never for a new step."""
        return Router(self.route, self.config, salt=salt, rng=self._rng, weights=self.weights)


def _checked(weights: Mapping[str, float], known: Mapping[str, float]) -> Mapping[str, float]:
    unknown = [name for name in weights if name not in known]
    if unknown:
        names = ", ".join(map(repr, unknown))
        raise ValueError(f"no variant named {names}; the route has {', '.join(known)}")
    bad = [name for name, weight in weights.items() if not (math.isfinite(weight) and weight >= 0)]
    if bad:
        raise ValueError(f"weights must be finite and not negative: {', '.join(bad)}")
    if not any(weight > 0 for weight in {**known, **weights}.values()):
        raise ValueError("at least one variant needs a weight above 0")
    return weights


def _selector(config: RouteConfig, name: str) -> PodSelector:
    own = config.variants[name].pods
    if own:
        return PodSelector(tuple(sorted(own.items())))
    others = tuple(tuple(sorted(v.pods.items())) for n, v in config.variants.items() if n != name)
    return PodSelector((), others)


def routers(routes: Mapping[str, RouteConfig], *, salt: str = "") -> dict[str, Router]:
    """A Router per public model name of ``Config.routes``."""
    return {route: Router(route, config, salt=salt) for route, config in routes.items()}
