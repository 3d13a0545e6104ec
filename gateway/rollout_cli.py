"""``sluicegate rollout``: read and steer a running gateway's canary rollouts through its admin API.

A thin client of ``GET /admin/rollouts`` and ``POST /admin/rollouts/MODEL/ACTION``; the gateway
decides, this only asks and prints. It uses the standard library's HTTP client (the gateway's own
dependencies carry no synchronous one), and every failure — refused connection, bad key, unknown
model, a control the state does not allow — is one line on stderr and exit status 2, never a
traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

DEFAULT_ADMIN_URL = "http://127.0.0.1:9090"  # admin.host / admin.port's defaults
KEY_ENV = "SLUICEGATE_ADMIN_KEY"
ACTIONS = ("status", "pause", "resume", "promote", "abort")
TIMEOUT_S = 10.0


class RolloutCliError(Exception):
    """A request the admin API refused or could not answer: the one line to print."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``ACTION [MODEL]`` and the connection flags under ``parser``."""
    parser.add_argument("action", choices=ACTIONS, metavar="ACTION", help=f"one of: {', '.join(ACTIONS)}")
    parser.add_argument(
        "model",
        nargs="?",
        metavar="MODEL",
        help="the route's public model (required but for status; status: all rollouts)",
    )
    parser.add_argument(
        "--admin-url", default=DEFAULT_ADMIN_URL, metavar="URL", help="the gateway's admin listener"
    )
    parser.add_argument(
        "--key",
        metavar="KEY",
        help=f"an API key with the admin right (default: ${KEY_ENV}; none when auth is off)",
    )
    parser.add_argument("--why", metavar="TEXT", help="the reason, recorded in the rollout's history and log")
    parser.add_argument("--json", action="store_true", help="print the admin API's JSON as it came")


def run(args: argparse.Namespace) -> int:
    """Do one action; 0, or 2 with one line on stderr."""
    key = args.key or os.environ.get(KEY_ENV) or None
    try:
        if args.action == "status":
            rollouts = request(args.admin_url, "GET", "/admin/rollouts", key)["rollouts"]
            if args.model is not None:
                rollouts = [r for r in rollouts if r.get("route") == args.model]
                if not rollouts:
                    raise RolloutCliError(f"no rollout for model {args.model!r}")
            if args.json:
                print(json.dumps({"rollouts": rollouts}, indent=2))
            elif not rollouts:
                print("no rollouts")
            else:
                print("\n\n".join(summary(r) for r in rollouts))
            return 0
        if args.model is None:
            raise RolloutCliError(f"{args.action} needs a MODEL")
        path = f"/admin/rollouts/{urllib.parse.quote(args.model, safe='')}/{args.action}"
        if args.why:
            path += "?" + urllib.parse.urlencode({"why": args.why})
        status = request(args.admin_url, "POST", path, key)
        print(json.dumps(status, indent=2) if args.json else summary(status))
        return 0
    except RolloutCliError as exc:
        print(f"sluicegate rollout: {exc}", file=sys.stderr)
        return 2


def request(admin_url: str, method: str, path: str, key: str | None) -> dict[str, Any]:
    """One admin API call's JSON; ``RolloutCliError`` with the gateway's own message otherwise."""
    url = admin_url.rstrip("/") + path
    headers = {"Accept": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, method=method, headers=headers, data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
            body = resp.read()
    except urllib.error.HTTPError as exc:
        raise RolloutCliError(f"{exc.code}: {_message(exc.read()) or exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        why = getattr(exc, "reason", exc)
        raise RolloutCliError(f"cannot reach the admin API at {admin_url}: {why}") from None
    try:
        return json.loads(body)
    except ValueError:
        raise RolloutCliError(f"{url} did not answer JSON") from None


def _message(body: bytes) -> str:
    """The ``error.message`` of an OpenAI-shaped error body, or "" for any other body."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return ""


def summary(status: dict[str, Any]) -> str:
    """A rollout's status as a few readable lines."""
    steps = status.get("steps") or []
    step = status.get("step", 0)
    weights = ", ".join(f"{name} {_pct(w)}" for name, w in (status.get("weights") or {}).items())
    samples = "; ".join(
        f"{name} {counts.get('clean', 0)} clean, {counts.get('infra', 0)} infra"
        for name, counts in (status.get("samples") or {}).items()
    )
    lines = [
        f"{status.get('route')}: {status.get('state')}",
        f"  step      {step + 1} of {len(steps)} ({' -> '.join(_pct(s) for s in steps)}), "
        f"held {status.get('hold_elapsed_s', 0):.0f} s of {status.get('min_hold_s', 0):g}",
        f"  weights   {weights}",
        f"  samples   {samples} (need {status.get('min_samples')} clean per variant)",
    ]
    verdict = status.get("verdict")
    if verdict:
        triggered = ", ".join(verdict.get("triggered") or []) or "none"
        lines.append(
            f"  verdict   {verdict.get('decision')}: {verdict.get('reason')} (triggered: {triggered})"
        )
    last = (status.get("history") or [])[-1:]
    for event in last:
        triggered = ", ".join(event.get("triggered") or [])
        lines.append(
            f"  last      {event.get('what')}: {event.get('reason')}"
            + (f" (triggered: {triggered})" if triggered else "")
        )
    return "\n".join(lines)


def _pct(value: Any) -> str:
    return f"{value:g}%" if isinstance(value, int | float) else str(value)
