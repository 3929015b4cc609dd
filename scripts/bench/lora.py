"""Benchmark: LoRA against full fine-tuning at one model shape (issue #32, item 7; not a timed test).

For each mode (full fine-tuning, LoRA on every attention and MLP projection and, with ``--adapters N``, N such
adapters stacked on one base with the batch's rows dealt among them: multi-LoRA) a fresh process builds the train state
(and LoRA's frozen base), compiles one `learner.update.make_update_fn` call (decoupled PPO + token TIS + AdamW, one
mini-batch) and times the next ``--steps`` calls on a synthetic batch. Reported per mode:

* ``opt_state_mb``: the optimizer state's bytes (Adam's moments; LoRA's: the adapters' only);
* ``peak_memory_mb``: the process's peak resident memory (CPU), or the device's peak bytes in use (GPU / TPU, from
  ``memory_stats``), the compile included;
* ``update_s``: the median update call;
* ``publish_mb``: what one publish moves: every parameter for full fine-tuning; for LoRA the adapters alone (what
  an engine that loads adapters gets) and, as ``merged_publish_mb``, the merged weights (an engine that takes
  weights).

Goals (issue #32): LoRA's update time <= full fine-tuning's, its optimizer state <= 5% of it. On this shared CPU run
it briefly (``--model tiny``); on a quiet machine or a GPU::

    python -m scripts.bench.lora --model qwen2-0.5b --batch 8 --length 256 --steps 5
    python -m scripts.bench.lora --model llama-1b --batch 8 --length 1024 --steps 5 --dtype bfloat16   # a GPU
    python -m scripts.bench.lora --model 100m --batch 8 --length 128 --steps 3 --adapters 4   # multi-LoRA's cost
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

from scripts.bench.common import REPO_ROOT, checkout_env, write_json

MODES = ("full", "lora")


def _peak_memory_mb() -> float:
    import jax

    stats = jax.devices()[0].memory_stats() if jax.devices()[0].platform != "cpu" else None
    if stats and "peak_bytes_in_use" in stats:
        return stats["peak_bytes_in_use"] / 1e6
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3  # kilobytes on Linux


def _nbytes(tree) -> int:
    import jax

    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree) if hasattr(leaf, "dtype"))


def _progress(mode: str, message: str) -> None:
    print(f"scripts.bench.lora [{mode}]: {message}", file=sys.stderr, flush=True)  # on stderr: a timeout shows where


def measure(mode: str, model: str, rank: int, batch: int, length: int, steps: int, dtype: str, adapters: int
            ) -> dict:
    """One mode's numbers, in this process."""
    import dataclasses

    import jax
    import numpy as np
    from flax import nnx

    from learner.model.lora import LoraConfig
    from learner.model.transformer import Transformer, model_config
    from learner.update.step import make_update_fn
    from learner.update.train_state import create_sharded_frozen, create_sharded_train_state
    from scripts.bench.learner import synthetic_batch, update_setup

    config = model_config(model, dtype=dtype)  # float32 parameters (the frozen base too), ``dtype`` compute
    if mode in ("lora", "multi"):
        names = tuple(f"adapter{k}" for k in range(adapters)) if mode == "multi" else ()
        config = dataclasses.replace(config, lora=LoraConfig(rank=rank, alpha=2.0 * rank, adapters=names))
    mesh, optimizer, update_config = update_setup(length)
    start = time.perf_counter()
    graphdef, state, shardings = create_sharded_train_state(config, optimizer, mesh)
    frozen, frozen_shardings = create_sharded_frozen(config, mesh)
    jax.block_until_ready((state, frozen))
    _progress(mode, f"train state built in {time.perf_counter() - start:.1f} s")
    update = make_update_fn(graphdef, optimizer, update_config, mesh, shardings, frozen_shardings=frozen_shardings)
    data = synthetic_batch(config, batch, length)
    if mode == "multi":  # the rows dealt to the adapters in turn: every update trains all of them
        data = data.replace(adapter=np.arange(batch, dtype=np.int32) % adapters)
    start = time.perf_counter()
    state, metrics, _ = update(state, data, None, frozen)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - start
    _progress(mode, f"first update (compile included) in {compile_s:.1f} s")
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics, _ = update(state, data, None, frozen)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    base_bytes = _nbytes(nnx.state(nnx.eval_shape(lambda: Transformer(dataclasses.replace(config, lora=None),
                                                                      rngs=nnx.Rngs(0)))))
    row = dict(mode=mode, model=model, rank=None if mode == "full" else rank, adapters=adapters if mode == "multi" else
               None, batch=batch, length=length, dtype=dtype,
               backend=jax.default_backend(),
               trainable_mb=_nbytes(state.params) / 1e6, opt_state_mb=_nbytes(state.opt_state) / 1e6,
               peak_memory_mb=_peak_memory_mb(), compile_s=compile_s, update_s=statistics.median(times),
               publish_mb=_nbytes(state.params) / 1e6)
    if mode != "full":
        row["merged_publish_mb"] = base_bytes / 1e6
    return row


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.lora", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2-0.5b", help="learner.model.model_config name")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5, help="timed update calls after the compiling one")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="compute dtype")
    parser.add_argument("--out", help="also write the rows and the ratios to this JSON file")
    parser.add_argument("--adapters", type=int, default=1,
                        help="N > 1 also measures N stacked adapters (multi-LoRA), the rows dealt among them")
    parser.add_argument("--mode", choices=MODES + ("multi",),
                        help="measure one mode in this process (the driver's workers)")
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(measure(args.mode, args.model, args.rank, args.batch, args.length, args.steps, args.dtype,
                                 args.adapters)))
        return
    rows = []
    for mode in MODES + (("multi",) if args.adapters > 1 else ()):  # one process each: its own peak memory
        done = subprocess.run([sys.executable, "-m", "scripts.bench.lora", "--mode", mode, "--model", args.model,
                               "--rank", str(args.rank), "--batch", str(args.batch), "--length", str(args.length),
                               "--steps", str(args.steps), "--dtype", args.dtype, "--adapters", str(args.adapters)],
                              stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT, env=checkout_env())
        if done.returncode:
            sys.exit(f"scripts.bench.lora: the {mode} worker failed (exit {done.returncode}; its stderr is above)")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    keys = ("opt_state_mb", "update_s", "peak_memory_mb", "publish_mb")
    full, lora = rows[:2]
    ratios = {key: lora[key] / full[key] for key in keys}
    print(f"LoRA / full: optimizer state {ratios['opt_state_mb']:.4f} (goal <= 0.05), "
          f"update time {ratios['update_s']:.3f} (goal <= 1), peak memory {ratios['peak_memory_mb']:.3f}, "
          f"publish {ratios['publish_mb']:.4f}")
    results = {"rows": rows, "lora_over_full": ratios}
    if len(rows) == 3:
        results["multi_over_lora"] = {key: rows[2][key] / lora[key] for key in keys}
        print(f"{args.adapters} adapters mixed / one adapter: " + ", ".join(
            f"{key} {value:.3f}" for key, value in results["multi_over_lora"].items()))
    write_json(args.out, results)


if __name__ == "__main__":
    main()
