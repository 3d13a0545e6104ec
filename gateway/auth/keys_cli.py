"""``sluicegate keys``: create, revoke and list the API keys of a key store file.

A new key is printed once, on stdout (so ``KEY=$(sluicegate keys create ...)`` works), and only its
hash is written. Every change rewrites the file atomically, under a lock on its directory, so a
running gateway's reload and a second ``sluicegate keys`` never see half a file.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gateway.auth.keystore import (
    RIGHTS,
    KeyRecord,
    KeyStoreError,
    hash_key,
    new_key,
    parse_records,
    read_file,
    write_file,
)
from gateway.config import ConfigError
from gateway.config_load import load_config

DEFAULT_FILE = "keys.yaml"  # auth.keys_file's default


def add_arguments(parser: argparse.ArgumentParser, formatter: type[argparse.HelpFormatter]) -> None:
    """``create``, ``revoke`` and ``list`` under ``parser``."""
    actions = parser.add_subparsers(dest="keys_action", required=True, metavar="ACTION")

    def action(name: str, summary: str, example: str) -> argparse.ArgumentParser:
        sub = actions.add_parser(
            name, help=summary, description=summary, epilog=f"examples:\n  {example}",
            formatter_class=formatter,
        )
        sub.add_argument(
            "--file", default=DEFAULT_FILE, metavar="PATH",
            help="the key store (the config's auth.keys_file)",
        )
        return sub

    create = action(
        "create", "create a key, print it once and store only its hash",
        "sluicegate keys create --file keys.yaml --id alice --tier gold --model llama-8b --rpm 60",
    )
    create.add_argument("--id", required=True, help="the key's name in logs and metrics (required)")
    create.add_argument("--tier", help="the tier whose timeouts, limits and quota apply")
    create.add_argument(
        "--model", action="append", default=[], metavar="M",
        help="a model the key may use; repeatable (default: none named, so any model)",
    )
    create.add_argument(
        "--right", action="append", default=[], choices=sorted(RIGHTS), help="a right it holds; repeatable"
    )
    create.add_argument("--expires", metavar="ISO8601", help="e.g. 2027-01-01T00:00:00Z (default: never)")
    create.add_argument("--rpm", type=int, metavar="N", help="its own requests per minute (over its tier's)")
    create.add_argument("--tpm", type=int, metavar="N", help="its own tokens per minute")
    create.add_argument("--concurrency", type=int, metavar="N", help="its own streams at once")
    create.add_argument(
        "--on-store-down", choices=("fail_open", "fail_closed"),
        help="its quota's policy while Redis is down (default: fail_open)",
    )
    create.add_argument(
        "--config", metavar="FILE", help="check --tier against this gateway config's tiers"
    )
    revoke = action("revoke", "remove a key from the store", "sluicegate keys revoke --file keys.yaml alice")
    revoke.add_argument("id", help="the key's id")
    action("list", "list the keys (never their hashes)", "sluicegate keys list --file keys.yaml")


def run(args: argparse.Namespace) -> int:
    """Carry out one action: 0, or 2 with one line on stderr."""
    try:
        if args.keys_action == "create":
            return _create(args)
        if args.keys_action == "revoke":
            return _revoke(args)
        return _list(args)
    except ConfigError as exc:
        print(f"sluicegate keys: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"sluicegate keys: cannot write {args.file}: {exc.strerror or exc}.", file=sys.stderr)
        return 2


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Serialise read-modify-write with another ``sluicegate keys`` (a lock on the directory, so
    no lock file is left behind)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _records(path: Path, missing_ok: bool) -> list[dict[str, Any]]:
    """The raw records of the store (validated), as they will be written back."""
    if missing_ok and not path.exists():
        return []
    data = read_file(path)
    parse_records(data, str(path), None)
    return list(data["keys"])


def _expiry(text: str) -> str:
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise KeyStoreError(
            f"--expires {text!r} is not an ISO-8601 time such as 2027-01-01T00:00:00Z."
        ) from None
    moment = moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    if moment.timestamp() <= time.time():
        raise KeyStoreError(f"--expires {text!r} is in the past: the key would never work.")
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _create(args: argparse.Namespace) -> int:
    path = Path(args.file)
    tiers = None
    if args.config:
        tiers = load_config(args.config).tiers.keys()
        if args.tier is not None and args.tier not in tiers:
            known = ", ".join(sorted(tiers)) or "none are configured"
            raise KeyStoreError(f"--tier {args.tier!r} is not a tier of {args.config} ({known}).")
    quota = {
        name: value
        for name, value in (
            ("requests_per_minute", args.rpm), ("tokens_per_minute", args.tpm),
            ("max_concurrent", args.concurrency), ("on_store_down", args.on_store_down),
        )
        if value is not None
    }
    key = new_key()
    record = {
        "id": args.id,
        "hash": hash_key(key),
        "tier": args.tier,
        "models": sorted(set(args.model)) or None,
        "rights": sorted(set(args.right)),
        "expires": _expiry(args.expires) if args.expires else None,
        "quota": quota or None,
    }
    with _locked(path):
        records = _records(path, missing_ok=True)
        if any(isinstance(r, dict) and r.get("id") == args.id for r in records):
            raise KeyStoreError(f"{path} already has a key {args.id!r}: revoke it first or pick another id.")
        records.append(record)
        parse_records({"keys": records}, str(path), tiers)  # the new record is valid too
        write_file(path, records)
    print(key, flush=True)
    print(
        f"created key {args.id!r} in {path}; it is shown this once and cannot be recovered", file=sys.stderr
    )
    return 0


def _revoke(args: argparse.Namespace) -> int:
    path = Path(args.file)
    with _locked(path):
        records = _records(path, missing_ok=False)
        kept = [r for r in records if r.get("id") != args.id]
        if len(kept) == len(records):
            raise KeyStoreError(f"{path} has no key {args.id!r}.")
        write_file(path, kept)
    print(
        f"revoked key {args.id!r} in {path} (gateways stop accepting it at their next reload)",
        file=sys.stderr,
    )
    return 0


def _describe(record: KeyRecord, now: float) -> list[str]:
    expires = "never"
    if record.expires is not None:
        expires = datetime.fromtimestamp(record.expires, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        if record.expired(now):
            expires += " (expired)"
    return [
        record.id,
        record.tier or "-",
        ",".join(sorted(record.models)) if record.models is not None else "*",
        ",".join(sorted(record.rights)) or "-",
        expires,
    ]


def _list(args: argparse.Namespace) -> int:
    path = Path(args.file)
    records = parse_records(read_file(path), str(path), None).values()
    now = time.time()
    rows = [["ID", "TIER", "MODELS", "RIGHTS", "EXPIRES"], *(_describe(r, now) for r in records)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return 0
