"""The reference server with the learner's model generator: ``python -m learner.serving --help``.

The server shell (network, auth, TLS, drain, policy version) is `rollout_client.server.cli`'s; this entry point adds
the model generator's arguments. The model is a Hugging Face checkpoint directory (--hf-path: the config from its
config.json, the weights from its safetensors) or a named config (--model-config) with random weights (from --seed);
--weights then replaces the initial weights with a safetensors file or an orbax checkpoint in the server's naming.
"""

import argparse
import pathlib
import time

from flax import nnx

from learner.checkpoints.hf_checkpoint import model_config_from_checkpoint
from learner.checkpoints.safetensors_io import load_safetensors
from learner.model.precision import MATMUL_PRECISIONS, resolve_matmul_precision
from learner.model.transformer import Transformer, model_config
from learner.reporting.compiles import enable_compilation_cache
from learner.serving.model_generator import ModelGenerator
from rollout_client.protocol import pb
from rollout_client.server.cli import run, server_parser
from rollout_client.server.weights_io import load_weights


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model generator's own arguments."""
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--hf-path", help="Hugging Face checkpoint directory (config.json + *.safetensors) to serve")
    model.add_argument("--model-config", help="name for learner.model.model_config, random weights (default: tiny)")
    parser.add_argument("--dtype", default="float32", help="compute dtype of the served model")
    parser.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the learner's parameter dtype: the dtype of the weights the server accepts")
    parser.add_argument("--weights-dtype", choices=("float32", "bfloat16", "float16"),
                        help="the dtype of the weights the server accepts (default: --param-dtype); a learner that "
                             "casts to the serving dtype on its device sends --dtype")
    parser.add_argument("--weights", help="initial weights (safetensors file or orbax dir); default: random")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random initial weights")
    parser.add_argument("--decode-steps-per-call", type=int, default=8,
                        help="decode steps fused into one jitted call")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="decode every cache row at every step, so that a sample's tokens and logprobs do not "
                             "depend on the other requests in the batch (reproducible runs; slower when few run)")
    parser.add_argument("--precompile", action="store_true",
                        help="compile every prefill and decode program before serving (what a run's embedded server "
                             "does), so that no request waits on a compile; else each compiles at its first use")
    parser.add_argument("--partial", action="store_true",
                        help="with --precompile, also compile the KV-cache recompute programs that a publish keeping "
                             "sequences runs (partial rollouts), so that no publish waits on a compile")
    parser.add_argument("--matmul-precision", default="auto", choices=MATMUL_PRECISIONS,
                        help="precision of every matmul; auto: highest for float32 compute, else default")


def build_model_generator(args: argparse.Namespace) -> ModelGenerator:
    """The model generator the arguments describe; without --eos-ids a request without stop tokens runs to its end."""
    if args.hf_path:
        # The served length bounds the sequences: a sliding window at least that long is no window.
        config = model_config_from_checkpoint(args.hf_path, max_seq_len=args.max_seq_len,
                                              param_dtype=args.param_dtype)
        # Shapes only: every parameter is the checkpoint's (load_safetensors raises on a missing one), so a random
        # initialisation would compile and run for nothing.
        model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(args.seed)))
        load_safetensors(model, args.hf_path)
    else:
        config = model_config(args.model_config or "tiny", param_dtype=args.param_dtype)
        model = Transformer(config, rngs=nnx.Rngs(args.seed))
    generator = ModelGenerator(model, dtype=args.dtype, max_batch_size=args.max_batch_size,
                               max_seq_len=args.max_seq_len, decode_steps_per_call=args.decode_steps_per_call,
                               eos_token_ids=tuple(args.eos_ids or ()),
                               matmul_precision=resolve_matmul_precision(args.matmul_precision, args.dtype),
                               batch_invariant=args.batch_invariant, weights_dtype=args.weights_dtype)
    if args.weights:
        weights_format = (pb.WEIGHTS_FORMAT_SAFETENSORS if pathlib.Path(args.weights).suffix == ".safetensors"
                          else pb.WEIGHTS_FORMAT_ORBAX)
        weights = pathlib.Path(args.weights)
        generator.load_weights(load_weights(weights.name, weights_format, generator.weight_readers, weights.parent))
    return generator


def served_generator(args: argparse.Namespace) -> ModelGenerator:
    """`build_model_generator`, its programs compiled first with ``--precompile`` (before the server serves: no
    request waits on a compile)."""
    generator = build_model_generator(args)
    if args.precompile:
        what = "prefill, decode and recompute" if args.partial else "prefill and decode"
        print(f"compiling {generator.program_count(recompute=args.partial)} {what} programs", flush=True)
        started = time.perf_counter()
        programs = generator.compile_all(recompute=args.partial)
        print(f"compiled {programs} {what} programs in {time.perf_counter() - started:.1f} s", flush=True)
    return generator


def main(argv: list[str] | None = None) -> None:
    enable_compilation_cache()  # the learner's (it passes JAX_COMPILATION_CACHE_DIR on): a rerun loads the programs
    parser = server_parser("python -m learner.serving", __doc__)
    add_model_arguments(parser)
    run(parser, {"model": served_generator}, argv)


if __name__ == "__main__":
    main()
