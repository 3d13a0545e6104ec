"""The key store: records by hash (never keys), O(1) lookups, one clear sentence for a bad file, and
reloads that swap a whole new set in or keep the last good one."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.auth import load_key_store
from gateway.auth.keystore import KeyStore, KeyStoreError, hash_key, new_key, write_file
from gateway.config import ConfigError, QuotaConfig
from gateway.config_load import parse_config

TIERS = ("gold", "free")


def _record(key: str, id: str, **fields: Any) -> dict[str, Any]:
    return {"id": id, "hash": hash_key(key), **fields}


def _store(tmp_path: Path, *records: dict[str, Any]) -> Path:
    path = tmp_path / "keys.yaml"
    if all(isinstance(record, dict) for record in records):
        write_file(path, list(records))
    else:
        path.write_text(yaml.safe_dump({"keys": list(records)}))
    return path


def test_new_keys_are_random_and_stored_as_their_sha256() -> None:
    keys = {new_key() for _ in range(100)}
    assert len(keys) == 100
    for key in keys:
        assert key.startswith("sk-sg-") and len(key) >= 6 + 43  # 256 bits, base64url
    key = next(iter(keys))
    assert hash_key(key) == "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def test_lookup_finds_the_record_of_a_key_and_nothing_for_others(tmp_path: Path) -> None:
    alice, ops = new_key(), new_key()
    path = _store(
        tmp_path,
        _record(
            alice, "alice", tier="gold", models=["llama-8b"], rights=["variant_override"],
            expires="2030-01-01T00:00:00Z", quota={"requests_per_minute": 60, "on_store_down": "fail_closed"},
        ),
        _record(ops, "ops", rights=["admin"]),
    )
    assert alice not in path.read_text() and ops not in path.read_text()  # hashes only
    store = KeyStore.load(path, TIERS)
    assert len(store) == 2
    record = store.lookup(alice)
    assert record is not None and store.lookup(alice.encode()) is record  # str or header bytes
    assert record.id == "alice" and record.tier == "gold"
    assert record.allows("llama-8b") and not record.allows("qwen-0.5b")
    assert record.has_right("variant_override") and not record.has_right("admin")
    assert record.expires == 1893456000.0
    assert not record.expired(1893455999.0) and record.expired(1893456000.0)
    assert record.quota == QuotaConfig(requests_per_minute=60, on_store_down="fail_closed")
    admin = store.lookup(ops)
    assert admin is not None and admin.tier is None and admin.models is None and admin.allows("any-model")
    assert admin.has_right("admin") and admin.expires is None and not admin.expired(time.time())
    assert admin.quota is None
    assert store.lookup(new_key()) is None and store.lookup("") is None
    assert store.lookup(hash_key(alice)) is None  # the stored hash is not a key


@pytest.mark.parametrize(
    ("records", "expected"),
    [
        ([_record("a", "a"), _record("b", "a")], "record 1 ('a'): the id 'a' is used twice"),
        ([_record("a", "a"), _record("a", "b")], "record 1 ('b'): the same hash as 'a'"),
        ([{"id": "a", "hash": "md5:abc"}], "record 0 ('a'): 'hash': must be 'sha256:'"),
        ([{"id": "a", "hash": "sk-sg-plaintext"}], "the store never holds keys"),
        ([_record("a", "a", tier="platinum")], "tier 'platinum' is not in the config's tiers (free, gold)"),
        ([_record("a", "a", rights=["root"])], "unknown right(s) root; known: admin, variant_override"),
        ([_record("a", "a", quota={"requests_per_minute": 0})], "'quota.requests_per_minute': Input"),
        ([_record("a", "a", quota={"rpm": 5})], "'quota.rpm': Extra inputs are not permitted"),
        ([_record("a", "a", expires="someday")], "'expires':"),
        ([_record("a", "a key")], "record 0 ('a key'): 'id': must be 1-64 letters"),
        ([_record("a", "a", secret="x")], "'secret': Extra inputs are not permitted"),
        (["just-a-key"], "record 0 must be a mapping"),
        ([{"hash": hash_key("a")}], "record 0: 'id': Field required"),
    ],
)
def test_a_bad_record_is_one_sentence_naming_the_file_and_record(
    tmp_path: Path, records: list[Any], expected: str
) -> None:
    path = _store(tmp_path, *records)
    with pytest.raises(KeyStoreError) as info:
        KeyStore.load(path, TIERS)
    message = str(info.value)
    assert expected in message and message.startswith(f"key store {path}, record ")
    assert "\n" not in message and isinstance(info.value, ConfigError)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "must be a mapping with a 'keys:' list"),
        ("keys:\n", "must be a mapping with a 'keys:' list"),  # cut short: not an empty store
        ("keys: [{id: a, hash: 'sha256:", "is not valid YAML"),
        ("- id: a\n", "must be a mapping with a 'keys:' list"),
        ("keys: []\nextra: 1\n", "unknown top-level key(s) extra"),
        ("keys: [{id: a, hash: x, expires: 2001-02-30}]\n", "has a value YAML cannot read"),
    ],
)
def test_a_bad_file_is_one_sentence(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises(KeyStoreError, match=r"^key store .*keys\.yaml") as info:
        KeyStore.load(path, TIERS)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_an_empty_store_is_valid(tmp_path: Path) -> None:
    path = _store(tmp_path)
    assert path.read_text() == "keys: []\n"
    assert len(KeyStore.load(path, TIERS)) == 0


def test_a_missing_store_says_how_to_make_one(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(KeyStoreError) as info:
        KeyStore.load(path, TIERS)
    assert f"sluicegate keys create --file {path}" in str(info.value) and "--no-auth" in str(info.value)


def test_load_key_store_follows_the_config(tmp_path: Path) -> None:
    key = new_key()
    path = _store(tmp_path, _record(key, "a", tier="gold"))
    off = parse_config({"auth": {"enabled": False, "keys_file": str(tmp_path / "nope.yaml")}})
    assert load_key_store(off) is None
    on = parse_config({"auth": {"keys_file": str(path), "reload_interval_s": 0.5}, "tiers": {"gold": {}}})
    store = load_key_store(on)
    assert store is not None and store.reload_interval_s == 0.5 and store.lookup(key) is not None
    no_tier = parse_config({"auth": {"keys_file": str(path)}})
    with pytest.raises(ConfigError, match="tier 'gold' is not in the config's tiers"):
        load_key_store(no_tier)
    with pytest.raises(ConfigError, match="does not exist"):
        load_key_store(parse_config({"auth": {"keys_file": str(tmp_path / "nope.yaml")}}))


async def test_refresh_swaps_in_a_changed_file_and_keeps_the_last_good_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "sluicegate.auth")
    old, new = new_key(), new_key()
    path = _store(tmp_path, _record(old, "old"))
    store = KeyStore.load(path, TIERS)
    assert not await store.refresh()  # unchanged: not even read

    write_file(path, [_record(new, "new", tier="free")])
    assert await store.refresh()
    assert store.lookup(old) is None and store.lookup(new) is not None
    assert store.reloads == 1 and store.reload_errors == 0
    assert "key store reloaded: 1 keys" in caplog.text

    for broken in ("keys:\n", "", "keys: [{id: x, hash: 'sha256:12", "keys: [{id: x, hash: nope}]\n"):
        caplog.clear()
        path.write_text(broken)  # in place, as an editor might, cut short or wrong
        assert not await store.refresh()
        assert store.lookup(new) is not None, broken  # the last good keys stay
        assert len(caplog.records) == 1 and caplog.records[0].levelno == logging.WARNING
        assert "keeping the 1 keys in force" in caplog.text
        assert not await store.refresh()  # reported once per change, not every interval
    assert store.reload_errors == 4

    path.unlink()
    assert not await store.refresh() and store.lookup(new) is not None
    write_file(path, [_record(old, "old"), _record(new, "new")])
    assert await store.refresh() and len(store) == 2 and store.reloads == 2
    assert old not in caplog.text and new not in caplog.text  # keys are never logged


async def test_watch_reloads_on_its_own_and_reads_off_the_event_loop(tmp_path: Path) -> None:
    first, second = new_key(), new_key()
    path = _store(tmp_path, _record(first, "first"))
    store = KeyStore.load(path, TIERS, reload_interval_s=0.01)
    readers: list[threading.Thread] = []
    reloaded = asyncio.Event()
    read, refresh = store._read, store.refresh

    def spy_read() -> Any:
        readers.append(threading.current_thread())
        return read()

    async def spy_refresh() -> bool:
        if await refresh():
            reloaded.set()
            return True
        return False

    store._read = spy_read  # type: ignore[method-assign]
    store.refresh = spy_refresh  # type: ignore[method-assign]
    watcher = asyncio.create_task(store.watch())
    try:
        write_file(path, [_record(second, "second")])
        await asyncio.wait_for(reloaded.wait(), 10)
        assert store.lookup(second) is not None and store.lookup(first) is None
        assert readers and all(t is not threading.main_thread() for t in readers)
    finally:
        watcher.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watcher


def test_the_store_file_is_private_and_replaced_whole(tmp_path: Path) -> None:
    path = _store(tmp_path, _record("a", "a"))
    assert path.stat().st_mode & 0o777 == 0o600
    inode = path.stat().st_ino
    write_file(path, [_record("b", "b")])
    assert path.stat().st_ino != inode  # a new file renamed over the old: readers see one or the other
    assert [p.name for p in tmp_path.iterdir()] == ["keys.yaml"]  # no temporary file left
    assert yaml.safe_load(path.read_text())["keys"][0]["id"] == "b"
