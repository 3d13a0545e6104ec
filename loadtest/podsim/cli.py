"""Command line of the pod simulator: ``python -m loadtest.podsim`` and ``sluicegate podsim``.

Once the socket is bound it prints exactly one line to stdout, ``podsim listening on http://HOST:PORT``
(the real port when ``--port 0``), so launchers can wait for that line instead of polling.
SIGTERM and SIGINT stop it cleanly with exit code 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import ssl
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from gateway.rlimits import raise_open_file_limit
from loadtest.podsim.engine import BLOCK_SIZE, EngineConfig, kv_blocks_for, parse_mig_profile
from loadtest.podsim.faults import NO_FAULTS, Faults, parse_faults
from transports.tls import TlsFilesError, server_context

if TYPE_CHECKING:
    from loadtest.podsim.server import PodsimConfig


def _number(kind: type, minimum: float, what: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    parse.__name__ = what  # argparse names the type in its messages
    return parse


_port = _number(int, 0, "a port number (0 picks a free one)")
_positive = _number(int, 1, "an integer >= 1")
_non_negative_int = _number(int, 0, "an integer >= 0")
_ms = _number(float, 0.0, "milliseconds >= 0")
_non_negative_float = _number(float, 0.0, "a number >= 0")


def _fault(text: str) -> Faults:
    try:
        return parse_faults(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _profile(text: str) -> str:
    try:
        parse_mig_profile(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The simulator's flags, shared with the gateway's ``sluicegate podsim`` command."""
    net = parser.add_argument_group("serving")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    net.add_argument(
        "--port", type=_port, default=8000, help="port to bind; 0 picks a free one (default 8000)"
    )
    net.add_argument(
        "--model",
        action="append",
        dest="models",
        metavar="NAME",
        help="served model name; repeat for several (default llama-8b)",
    )
    net.add_argument(
        "--max-model-len",
        type=_positive,
        default=None,
        help="context length (default 8192, or what the KV cache holds)",
    )
    net.add_argument(
        "--default-max-tokens",
        type=_positive,
        default=16,
        help="max_tokens when a request gives none (default 16)",
    )
    net.add_argument(
        "--answer-tokens",
        type=_non_negative_int,
        default=0,
        help="answers end (finish_reason stop) after this many tokens; 0 = never, only length (default 0)",
    )
    net.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    net.add_argument(
        "--api-key",
        action="append",
        dest="api_keys",
        metavar="KEY",
        help="as vLLM's: /v1/* needs 'Authorization: Bearer KEY'; repeatable (default: $VLLM_API_KEY)",
    )
    net.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this PEM key (as vLLM's flag)")
    net.add_argument("--ssl-certfile", default=None, help="and this PEM certificate chain")
    net.add_argument("--ssl-ca-certs", default=None, help="PEM CAs that client certificates must chain to")
    net.add_argument(
        "--ssl-cert-reqs",
        type=int,
        choices=[0, 1, 2],
        default=0,
        help="client certificates: 0 not asked, 1 optional, 2 required (Python's ssl.CERT_*; default 0)",
    )

    mig = parser.add_argument_group("MIG identity (GET /podsim/identity)")
    mig.add_argument("--gpu-uuid", default="", help="parent GPU UUID, e.g. GPU-5e0f8a2c-...")
    mig.add_argument("--mig-uuid", default="", help="MIG device UUID, e.g. MIG-2ce7a541-...")
    mig.add_argument(
        "--mig-profile", type=_profile, default=None, help="MIG profile, e.g. 1g.10gb; sizes the KV cache"
    )

    engine = parser.add_argument_group("engine model")
    engine.add_argument(
        "--kv-blocks",
        type=_positive,
        default=None,
        help=f"KV-cache blocks of {BLOCK_SIZE} tokens (default: 256 per GB of --mig-profile; 80 GB without)",
    )
    engine.add_argument(
        "--max-num-seqs", type=_positive, default=256, help="running sequences at most (default 256)"
    )
    engine.add_argument("--ttft-ms", type=_ms, default=50.0, help="base time to first token (default 50)")
    engine.add_argument(
        "--prefill-ms-per-token",
        type=_ms,
        default=0.01,
        help="extra time to first token per prompt token (default 0.01)",
    )
    engine.add_argument(
        "--ttft-jitter",
        type=_non_negative_float,
        default=0.0,
        help="log-normal sigma of each prefill's delay around --ttft-ms (default 0: none)",
    )
    engine.add_argument("--seed", type=int, default=None, help="seed of the --ttft-jitter draws")
    engine.add_argument("--itl-ms", type=_ms, default=15.0, help="base inter-token latency (default 15)")
    engine.add_argument(
        "--itl-per-seq-ms",
        type=_ms,
        default=0.02,
        help="inter-token latency added per running sequence (default 0.02)",
    )

    parser.add_argument(
        "--fault",
        action="append",
        type=_fault,
        default=[],
        metavar="KEY=VALUE;...",
        help="process faults, repeatable, e.g. 'drop_after=5' or 'first_token_delay_ms=200;status=503'",
    )


def config_from_args(args: argparse.Namespace) -> PodsimConfig:
    """A :class:`PodsimConfig` from parsed flags."""
    from loadtest.podsim.server import PodsimConfig  # the server (aiohttp's web) only when one runs

    faults = NO_FAULTS
    for more in args.fault:
        faults = faults.merged(more)
    kv_blocks = args.kv_blocks or kv_blocks_for(args.mig_profile or None)
    return PodsimConfig(
        models=list(dict.fromkeys(args.models or ["llama-8b"])),
        engine=EngineConfig(
            kv_blocks=kv_blocks,
            block_size=BLOCK_SIZE,
            max_num_seqs=args.max_num_seqs,
            ttft_ms=args.ttft_ms,
            prefill_ms_per_token=args.prefill_ms_per_token,
            itl_ms=args.itl_ms,
            itl_per_seq_ms=args.itl_per_seq_ms,
            ttft_jitter=args.ttft_jitter,
            seed=args.seed,
        ),
        max_model_len=args.max_model_len,
        default_max_tokens=args.default_max_tokens,
        answer_tokens=args.answer_tokens,
        gpu_uuid=args.gpu_uuid,
        mig_uuid=args.mig_uuid,
        mig_profile=args.mig_profile or "",
        faults=faults,
        api_keys=tuple(args.api_keys or filter(None, [os.environ.get("VLLM_API_KEY")])),
    )


def ssl_context_from_args(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The server context vLLM's ``--ssl-*`` flags describe (uvicorn's meaning), or None for HTTP."""
    if args.ssl_certfile is None and args.ssl_keyfile is None:
        return None
    if args.ssl_certfile is None or args.ssl_keyfile is None:
        raise ValueError("--ssl-certfile and --ssl-keyfile go together")
    try:
        context = server_context(args.ssl_certfile, args.ssl_keyfile, alpn=["http/1.1"])
        context.verify_mode = ssl.VerifyMode(args.ssl_cert_reqs)
        if args.ssl_ca_certs:
            context.load_verify_locations(args.ssl_ca_certs)
    except TlsFilesError as exc:
        raise ValueError(str(exc)) from None
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"cannot use --ssl-ca-certs {args.ssl_ca_certs!r}: {exc.strerror or exc}") from None
    return context


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:  # still works, only slower
        return None
    return uvloop.new_event_loop


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; 0 on a clean stop, 1 if the socket cannot be bound, 2 on bad config."""
    logging.basicConfig(level=args.log_level.upper(), format="podsim %(levelname)s %(message)s")
    try:
        config = config_from_args(args)
        context = ssl_context_from_args(args)
    except ValueError as exc:
        print(f"podsim: {exc}", file=sys.stderr)
        return 2
    raise_open_file_limit()
    from loadtest.podsim.server import READY_PREFIX, serve

    def announce(url: str) -> None:
        print(f"{READY_PREFIX}{url}", flush=True)

    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(serve(config, args.host, args.port, announce=announce, ssl_context=context))
    except ValueError as exc:  # configuration the engine refuses (e.g. max-model-len over the cache)
        print(f"podsim: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"podsim: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The standalone parser for ``python -m loadtest.podsim``."""
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.podsim",
        description="A simulated vLLM OpenAI-compatible server on a (simulated) MIG slice.",
    )
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m loadtest.podsim``."""
    return run(build_parser().parse_args(argv))
