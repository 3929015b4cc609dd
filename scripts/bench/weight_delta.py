"""How much of a published weight set changes between two versions: the case for (or against) a delta publish.

One optimizer step of the learner's own optimizer (`learner.update.optimizer.make_optimizer`, Adam with the
``--learning-rate`` of an RL run) on float32 master weights of ``--model`` (random), from the gradient of the
next-token loss on a random batch; then both versions as the engine receives them (`learner.rl.trainer.host_arrays`
cast to ``--dtype`` on the device), compared word by word. Reported: the fraction of words that changed, what a
delta would send (a bitmap of changed words + their values, or 4-byte indices + values, whichever is smaller)
against the full payload, and on this host the time of one memcpy of the payload against the time to find the
changed words (a compare of the two versions: what the learner would pay before every shared-memory publish).

Adam's update moves every weight by about the learning rate, far below a bfloat16 word's spacing (~0.4% of its
value), so few bfloat16 words change; float32 words almost all do.

    python -m scripts.bench.weight_delta --model small --dtype bfloat16 --learning-rate 1e-6
"""

from __future__ import annotations

import argparse
import pathlib
import time

import numpy as np

from scripts.bench.common import write_json


def best_seconds(function, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - started)
    return best


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.weight_delta", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="learner.model.model_config name")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="the published dtype")
    parser.add_argument("--learning-rate", type=float, default=1e-6)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from learner.model import Transformer, model_config
    from learner.rl.trainer import host_arrays
    from learner.update.optimizer import OptimizerConfig, make_optimizer

    config = model_config(args.model, max_seq_len=args.length)
    graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (args.rows, args.length), 0, config.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(args.length), tokens.shape)

    def loss(params):
        model = nnx.merge(graphdef, params)
        logits = model.logits(model(tokens[:, :-1], positions[:, :-1])).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    optimizer = make_optimizer(OptimizerConfig(peak_learning_rate=args.learning_rate))
    before = host_arrays(params, args.dtype)
    updates, _ = jax.jit(lambda p: optimizer.update(jax.grad(loss)(p), optimizer.init(p), p))(params)
    after = host_arrays(optax.apply_updates(params, updates), args.dtype)

    words = {name: (np.ascontiguousarray(before[name]).reshape(-1).view(f"u{before[name].itemsize}"),
                    np.ascontiguousarray(after[name]).reshape(-1).view(f"u{after[name].itemsize}"))
             for name in before}
    total = sum(old.size for old, _ in words.values())
    changed = sum(int(np.count_nonzero(old != new)) for old, new in words.values())
    itemsize = np.dtype(args.dtype).itemsize
    full_bytes = total * itemsize
    delta_bytes = changed * itemsize + min(-(-total // 8), 4 * changed)
    old_flat = np.concatenate([old for old, _ in words.values()])
    new_flat = np.concatenate([new for _, new in words.values()])
    target = np.empty_like(new_flat)
    memcpy_s = best_seconds(lambda: np.copyto(target, new_flat))
    compare_s = best_seconds(lambda: np.flatnonzero(old_flat != new_flat))
    result = {"model": args.model, "dtype": args.dtype, "learning_rate": args.learning_rate, "words": total,
              "changed_words": changed, "changed_fraction": changed / total, "full_bytes": full_bytes,
              "delta_bytes": delta_bytes, "memcpy_s": memcpy_s, "find_changes_s": compare_s}
    print(f"{args.model} {args.dtype} after one Adam step at lr {args.learning_rate:g}: {changed:,} of {total:,} words "
          f"changed ({changed / total:.2%}); delta {delta_bytes / 1e6:,.2f} MB vs full {full_bytes / 1e6:,.2f} MB "
          f"({delta_bytes / full_bytes:.1%}); here a memcpy of the payload takes {memcpy_s * 1e3:.2f} ms, finding "
          f"the changed words {compare_s * 1e3:.2f} ms", flush=True)
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
