"""The reference server with the learner's model generator, except that a weight update keeps its start-up output head
(``lm_head/kernel``), as vLLM's in-place reload does for a tied-embedding model (vllm#48312): every update succeeds,
the version moves, and the engine silently samples with a stale head.

Run as ``python -m tests.support.stale_head_server [learner.serving args]``.
"""

import jax
import numpy as np

from learner.serving.__main__ import add_model_arguments, served_generator
from learner.serving.model_generator import ModelGenerator
from rollout_client.server.cli import run, server_parser

HEAD = "lm_head/kernel"


def keep_startup_head(generator: ModelGenerator) -> ModelGenerator:
    """``generator`` whose `load_weights` replaces the published head by the one it started with."""
    startup_head = np.asarray(jax.tree_util.tree_leaves(generator._params)[generator._names.index(HEAD)])
    load_weights = generator.load_weights
    generator.load_weights = lambda weights: load_weights({**weights, HEAD: startup_head.astype(weights[HEAD].dtype)})
    return generator


def main() -> None:
    parser = server_parser("python -m tests.support.stale_head_server")
    add_model_arguments(parser)
    run(parser, {"model": lambda args: keep_startup_head(served_generator(args))})


if __name__ == "__main__":
    main()
