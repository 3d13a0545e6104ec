"""The ``sluicegate`` command: ``serve`` the gateway, run a ``podsim`` or a ``mig-agent``, or a local
``demo`` of pods and gateway."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gateway.config import Config, ConfigError, load_config, parse_config, with_overrides

DEMO_CONFIG = Path(__file__).resolve().parent.parent / "config" / "demo.yaml"


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML config file (see config/)")
    parser.add_argument("--host", help="address to listen on (overrides the config)")
    parser.add_argument("--port", type=int, help="port to listen on (overrides the config)")
    parser.add_argument(
        "--upstream", metavar="URL", action="append", default=[],
        help="add a pod by base URL, e.g. http://127.0.0.1:8000 (repeatable)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"],
        help="log verbosity (default: info)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluicegate", description="A gateway for streaming LLM inference in front of vLLM pods."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser("serve", help="run the gateway")
    _serve_arguments(serve)
    demo = commands.add_parser(
        "demo", help="run simulated pods on MIG slices and the gateway in front of them"
    )
    _serve_arguments(demo)
    demo.set_defaults(config=str(DEMO_CONFIG))
    podsim = commands.add_parser("podsim", help="run a simulated vLLM pod")
    from loadtest.podsim.cli import add_arguments

    add_arguments(podsim)
    agent = commands.add_parser(
        "mig-agent", help="serve this node's GPU and MIG-slice health from NVML (a DaemonSet)"
    )
    from gateway.migagent import add_arguments as add_agent_arguments

    add_agent_arguments(agent)
    return parser


def resolve_config(args: argparse.Namespace) -> Config:
    """The config file (if any) with command-line flags applied on top."""
    base = load_config(args.config) if args.config else parse_config({})
    config = with_overrides(base, host=args.host, port=args.port, upstreams=args.upstream)
    if not config.pods and not config.discovery.dynamic:
        raise ConfigError(
            "no pods are configured: pass --config FILE with a 'pods' list or discovery.kubernetes or "
            "discovery.dns, or --upstream URL "
            "(repeatable); `sluicegate demo` runs simulated pods for a quick start."
        )
    return config


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "podsim":
        from loadtest.podsim.cli import run

        return run(args)
    if args.command == "mig-agent":
        from gateway.migagent import run as run_agent

        return run_agent(args)
    try:
        config = resolve_config(args)
    except ConfigError as exc:
        print(f"sluicegate: {exc}", file=sys.stderr)
        return 2
    from gateway.server import configure_logging, serve

    configure_logging(args.log_level)
    if args.command == "demo":
        from gateway.demo import run_demo

        return run_demo(config, args.log_level)
    serve(config, args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
