"""The reference server with the scripted engine: ``python -m rollout_client.server --help``.

The scripted engine replays a precomputed token stream (tests, transport benchmarks). The learner's model generator
runs behind the same shell as ``python -m learner.serving``.
"""

import argparse

from rollout_client.server.cli import run, server_parser
from rollout_client.server.scripted import ScriptedGenerator


def add_scripted_arguments(parser: argparse.ArgumentParser) -> None:
    """The scripted engine's own arguments."""
    parser.add_argument("--vocab-size", type=int, default=1024, help="vocabulary size")
    parser.add_argument("--tokens-per-step", type=int, default=1, help="tokens each step returns per sequence")
    parser.add_argument("--step-delay-s", type=float, default=0.0, help="time each step sleeps (the model stand-in)")


def scripted_engine(args: argparse.Namespace) -> ScriptedGenerator:
    """The scripted engine the arguments describe (stop token 1 unless --eos-ids)."""
    eos = {} if args.eos_ids is None else {"eos_token_ids": tuple(args.eos_ids)}
    return ScriptedGenerator(vocab_size=args.vocab_size, tokens_per_step=args.tokens_per_step,
                             step_delay_s=args.step_delay_s, max_seq_len=args.max_seq_len,
                             max_batch_size=args.max_batch_size, **eos)


def main(argv: list[str] | None = None) -> None:
    parser = server_parser("python -m rollout_client.server", __doc__)
    add_scripted_arguments(parser)
    run(parser, {"scripted": scripted_engine}, argv)


if __name__ == "__main__":
    main()
