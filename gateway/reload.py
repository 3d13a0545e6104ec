"""Config reload: the config file read again on SIGHUP, when it changes (``reload.watch``) or on
``POST /admin/reload``, and what may change while streams flow applied at once.

The file is read and validated on a thread by start-up's own code (``gateway.config_load``, with
the command line's flags on top), so a bad file is refused in start-up's words, on one WARNING
line, and the running config stays. What the running process cannot take on without a restart
(its listeners and their limits, TLS, the upstream client, discovery, health, auth, the quota
store, the admin listener, tracing, the header names) is named in a warning and kept as it runs;
the rest goes to ``Relay.reconfigure``, which swaps every phase in with no await in between, so a
request sees one config or the other, and streams in flight finish on the one they started with.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.config import Config, ConfigError, ReloadConfig
from gateway.config_load import parse_config
from gateway.phases.limit import build_quotas
from gateway.pods.host import resync_static

if TYPE_CHECKING:
    from gateway.app import Gateway

log = logging.getLogger("sluicegate.reload")

# Sections a reload applies whole; in the partly reloadable ones, the keys it applies. Everything
# else (a section added later included) needs a restart until someone teaches a component to follow.
_RELOADABLE = frozenset({"routes", "tiers", "timeouts", "retries", "resume", "affinity", "pods", "reload"})
_PARTLY: dict[str, frozenset[str]] = {
    "server": frozenset({
        "access_log", "access_log_format", "cors", "max_body_bytes", "max_messages", "max_choices",
        "max_tokens", "trusted_proxies", "drain_timeout_s",
    }),
    "shedding": frozenset({"default_criticality", "retry_after_max_s"}),
    "quotas": frozenset({"default", "chars_per_token"}),
}


@dataclass(frozen=True, slots=True)
class ConfigSource:
    """Where the running config came from: ``path`` (None: no file, e.g. ``--upstream`` alone) and
    ``load``, which reads it again with the same command-line flags on top."""

    path: str | None
    load: Callable[[], Config]


@dataclass(slots=True)
class Plan:
    """What a reload does: the config that runs after it, the reloadable keys that changed, and a
    line for each change that needs a restart (kept as it runs)."""

    config: Config
    changed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)


def plan(running: Config, loaded: Config) -> Plan:
    """``loaded`` with every change that needs a restart undone (and named), validated whole again.
    A tier may be added or changed but not removed: keys and requests in flight may name it."""
    old, new = running.model_dump(), loaded.model_dump()
    kept: list[str] = []
    for section in Config.model_fields:
        if section in _RELOADABLE:
            continue
        reloadable = _PARTLY.get(section)
        if reloadable is None or not isinstance(old[section], dict):
            if new[section] != old[section]:
                kept.append(_kept(section, old[section]))
                new[section] = old[section]
            continue
        for key, value in old[section].items():
            if key not in reloadable and new[section][key] != value:
                kept.append(_kept(f"{section}.{key}", value))
                new[section][key] = value
    for tier in old["tiers"].keys() - new["tiers"].keys():
        kept.append(f"tiers.{tier} removed: needs a restart (keys and requests may name it); kept")
        new["tiers"][tier] = old["tiers"][tier]
    config = parse_config(new, "the reloaded config")
    return Plan(config, _changed(running, config), kept)


def _kept(key: str, value: Any) -> str:
    shown = "the running one" if isinstance(value, dict | list | tuple) else repr(value)
    return f"{key} changed: needs a restart; kept {shown}"


def _changed(old: Config, new: Config) -> list[str]:
    """The keys that differ, by section (by name for routes and tiers, by key in partly reloadable ones)."""
    changed = []
    for section in Config.model_fields:
        before, after = getattr(old, section), getattr(new, section)
        if before == after:
            continue
        if section in ("routes", "tiers"):
            changed += [f"{section}.{name}" for name in sorted(before.keys() | after.keys())
                        if before.get(name) != after.get(name)]  # fmt: skip
        elif section in _PARTLY:
            changed += [f"{section}.{key}" for key in type(before).model_fields
                        if getattr(before, key) != getattr(after, key)]  # fmt: skip
        else:
            changed.append(section)
    return changed


def file_digest(path: str) -> str | None:
    """The file's content hash (None while it cannot be read, e.g. mid-replace)."""
    try:
        return hashlib.blake2b(Path(path).read_bytes(), digest_size=16).hexdigest()
    except OSError:
        return None


async def file_changes(
    path: str, settings: Callable[[], ReloadConfig], known: Callable[[], str | None]
) -> AsyncIterator[str]:
    """Every ``reload.interval_s`` while ``reload.watch`` is on, the file's hash, yielded when it is
    not ``known()`` (the hash of what was last loaded). One polling policy for a gateway's own
    watch and a worker pool's supervisor, which must see the same changes."""
    while True:
        current = settings()
        await asyncio.sleep(current.interval_s)
        if not current.watch:
            continue
        digest = await asyncio.to_thread(file_digest, path)
        if digest is not None and digest != known():
            yield digest


class ConfigWatcher:
    """Reloads the gateway's config on SIGHUP, on a change of the file, or when asked (admin)."""

    def __init__(self, gateway: Gateway, source: ConfigSource | None) -> None:
        self.gateway = gateway
        self.source = source
        self.last: dict[str, Any] | None = None  # the last reload's outcome, for the admin plane
        self._lock = asyncio.Lock()
        self._digest: str | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._watch: asyncio.Task[None] | None = None
        self._rollouts: asyncio.Task[None] | None = None  # started here when a reload adds the first
        self._ticking = bool(gateway.relay.rollouts.active)  # the app runs their tick (and metrics)
        self._signal = False

    @property
    def path(self) -> str | None:
        return self.source.path if self.source is not None else None

    async def start(self) -> None:
        """SIGHUP's handler, and the file watch when there is a file."""
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGHUP, self._hangup)
            self._signal = True
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread (tests), Windows
            pass
        path = self.path
        if path is not None:
            self._digest = await asyncio.to_thread(file_digest, path)
            self._watch = asyncio.create_task(self._poll(path), name="config-watch")

    async def close(self) -> None:
        if self._signal:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            self._signal = False
        tasks = [t for t in (self._watch, self._rollouts, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._watch = self._rollouts = None

    def _hangup(self) -> None:
        task = asyncio.ensure_future(self.reload("SIGHUP"))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _poll(self, path: str) -> None:
        """A changed file is reloaded (a bad file once: its hash is remembered either way)."""
        async for _ in file_changes(path, lambda: self.gateway.config.reload, lambda: self._digest):
            await self.reload("file changed")

    async def reload(self, why: str) -> dict[str, Any]:
        """Read the file again and apply it; the outcome, as the admin plane shows it."""
        async with self._lock:
            outcome = await self._reload(why)
        outcome["at"] = time.time()
        self.last = outcome
        return outcome

    async def _reload(self, why: str) -> dict[str, Any]:
        source = self.source
        if source is None or source.path is None:
            log.warning("config reload (%s): the gateway runs without a config file; nothing to reload", why)
            return {"outcome": "none", "why": why}
        gateway = self.gateway
        metrics = gateway.metrics
        running = gateway.config
        try:
            change = await asyncio.to_thread(self._read, source, running)
        except ConfigError as exc:
            metrics.config_reloads.labels("error").inc()
            problem = " ".join(str(exc).split())  # one line, whatever the message holds
            log.warning("config reload (%s) refused; the running config stays: %s", why, problem)
            return {"outcome": "error", "why": why, "error": problem}
        for line in change.kept:
            log.warning("config reload (%s): %s", why, line)
        if change.changed:
            await self._apply(running, change.config)
            log.info("config reloaded (%s): %s", why, ", ".join(change.changed))
        else:
            log.info("config reload (%s): nothing to apply", why)
        metrics.config_reloads.labels("ok").inc()
        metrics.config_reloaded.set_to_current_time()
        return {"outcome": "ok", "why": why, "changed": change.changed, "kept": change.kept}

    def _read(self, source: ConfigSource, running: Config) -> Plan:
        """On a thread: the file's hash, and what loading it again would change."""
        assert source.path is not None
        digest = file_digest(source.path)
        try:
            change = plan(running, source.load())
        finally:
            self._digest = digest  # a bad file is refused once, not at every poll
        access = self.gateway.registry.access
        for pod in change.config.pods:  # a pod's key that cannot be had refuses the reload
            access.key_for(pod.credentials)
        return change

    async def _apply(self, running: Config, config: Config) -> None:
        """Swap ``config`` in: the relay's phases, the rollouts, the static pods, all in one step."""
        gateway = self.gateway
        relay, registry = gateway.relay, gateway.registry
        quotas = None
        if relay.quotas is None:
            quotas = build_quotas(config, gateway.metrics)  # the first quota a reload sets
            if quotas is not None:
                await quotas.start()
        # From here on, nothing is awaited: the swap is whole.
        relay.reconfigure(config, quotas)
        if config.pods != running.pods:
            resync_static(registry, running.pods, config.pods)
        tiers = getattr(gateway.keys, "tiers", None)
        if tiers is not None:  # the key store checks each key's tier against the config's
            gateway.keys.tiers = frozenset(config.tiers)
        gateway.config = config
        rollouts = relay.rollouts
        if rollouts.active and not self._ticking:
            self._ticking = True
            gateway.metrics.watch_rollouts(rollouts)
            self._rollouts = asyncio.create_task(rollouts.run(), name="rollouts")
