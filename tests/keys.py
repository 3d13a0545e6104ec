"""Key stores for system tests: records written as ``sluicegate keys create`` writes them (hashes
only), and the keys themselves handed back to the test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gateway.auth.keystore import hash_key, new_key, read_file, write_file


def key_store(path: Path, *records: dict[str, Any]) -> dict[str, str]:
    """Write a store of ``records`` (each with at least an ``id``) to ``path``; the key of each id."""
    keys = {record["id"]: new_key() for record in records}
    write_file(path, [{**record, "hash": hash_key(keys[record["id"]])} for record in records])
    return keys


def add_key(path: Path, record: dict[str, Any]) -> str:
    """Add one record to the store at ``path`` (one the CLI would refuse, e.g. already expired)."""
    key = new_key()
    records = (read_file(path) or {}).get("keys") or []
    write_file(path, [*records, {**record, "hash": hash_key(key)}])
    return key


def auth_on(path: Path) -> dict[str, Any]:
    """The ``auth`` section of a config whose keys are in ``path`` (re-read quickly, for tests)."""
    return {"enabled": True, "keys_file": str(path), "reload_interval_s": 0.05}
