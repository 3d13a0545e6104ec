"""The ``sluicegate`` command: ``serve`` the gateway, run a ``podsim`` or a ``mig-agent``, a local
``demo`` of pods and gateway, manage API ``keys``, or steer a canary ``rollout``."""

from __future__ import annotations

import argparse
import sys
from importlib import metadata
from pathlib import Path

from gateway.config import Config, ConfigError
from gateway.config_load import load_config, parse_config, with_overrides

DEMO_CONFIG = Path(__file__).resolve().parent.parent / "config" / "demo.yaml"
CONFIG_REFERENCE = "docs/configuration.md"


def version() -> str:
    """The installed package's version (pyproject.toml), as pip and ``importlib.metadata`` see it."""
    try:
        return metadata.version("sluicegate")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps descriptions and example epilogs as written, and names every flag's default: a flag
    whose help does not already say it gets "(default: ...)"."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            not action.option_strings or action.default is argparse.SUPPRESS or "default" in text
            or action.required
        ):
            return text
        default = action.default
        if default is None or default == [] or default is False:
            shown = "off" if isinstance(action, argparse._StoreTrueAction) else "none"
        else:
            shown = "%(default)s"
        return f"{text} (default: {shown})"


def _epilog(*examples: str, notes: str = "") -> str:
    lines = ["examples:", *(f"  {example}" for example in examples)]
    if notes:
        lines += ["", notes]
    return "\n".join(lines)


def _subcommand(
    commands: argparse._SubParsersAction, name: str, summary: str, description: str, epilog: str
) -> argparse.ArgumentParser:
    return commands.add_parser(
        name, help=summary, description=description, epilog=epilog, formatter_class=_HelpFormatter
    )


def _serve_arguments(parser: argparse.ArgumentParser, config_default: str) -> None:
    parser.add_argument(
        "--config", metavar="FILE",
        help=f"YAML config file; every key, its default and what it is for: {CONFIG_REFERENCE} "
        f"(default: {config_default})",
    )
    parser.add_argument(
        "--host", help="address to listen on, instead of the config's server.host (default: the config's; "
        "127.0.0.1 when it sets none)",
    )
    parser.add_argument(
        "--port", type=int, help="cleartext HTTP/1.1 and h2c port, instead of the config's server.port "
        "(default: the config's; 8080 when it sets none)",
    )
    parser.add_argument(
        "--upstream", metavar="URL", action="append", default=[],
        help="add a pod by base URL, e.g. http://127.0.0.1:8000; repeatable; named upstream-N, its models "
        "are asked from its /v1/models (default: none, only the config's pods)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"],
        help="log verbosity",
    )


_SERVE = """\
Run the gateway in front of vLLM-compatible pods: the pods of --config's 'pods' list, those
found by discovery.kubernetes or discovery.dns, and each --upstream. It listens for HTTP/1.1
and HTTP/2 (h2c) on server.port; with server.tls, for HTTP/1.1 and HTTP/2 over TLS and HTTP/3
(QUIC). One line 'sluicegate listening on URL' per listener is printed once all are up.
SIGTERM or Ctrl-C drains streams in flight (server.drain_timeout_s), then exits 0.

Configuration reference (every key and default): {reference}"""

_DEMO = """\
Start a simulated vLLM pod (podsim) for each pod of the config whose URL is on this machine,
then the gateway in front of them, and print requests that work as printed (curl, the OpenAI
SDK, and over TLS with HTTP/2 and HTTP/3). The default config runs three pods on three MIG
slices of one simulated A100 and makes a self-signed certificate in .sluicegate-demo/.
Ctrl-C stops the gateway and the pods together.

Configuration reference (every key and default): {reference}; the demo's own: {demo}"""

_KEYS = """\
Manage the API keys of a key store file (the config's auth.keys_file): 'create' makes a key,
prints it once on stdout and stores only its hash, with its tier, the models it may use, its
rights (admin: the admin API) and an optional expiry and quota; 'revoke' removes one; 'list'
shows them (never the hashes). A running gateway picks up changes within auth.reload_interval_s,
without a restart and without dropping streams. Reference: docs/configuration.md (auth.*)."""

_ROLLOUT = """\
Show and steer a running gateway's canary rollouts through its admin API: 'status' prints each
rollout's state, step, weights, samples and the judge's last verdict (--json: the API's JSON);
'pause', 'resume', 'promote' and 'abort' steer one model's rollout, --why recorded in its history.
Needs an API key with the admin right when auth is on (--key or $SLUICEGATE_ADMIN_KEY).
See docs/canary.md."""

_PODSIM = """\
Run one simulated vLLM pod: the OpenAI-compatible API with streaming, vLLM's /metrics names,
a KV cache and scheduler modelled on a GPU or MIG slice, and faults injected per process
(--fault) or per request (the x-podsim-fault header). For tests, demos and benchmarks without
a GPU. It prints 'podsim listening on URL' once bound. See loadtest/podsim/README.md."""

_AGENT = """\
Serve this node's GPU and MIG-slice health, read from NVML (XID events included), as JSON for
the gateway's health.devices.agent_urls. Runs once per GPU node (a DaemonSet). Exit status 2
when NVML cannot be initialised. See docs/mig-agent.md."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every command; the flags of the tool commands (podsim, keys, rollout, mig-agent, loadtest) only
    for ``command`` when one is named: their modules (aiohttp's server among them) stay out of a
    gateway process that never runs them (``main`` names the command it was given)."""
    parser = argparse.ArgumentParser(
        prog="sluicegate",
        description="A gateway for streaming LLM inference in front of vLLM pods.",
        epilog=_epilog(
            "sluicegate demo",
            "sluicegate serve --config config/example.yaml",
            notes=f"Run 'sluicegate COMMAND --help' for a command's flags. Configuration reference: "
            f"{CONFIG_REFERENCE}.",
        ),
        formatter_class=_HelpFormatter,
    )
    parser.add_argument(
        "--version", action="version", version=f"sluicegate {version()}",
        help="print 'sluicegate VERSION' (the installed package's) and exit",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = _subcommand(
        commands, "serve", "run the gateway", _SERVE.format(reference=CONFIG_REFERENCE),
        _epilog(
            "sluicegate serve --config config/example.yaml",
            "sluicegate serve --upstream http://10.0.0.5:8000 --upstream http://10.0.0.6:8000 --host 0.0.0.0",
            notes="exit status: 0 after a clean shutdown, 2 for a bad config, 3 when a port is taken",
        ),
    )
    _serve_arguments(serve, "none: built-in defaults, pods from --upstream")
    serve.add_argument(
        "--workers", metavar="N",
        help="worker processes serving the listeners, one per core: 'auto' or 0 for one per CPU core; "
        "1 is a single process (default: the config's server.workers, 1 when it sets none; "
        "docs/operations.md)",
    )
    serve.add_argument(
        "--no-auth", action="store_true",
        help="accept requests without an API key (auth.enabled: false), for local experiments only; "
        "logged as a warning at start",
    )
    demo = _subcommand(
        commands, "demo", "run simulated pods on MIG slices and the gateway in front of them",
        _DEMO.format(reference=CONFIG_REFERENCE, demo="config/demo.yaml"),
        _epilog(
            "sluicegate demo",
            "sluicegate demo --port 9080 --log-level warning",
            notes="exit status: 0 after Ctrl-C, 2 for a bad config, 3 when it cannot start (a port is\n"
            "taken, a pod simulator fails), with the pods it had started stopped again",
        ),
    )
    _serve_arguments(demo, "config/demo.yaml")
    demo.set_defaults(config=str(DEMO_CONFIG))
    podsim = _subcommand(
        commands, "podsim", "run a simulated vLLM pod", _PODSIM,
        _epilog(
            "sluicegate podsim --port 8001 --model llama-8b",
            "sluicegate podsim --port 0 --mig-profile 1g.10gb --ttft-ms 120 --fault 'drop_after=5'",
        ),
    )
    if command in (None, "podsim"):
        from loadtest.podsim.cli import add_arguments

        add_arguments(podsim)
    keys = _subcommand(
        commands, "keys", "create, revoke and list API keys (the key store)", _KEYS,
        _epilog(
            "sluicegate keys create --file keys.yaml --id alice --tier gold   # prints the key once",
            "sluicegate keys create --file keys.yaml --id ops --right admin --expires 2027-01-01T00:00:00Z",
            "sluicegate keys revoke --file keys.yaml alice",
            "sluicegate keys list --file keys.yaml",
            notes="exit status: 0, or 2 with one line on stderr (a bad key store, an unknown id)",
        ),
    )
    if command in (None, "keys"):
        from gateway.auth.keys_cli import add_arguments as add_keys_arguments

        add_keys_arguments(keys, _HelpFormatter)
    rollout = _subcommand(
        commands, "rollout", "show, pause, resume, promote or abort canary rollouts (admin API)", _ROLLOUT,
        _epilog(
            "sluicegate rollout status",
            "sluicegate rollout pause llama-8b --why 'looking at the TTFT graph'",
            "sluicegate rollout abort llama-8b --admin-url http://10.0.0.7:9090 --key $ADMIN_KEY",
            notes="exit status: 0, or 2 with one line on stderr (unknown model, a control the state does\n"
            "not allow, a refused key, no gateway at --admin-url)",
        ),
    )
    if command in (None, "rollout"):
        from gateway.rollout_cli import add_arguments as add_rollout_arguments

        add_rollout_arguments(rollout)
    agent = _subcommand(
        commands, "mig-agent", "serve this node's GPU and MIG-slice health from NVML (a DaemonSet)", _AGENT,
        _epilog(
            "sluicegate mig-agent --port 9477",
            "sluicegate mig-agent --port 0 --fake-nvml spec.yaml   # no GPU: a simulated NVML "
            "(loadtest/fakenvml.py)",
        ),
    )
    if command in (None, "mig-agent"):
        from gateway.migagent import add_arguments as add_agent_arguments

        add_agent_arguments(agent)
    loadtest = _subcommand(
        commands, "loadtest", "drive streaming load at a gateway: closed/open loop, sweep, JSON out",
        _loadtest_description() if command in (None, "loadtest") else "",
        _epilog(
            "sluicegate loadtest http://127.0.0.1:8080 --model llama-8b --concurrency 32 --duration 30",
            "sluicegate loadtest http://127.0.0.1:8080 --model llama-8b --rate 20 --arrivals poisson "
            "--duration 60 --goodput ttft_ms=500,tpot_ms=50 --raw requests.jsonl",
            "sluicegate loadtest http://127.0.0.1:8080 --model llama-8b --rate 1 --sweep 10,20,40,80 "
            "--duration 20",
            notes="exit status: 0, 1 when no request succeeded, 2 for bad flags (docs/load-testing.md)",
        ),
    )
    if command in (None, "loadtest"):
        from loadtest.loadtest_cli import add_arguments as add_loadtest_arguments

        add_loadtest_arguments(loadtest)
    for sub in (podsim, agent):
        _name_unexplained_flags(sub)
    return parser


def _loadtest_description() -> str:
    from loadtest.loadtest_cli import DESCRIPTION

    return DESCRIPTION


def _name_unexplained_flags(parser: argparse.ArgumentParser) -> None:
    """argparse lists a flag without help bare, default unsaid; give each at least a few words."""
    for action in parser._actions:
        if action.option_strings and action.help is None:
            action.help = "log verbosity" if action.dest == "log_level" else action.dest.replace("_", " ")


def resolve_config(args: argparse.Namespace) -> Config:
    """The config file (if any) with command-line flags applied on top."""
    base = load_config(args.config) if args.config else parse_config({})
    config = with_overrides(
        base, host=args.host, port=args.port, upstreams=args.upstream, no_auth=getattr(args, "no_auth", False)
    )
    if not config.pods and not config.discovery.dynamic:
        raise ConfigError(
            "no pods are configured: pass --config FILE with a 'pods' list or discovery.kubernetes or "
            "discovery.dns, or --upstream URL "
            "(repeatable); `sluicegate demo` runs simulated pods for a quick start."
        )
    return config


def _command_in(argv: list[str]) -> str | None:
    """The command ``argv`` names: its first word that is not a flag (the top level takes no values)."""
    return next((word for word in argv if not word.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    args = build_parser(_command_in(sys.argv[1:] if argv is None else argv)).parse_args(argv)
    if args.command == "podsim":
        from loadtest.podsim.cli import run

        return run(args)
    if args.command == "mig-agent":
        from gateway.migagent import run as run_agent

        return run_agent(args)
    if args.command == "keys":
        from gateway.auth.keys_cli import run as run_keys

        return run_keys(args)
    if args.command == "loadtest":
        from loadtest.loadtest_cli import run as run_loadtest

        return run_loadtest(args)
    if args.command == "rollout":
        from gateway.rollout_cli import run as run_rollout

        return run_rollout(args)
    try:
        workers = parse_workers(getattr(args, "workers", None))
        config = resolve_config(args)
    except ConfigError as exc:
        print(f"sluicegate: {exc}", file=sys.stderr)
        return 2
    from gateway.auth import warn_if_auth_off
    from gateway.server import configure_logging, serve

    configure_logging(args.log_level)
    warn_if_auth_off(config)  # the key store itself is loaded (or refused, exit 2) by build_server
    if args.command == "demo":
        from gateway.demo import run_demo

        return run_demo(config, args.log_level)
    from gateway.reload import ConfigSource
    from gateway.workers.worker import WorkerSpec

    spec = WorkerSpec.from_env()
    if spec is not None:  # one of a supervisor's workers: its ports, its Redis (gateway/workers)
        from gateway.server import serve_worker
        from gateway.workers.worker import WorkerLink

        configure_logging(args.log_level, f"worker-{spec.index}")
        source = ConfigSource(args.config, lambda: spec.apply(resolve_config(args)))
        serve_worker(spec.apply(config), args.log_level, source, WorkerLink(spec))
        return 0
    # SIGHUP and a changed file re-read --config, with the same flags on top (gateway/reload.py)
    source = ConfigSource(args.config, lambda: resolve_config(args))
    from gateway.workers import worker_count

    count = worker_count(config.server.workers if workers is None else workers)
    if count > 1:
        from gateway.workers.supervisor import run_supervisor

        return run_supervisor(config, count, argv if argv is not None else sys.argv[1:], source)
    serve(config, args.log_level, source)
    return 0


def parse_workers(value: str | None) -> int | None:
    """``--workers``: a process count, or 0 (also 'auto') for one per CPU core; None when not given."""
    if value is None:
        return None
    if value.strip().lower() == "auto":
        return 0
    try:
        count = int(value)
    except ValueError:
        count = -1
    if count < 0:
        raise ConfigError(
            f"--workers {value!r}: give a number of worker processes (1 or more), or 0 or 'auto' for one "
            "per CPU core"
        )
    return count


if __name__ == "__main__":
    sys.exit(main())
