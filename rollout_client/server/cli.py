"""The reference server's command line, shared by every engine's entry point.

An entry point builds `server_parser`, adds its engine's arguments and calls `run` with its engines (name ->
factory): ``python -m rollout_client.server`` serves the scripted engine, ``python -m learner.serving`` the
learner's model. The network arguments and the engine-independent limits are defined here once.
"""

import argparse
import asyncio
import os
import pathlib
from collections.abc import Callable, Mapping

from rollout_client.server.app import ServerConfig, serve
from rollout_client.server.generator import Generator
from rollout_client.server.service import RolloutServicer

AUTH_TOKEN_ENV = "TETHER_ROLLOUT_TOKEN"

# Builds an engine from the parsed command line.
EngineFactory = Callable[[argparse.Namespace], Generator]


def server_parser(prog: str, description: str | None = None) -> argparse.ArgumentParser:
    """A parser with the shell's arguments: network settings, and the limits every engine reports."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--port-file", type=pathlib.Path)
    parser.add_argument("--auth-token-file", type=pathlib.Path,
                        help=f"file holding the shared token (or set ${AUTH_TOKEN_ENV})")
    parser.add_argument("--tls-cert", type=pathlib.Path, help="PEM certificate chain")
    parser.add_argument("--tls-key", type=pathlib.Path, help="PEM private key")
    parser.add_argument("--drain-grace-s", type=float, default=10.0)
    parser.add_argument("--pause-wait-timeout-s", type=float, default=ServerConfig.pause_wait_timeout_s,
                        help="how long Pause(WAIT) waits for active requests before DEADLINE_EXCEEDED")
    parser.add_argument("--policy-version", type=int, default=0)
    parser.add_argument("--weights-dir", type=pathlib.Path,
                        help="UpdateWeights reads weights only from paths inside this directory (default: none, "
                             "weights are only streamed)")
    parser.add_argument("--eos-ids", type=int, nargs="*",
                        help="default stop token ids, reported by GetServerInfo (default: the engine's)")
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    return parser


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Network settings; secrets come from files or the environment, never argv."""
    token = args.auth_token_file.read_text().strip() if args.auth_token_file else os.environ.get(AUTH_TOKEN_ENV)
    return ServerConfig(
        host=args.host,
        port=args.port,
        port_file=args.port_file,
        auth_token=token or None,
        tls_cert_chain=args.tls_cert.read_bytes() if args.tls_cert else None,
        tls_private_key=args.tls_key.read_bytes() if args.tls_key else None,
        drain_grace_s=args.drain_grace_s,
        pause_wait_timeout_s=args.pause_wait_timeout_s,
        policy_version=args.policy_version,
        weights_dir=args.weights_dir,
    )


def run(parser: argparse.ArgumentParser, engines: Mapping[str, EngineFactory], argv: list[str] | None = None,
        servicer_class: type[RolloutServicer] = RolloutServicer) -> None:
    """Parses ``argv`` (``--engine`` picks one of ``engines``, the first by default) and serves until SIGTERM."""
    parser.add_argument("--engine", choices=tuple(engines), default=next(iter(engines)),
                        help="the engine that serves")
    args = parser.parse_args(argv)
    asyncio.run(serve(config_from_args(args), engines[args.engine](args), servicer_class))
