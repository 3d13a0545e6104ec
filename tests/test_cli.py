"""The ``sluicegate`` command line: ``--version``, and help that tells a new operator what each
command does, every flag's default, where the config reference is, and an example that works."""

from __future__ import annotations

import argparse
import importlib.metadata
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli import CONFIG_REFERENCE, _HelpFormatter, build_parser

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("serve", "demo", "podsim", "mig-agent", "keys")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args], capture_output=True, text=True, timeout=60, cwd=ROOT
    )


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_version_prints_the_package_version() -> None:
    result = _cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"sluicegate {importlib.metadata.version('sluicegate')}\n"


def test_the_installed_command_has_version_too() -> None:
    script = Path(sys.executable).parent / "sluicegate"
    if not script.exists():
        pytest.skip("the package's console script is not installed next to this interpreter")
    result = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.startswith("sluicegate ")


def test_serve_help_explains_the_command_its_flags_and_the_config_reference() -> None:
    result = _cli("serve", "--help")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "(see config/)" not in text
    assert "Run the gateway in front of" in text
    assert CONFIG_REFERENCE in text
    assert "examples:\n  sluicegate serve --config" in text
    for flag, default in [
        ("--config", "none"), ("--host", "127.0.0.1"), ("--port", "8080"), ("--log-level", "info")
    ]:
        line = text[text.index(f"  {flag} ") :].split("\n  -", 1)[0]
        assert default in line, (flag, line)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_subcommand_says_what_it_does_and_shows_an_example(command: str) -> None:
    parser = _subparsers()[command]
    assert parser.description and len(parser.description.split()) >= 20, "a real description"
    assert parser.epilog and f"\n  sluicegate {command} " in "\n" + parser.epilog.split("examples:", 1)[1]
    if command in ("serve", "demo"):
        assert CONFIG_REFERENCE in parser.format_help()
        assert (ROOT / CONFIG_REFERENCE).is_file()


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_of_every_subcommand_names_its_default(command: str) -> None:
    parser = _subparsers()[command]
    formatter = _HelpFormatter(prog=command)
    unexplained = []
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        text = formatter._get_help_string(action) or ""
        if "default" not in text:
            unexplained.append(f"{action.option_strings[0]}: {text!r}")
    assert not unexplained, f"sluicegate {command}: flags whose help names no default: {unexplained}"


@pytest.mark.parametrize("command", ("", *COMMANDS))
def test_the_examples_in_the_help_parse(command: str) -> None:
    parser = _subparsers()[command] if command else build_parser()
    examples = parser.epilog.split("examples:", 1)[1].split("\n\n", 1)[0]
    lines = [line.split("#", 1)[0].strip() for line in examples.strip().splitlines()]
    assert lines
    for line in lines:
        argv = shlex.split(line)
        assert argv[0] == "sluicegate"
        build_parser().parse_args(argv[1:])  # exits (SystemExit) on a flag that does not exist


def test_no_auth_turns_auth_off_over_the_config() -> None:
    from gateway.cli import resolve_config

    parser = build_parser()
    on = resolve_config(parser.parse_args(["serve", "--upstream", "http://127.0.0.1:9"]))
    assert on.auth.enabled  # on by default
    off = resolve_config(parser.parse_args(["serve", "--upstream", "http://127.0.0.1:9", "--no-auth"]))
    assert not off.auth.enabled and off.auth.keys_file == on.auth.keys_file


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("auth", "args"),
    [({"enabled": True, "keys_file": "/nonexistent/keys.yaml"}, ["--no-auth"]), ({"enabled": False}, [])],
)
def test_a_gateway_without_auth_says_so_at_start(auth: dict[str, object], args: list[str]) -> None:
    from loadtest.procs import GatewayProcess

    config = {"auth": auth, "pods": [{"name": "a", "url": "http://127.0.0.1:9", "models": ["m"]}]}
    gateway = GatewayProcess(config, extra_args=args).start()
    try:
        log = gateway.log_path.read_text()
    finally:
        gateway.stop()
    warnings = [line for line in log.splitlines() if "auth is off" in line]
    assert len(warnings) == 1, log
    assert " WARNING sluicegate.auth: auth is off: anyone who can reach 127.0.0.1:" in warnings[0]
    assert warnings[0].endswith(" can use the gateway")


def test_serving_loads_none_of_the_tool_commands_modules() -> None:
    """Every worker of a gateway pays for what its process imports: the pod simulator, the mig-agent
    and aiohttp (~9 MB resident; the health loops' GETs run on probe threads) stay out unless their
    command runs, and their commands still parse; gRPC-Web and protobuf (~3 MB) until its first call."""
    probe = (
        "import sys; from gateway.cli import build_parser; "
        "build_parser('serve').parse_args(['serve', '--upstream', 'http://127.0.0.1:1']); "
        "import gateway.app, gateway.server, gateway.workers.worker; "
        "print(sorted(m for m in ('aiohttp', 'loadtest.podsim.server', 'gateway.migagent', "
        "'gateway.grpc_web', 'google.protobuf') "
        "if m in sys.modules)); "
        "build_parser('podsim').parse_args(['podsim', '--ttft-ms', '5']); "
        "build_parser('mig-agent').parse_args(['mig-agent', '--poll-ms', '100'])"
    )
    argv = [sys.executable, "-c", probe]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
