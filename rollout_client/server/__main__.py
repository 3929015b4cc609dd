"""Command line of the reference server: ``python -m rollout_client.server --help``."""

import argparse
import asyncio
import os
import pathlib

from rollout_client.server.app import ServerConfig
from rollout_client.server.app import serve

AUTH_TOKEN_ENV = "TETHER_ROLLOUT_TOKEN"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rollout_client.server", description=__doc__)
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
    parser.add_argument("--engine", choices=("model", "scripted"), default="model")
    parser.add_argument("--model-config", default="tiny", help="name for learner.model.model_config")
    parser.add_argument("--dtype", default="float32", help="compute dtype of the served model")
    parser.add_argument("--weights", help="initial weights (safetensors file or orbax dir); default: random")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random initial weights")
    parser.add_argument("--eos-ids", type=int, nargs="*",
                        help="default stop token ids, reported by GetServerInfo (model engine default: none, "
                             "so a request without stop_token_ids runs to max_new_tokens; scripted: 1)")
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--decode-steps-per-call", type=int, default=8,
                        help="model engine: decode steps fused into one jitted call")
    parser.add_argument("--vocab-size", type=int, default=1024, help="scripted engine: vocabulary size")
    parser.add_argument("--tokens-per-step", type=int, default=1, help="scripted engine")
    parser.add_argument("--step-delay-s", type=float, default=0.0, help="scripted engine")
    return parser.parse_args(argv)


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
    )


def generator_from_args(args: argparse.Namespace):
    """The engine the arguments ask for."""
    if args.engine == "scripted":
        from rollout_client.server.scripted import ScriptedGenerator

        eos = {} if args.eos_ids is None else {"eos_token_ids": tuple(args.eos_ids)}
        return ScriptedGenerator(vocab_size=args.vocab_size, tokens_per_step=args.tokens_per_step,
                                 step_delay_s=args.step_delay_s, max_seq_len=args.max_seq_len,
                                 max_batch_size=args.max_batch_size, **eos)
    from rollout_client.server.model_generator import ModelGenerator

    return ModelGenerator.from_args(args)


def main(argv=None) -> None:
    args = parse_args(argv)
    asyncio.run(serve(config_from_args(args), generator_from_args(args)))


if __name__ == "__main__":
    main()
