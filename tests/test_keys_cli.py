"""``sluicegate keys``: a key is printed once and only its hash is stored; revoke and list work;
every mistake is one line and exit 2; the file is always whole, even with two writers at once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gateway.auth.keystore import KeyStore, hash_key

ROOT = Path(__file__).resolve().parents[1]


def _keys(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "keys", *args],
        capture_output=True, text=True, timeout=60, cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def _create(tmp_path: Path, *args: str) -> str:
    result = _keys("create", *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def _fails(result: subprocess.CompletedProcess[str], expected: str) -> None:
    assert result.returncode == 2, result
    assert result.stderr.startswith("sluicegate keys: ") and expected in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_create_prints_the_key_once_and_stores_its_hash(tmp_path: Path) -> None:
    result = _keys(
        "create", "--id", "alice", "--tier", "gold", "--model", "llama-8b", "--model", "qwen-0.5b",
        "--right", "variant_override", "--expires", "2030-01-01T01:00:00+01:00",
        "--rpm", "60", "--tpm", "10000", "--concurrency", "4", "--on-store-down", "fail_closed",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    key = result.stdout.strip()
    assert result.stdout == key + "\n" and key.startswith("sk-sg-")  # KEY=$(sluicegate keys create ...)
    assert "shown this once" in result.stderr and key not in result.stderr
    path = tmp_path / "keys.yaml"  # the default --file, as auth.keys_file's default
    text = path.read_text()
    assert key not in text and hash_key(key) in text
    assert path.stat().st_mode & 0o777 == 0o600
    record = KeyStore.load(path, ["gold"]).lookup(key)
    assert record is not None and record.id == "alice" and record.tier == "gold"
    assert record.models == {"llama-8b", "qwen-0.5b"} and record.rights == {"variant_override"}
    assert record.expires == 1893456000.0
    assert record.quota is not None and record.quota.requests_per_minute == 60
    assert record.quota.tokens_per_minute == 10000 and record.quota.max_concurrent == 4
    assert record.quota.on_store_down == "fail_closed"
    assert yaml.safe_load(text)["keys"][0]["expires"] == "2030-01-01T00:00:00Z"


def test_list_shows_keys_without_hashes_and_revoke_removes_one(tmp_path: Path) -> None:
    store = tmp_path / "sub" / "keys.yaml"
    alice = _create(tmp_path, "--file", str(store), "--id", "alice", "--tier", "gold")
    ops = _create(
        tmp_path, "--file", str(store), "--id", "ops", "--right", "admin", "--expires", "2099-01-01"
    )
    assert alice != ops
    data = yaml.safe_load(store.read_text())
    data["keys"].append({"id": "old", "hash": hash_key("old"), "expires": "2000-01-01T00:00:00Z"})
    store.write_text(yaml.safe_dump(data))  # the command refuses to make an expired key; one expired since
    listing = _keys("list", "--file", str(store), cwd=tmp_path)
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    assert lines[0].split() == ["ID", "TIER", "MODELS", "RIGHTS", "EXPIRES"]
    assert lines[1].split() == ["alice", "gold", "*", "-", "never"]
    assert lines[2].split() == ["ops", "-", "*", "admin", "2099-01-01T00:00:00Z"]
    assert lines[3].split() == ["old", "-", "*", "-", "2000-01-01T00:00:00Z", "(expired)"]
    assert "sha256" not in listing.stdout and alice not in listing.stdout

    revoked = _keys("revoke", "--file", str(store), "alice", cwd=tmp_path)
    assert revoked.returncode == 0 and "revoked key 'alice'" in revoked.stderr
    loaded = KeyStore.load(store, ["gold"])
    assert loaded.lookup(alice) is None and loaded.lookup(ops) is not None
    _fails(_keys("revoke", "--file", str(store), "alice", cwd=tmp_path), "has no key 'alice'")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--id", "a b"], "'id': must be 1-64 letters"),
        (["--id", "a", "--rpm", "0"], "'quota.requests_per_minute': Input should be greater than or equal"),
        (["--id", "a", "--expires", "soon"], "is not an ISO-8601 time"),
        (["--id", "a", "--expires", "2001-01-01T00:00:00Z"], "is in the past"),
        (["--id", "a", "--tier", "platinum", "--config", "cfg.yaml"], "--tier 'platinum' is not a tier of"),
        (["--id", "a", "--config", "missing.yaml"], "cannot read config file"),
    ],
)
def test_create_refuses_mistakes_in_one_line(tmp_path: Path, args: list[str], expected: str) -> None:
    (tmp_path / "cfg.yaml").write_text("tiers: {gold: {}}\n")
    _fails(_keys("create", *args, cwd=tmp_path), expected)
    assert not (tmp_path / "keys.yaml").exists()  # nothing written


def test_an_existing_id_or_a_broken_store_is_left_alone(tmp_path: Path) -> None:
    _create(tmp_path, "--id", "alice")
    before = (tmp_path / "keys.yaml").read_text()
    _fails(_keys("create", "--id", "alice", cwd=tmp_path), "already has a key 'alice'")
    assert (tmp_path / "keys.yaml").read_text() == before
    broken = "keys: [{id: x, hash: nope}]\n"
    (tmp_path / "keys.yaml").write_text(broken)
    _fails(_keys("create", "--id", "bob", cwd=tmp_path), "record 0 ('x'): 'hash'")
    _fails(_keys("revoke", "x", cwd=tmp_path), "record 0 ('x'): 'hash'")
    _fails(_keys("list", cwd=tmp_path), "record 0 ('x'): 'hash'")
    assert (tmp_path / "keys.yaml").read_text() == broken
    _fails(_keys("list", "--file", "nope.yaml", cwd=tmp_path), "sluicegate keys create --file nope.yaml")


def test_concurrent_creates_all_land(tmp_path: Path) -> None:
    """Each create is a read-modify-write: without the lock, one would overwrite another."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "keys", "create", "--id", f"k{i}"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env,
        )
        for i in range(6)
    ]
    keys = {}
    for i, proc in enumerate(procs):
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        keys[f"k{i}"] = out.strip()
    store = KeyStore.load(tmp_path / "keys.yaml", [])
    assert len(store) == 6
    assert all(store.lookup(key).id == name for name, key in keys.items())  # type: ignore[union-attr]
    assert [p.name for p in tmp_path.iterdir()] == ["keys.yaml"]


async def test_a_running_store_picks_up_a_created_and_a_revoked_key(tmp_path: Path) -> None:
    first = _create(tmp_path, "--id", "first")
    store = KeyStore.load(tmp_path / "keys.yaml", [])
    second = _create(tmp_path, "--id", "second")
    assert store.lookup(second) is None
    assert await store.refresh() and store.lookup(second) is not None
    assert _keys("revoke", "first", cwd=tmp_path).returncode == 0
    assert await store.refresh() and store.lookup(first) is None and store.lookup(second) is not None
