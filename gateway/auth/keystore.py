"""The key store: a YAML file of API-key records, keyed by the key's hash, never the key itself.

A record says who a caller is (``id``, safe to log and to use as a metric label), which tier it is
in, which models it may use, which rights it holds and until when. Lookups hash the presented key
once and find its record in a dict, so a request costs O(1) however many keys there are. The file
is re-read when it changes (``watch``): the new set is swapped in whole, and a file that does not
parse leaves the last good set in force, so a half-edited file never locks everyone out.

Keys are 256-bit random strings, not passwords: a plain SHA-256 is enough to make the stored
hash useless to whoever reads the file, and costs microseconds per request (a slow password hash
would cost milliseconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import secrets
import tempfile
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gateway.config import ConfigError, QuotaConfig

log = logging.getLogger("sluicegate.auth")

KEY_PREFIX = "sk-sg-"
HASH_PREFIX = "sha256:"
RIGHTS = frozenset({"admin", "variant_override"})
_HASH = re.compile(r"^sha256:[0-9a-f]{64}$")
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")  # a metric label and a log field: short, no spaces


def new_key() -> str:
    """A fresh API key: 256 random bits, URL-safe, with a prefix that secret scanners can spot."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    """How a key is written in the store: ``sha256:`` and the hex digest of its UTF-8 bytes."""
    return HASH_PREFIX + hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """One key's identity and permissions (everything but the key)."""

    id: str
    tier: str | None
    models: frozenset[str] | None  # None: any model
    rights: frozenset[str]
    expires: float | None  # epoch seconds; None: never
    quota: QuotaConfig | None  # None: the tier's, else quotas.default

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models

    def expired(self, now: float) -> bool:
        return self.expires is not None and now >= self.expires

    def has_right(self, name: str) -> bool:
        return name in self.rights


class KeyStoreError(ConfigError):
    """A key store that cannot be used, in one sentence: the file, the record, what is wrong."""


class _Record(BaseModel):
    """A record as written in the file (validated, then turned into a ``KeyRecord``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    hash: str
    tier: str | None = None
    models: list[str] | None = None
    rights: list[str] = Field(default_factory=list)
    expires: datetime | None = None
    quota: QuotaConfig | None = None

    @field_validator("id")
    @classmethod
    def _id(cls, value: str) -> str:
        if not _ID.match(value):
            raise ValueError(
                "must be 1-64 letters, digits, '.', '_', '@' or '-', starting with a letter or digit"
            )
        return value

    @field_validator("hash")
    @classmethod
    def _hash(cls, value: str) -> str:
        if not _HASH.match(value):
            raise ValueError("must be 'sha256:' and 64 lowercase hex digits (the store never holds keys)")
        return value

    @field_validator("rights")
    @classmethod
    def _rights(cls, values: list[str]) -> list[str]:
        unknown = sorted(set(values) - RIGHTS)
        if unknown:
            raise ValueError(f"unknown right(s) {', '.join(unknown)}; known: {', '.join(sorted(RIGHTS))}")
        return values


def _epoch(moment: datetime) -> float:
    """A naive datetime is UTC (the CLI writes UTC with a ``Z``)."""
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def _problem(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(part) for part in err["loc"]) or "record"
        parts.append(f"{where!r}: {err['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)


def parse_records(data: Any, source: str, tiers: Collection[str] | None) -> dict[bytes, KeyRecord]:
    """The store's records by SHA-256 digest, or ``KeyStoreError``. ``tiers``: the config's tier
    names, which each record's tier must be one of (None: not checked, as ``sluicegate keys`` does
    without a config)."""
    # 'keys:' must be a list, even an empty one ('keys: []'): a file cut short after 'keys:' (an
    # editor writing in place) is an error, not a store that locks everyone out.
    if not isinstance(data, dict) or not isinstance(data.get("keys"), list):
        raise KeyStoreError(
            f"key store {source} must be a mapping with a 'keys:' list of key records ('keys: []' for none)."
        )
    extra = sorted(set(data) - {"keys"})
    if extra:
        raise KeyStoreError(
            f"key store {source} has unknown top-level key(s) {', '.join(extra)}; only 'keys'."
        )
    by_hash: dict[bytes, KeyRecord] = {}
    ids: set[str] = set()
    for index, raw in enumerate(data["keys"]):
        name = raw.get("id") if isinstance(raw, dict) else None
        where = f"key store {source}, record {index}" + (f" ({name!r})" if isinstance(name, str) else "")
        if not isinstance(raw, dict):
            raise KeyStoreError(f"{where} must be a mapping (id, hash, tier, ...).")
        try:
            record = _Record.model_validate(raw)
        except ValidationError as exc:
            raise KeyStoreError(f"{where}: {_problem(exc)}.") from None
        if record.id in ids:
            raise KeyStoreError(f"{where}: the id {record.id!r} is used twice; ids must be unique.")
        digest = bytes.fromhex(record.hash.removeprefix(HASH_PREFIX))
        if digest in by_hash:
            raise KeyStoreError(
                f"{where}: the same hash as {by_hash[digest].id!r}: one key cannot have two records."
            )
        if record.tier is not None and tiers is not None and record.tier not in tiers:
            known = ", ".join(sorted(tiers)) or "none are configured"
            raise KeyStoreError(f"{where}: tier {record.tier!r} is not in the config's tiers ({known}).")
        ids.add(record.id)
        by_hash[digest] = KeyRecord(
            id=record.id,
            tier=record.tier,
            models=None if record.models is None else frozenset(record.models),
            rights=frozenset(record.rights),
            expires=None if record.expires is None else _epoch(record.expires),
            quota=record.quota,
        )
    return by_hash


def read_file(path: Path) -> Any:
    """The file's YAML, or ``KeyStoreError`` (missing: how to make one)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise KeyStoreError(
            f"key store {path} does not exist: create a key with `sluicegate keys create --file {path} "
            "--id NAME`, or run with `--no-auth` (or `auth: {enabled: false}`) for a local experiment."
        ) from None
    except OSError as exc:
        raise KeyStoreError(f"cannot read key store {path}: {exc.strerror or exc}.") from None
    except UnicodeDecodeError as exc:
        raise KeyStoreError(
            f"key store {path} is not UTF-8 text: byte {exc.start} cannot be decoded."
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or exc
        raise KeyStoreError(f"key store {path} is not valid YAML{where}: {problem}.") from None
    except (ValueError, TypeError, RecursionError) as exc:  # PyYAML's timestamp constructor, deep nesting
        raise KeyStoreError(f"key store {path} has a value YAML cannot read: {exc}.") from None


def write_file(path: Path, records: list[Mapping[str, Any]]) -> None:
    """Replace the store with ``records`` atomically (a temporary file in the same directory, then
    ``os.replace``), mode 0600: a gateway re-reading it sees the old file or the new, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump({"keys": [dict(record) for record in records]}, sort_keys=False)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            os.fchmod(out.fileno(), 0o600)
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # the rename itself survives a crash
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _signature(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class KeyStore:
    """The keys in force, and the loop that keeps them in step with the file."""

    def __init__(
        self,
        path: Path,
        records: dict[bytes, KeyRecord],
        tiers: Collection[str] | None,
        reload_interval_s: float = 1.0,
        signature: tuple[int, int, int] | None = None,
    ) -> None:
        self.path = path
        self.tiers = None if tiers is None else frozenset(tiers)
        self.reload_interval_s = reload_interval_s
        self.reloads = 0  # successful re-reads after a change (for metrics)
        self.reload_errors = 0  # changes that did not parse (the last good keys stayed)
        self._records = records
        self._signature = signature

    @classmethod
    def load(
        cls, path: str | Path, tiers: Collection[str] | None, reload_interval_s: float = 1.0
    ) -> KeyStore:
        """Read and validate the store (``KeyStoreError`` when it cannot be used)."""
        path = Path(path)
        signature = _signature(path)
        records = parse_records(read_file(path), str(path), tiers)
        return cls(path, records, tiers, reload_interval_s, signature)

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[KeyRecord]:
        return iter(list(self._records.values()))

    def lookup(self, key: str | bytes) -> KeyRecord | None:
        """The record of ``key`` (as the client sent it), or None for a key the store does not
        hold. Expiry is the caller's to check (``record.expired(time.time())``)."""
        raw = key.encode() if isinstance(key, str) else key
        return self._records.get(hashlib.sha256(raw).digest())

    async def refresh(self) -> bool:
        """Re-read the file if it changed since it was last read; True when new keys are in force.

        The read and parse run on a thread (a large file must not stall streams). A file that is
        missing or does not parse is reported once per change, and the last good keys stay."""
        signature = _signature(self.path)
        if signature == self._signature:
            return False
        self._signature = signature
        try:
            records = await asyncio.to_thread(self._read)
        except KeyStoreError as exc:
            self.reload_errors += 1
            log.warning("key store not reloaded, keeping the %d keys in force: %s", len(self._records), exc)
            return False
        self._records = records  # one assignment: a lookup sees the old dict or the new
        self.reloads += 1
        log.info("key store reloaded: %d keys", len(records))
        return True

    def _read(self) -> dict[bytes, KeyRecord]:
        return parse_records(read_file(self.path), str(self.path), self.tiers)

    async def watch(self) -> None:
        """Poll the file every ``reload_interval_s`` until cancelled (run it as a task)."""
        while True:
            await asyncio.sleep(self.reload_interval_s)
            try:
                await self.refresh()
            except Exception:  # never let the watcher die: the keys in force stay in force
                self.reload_errors += 1
                log.exception("key store check failed; keeping the keys in force")
