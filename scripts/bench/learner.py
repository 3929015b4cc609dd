"""Benchmark: tokens/s and model FLOPs utilisation of the full learner update, against a peak measured in the run.

The timed call is one `learner.update.make_update_fn` call: proximal recompute + forward/backward + corrections
(decoupled PPO with token TIS) + AdamW, one mini-batch and one micro-batch, on a mesh over every local device.

Counted FLOPs per call (matmuls only; the embedding lookup is a gather and counts nothing)::

    8 * N * B * T                        6 N per token for forward + backward, 2 N for the recompute forward
    + 4 passes * 4 * B * T^2 * H * Dh * L  attention scores and weighted values (the full T x T square is computed)

where N is the number of matmul parameters (all parameters but an untied embedding table). Peak is the best
achieved FLOP/s of a large float32 matmul in the same run; MFU = counted FLOPs / time / peak.

Sampler replay overhead (PROCESSED logprobs): the full logprob pass of the update
(`learner.update.recompute_logprobs`,
model forward + chunked logprobs, jitted on the same mesh and batch) is timed at temperature `REPLAY.temperature`
without replay, and with `REPLAY` replayed per row; the calls alternate so that load on a shared machine hits both
alike, and the ratio of the medians is reported (target <= 1.3).

    python -m scripts.bench.learner [--configs tiny 100m] [--batch 16 4] [--length 128 128] [--steps 3] [--repeats 15]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import corrections
from learner.logprobs.sampler_replay import SamplerParams
from learner.model.sharding import make_mesh
from learner.model.transformer import ModelConfig, count_params, model_config
from learner.update.batch import TrainBatch
from learner.update.optimizer import OptimizerConfig, make_optimizer
from learner.update.step import UpdateConfig, make_update_fn, recompute_logprobs
from learner.update.train_state import create_sharded_train_state
from scripts.bench.common import timed

# The replayed sampler: top-k bounds the kept set, so the candidates decide every threshold (no full-sort fallback).
REPLAY = SamplerParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05)


def peak_flops(size: int = 2048, repeats: int = 5) -> float:
    """Best achieved FLOP/s of a ``size x size`` float32 matmul."""
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def update_flops(config: ModelConfig, batch: int, length: int) -> float:
    """Counted FLOPs of one update call (see the module docstring)."""
    embedding = 0 if config.tie_embeddings else config.vocab_size * config.hidden_size
    matmul_params = count_params(config) - embedding
    attention = 4 * batch * length**2 * config.num_heads * config.head_dim * config.num_layers
    return 8 * matmul_params * batch * length + 4 * attention


def synthetic_batch(config: ModelConfig, batch: int, length: int) -> TrainBatch:
    """Full-length rows: a prompt half and a trained completion half."""
    rng = np.random.default_rng(0)
    shape = (batch, length)
    loss_mask = np.broadcast_to(np.arange(length) >= length // 2, shape).astype(np.float32)
    return TrainBatch(tokens=rng.integers(0, config.vocab_size, shape).astype(np.int32),
                        positions=np.broadcast_to(np.arange(length, dtype=np.int32), shape),
                        attention_mask=np.ones(shape, bool), loss_mask=loss_mask,
                        advantages=np.broadcast_to(rng.normal(size=(batch, 1)), shape).astype(np.float32),
                        rollout_logprobs=np.where(loss_mask > 0, -rng.uniform(5, 12, shape), 0).astype(np.float32),
                        policy_version=np.zeros(shape, np.int32))


def logprob_pass_seconds(graphdef, params, batch: TrainBatch, update_config: UpdateConfig, mesh,
                         repeats: int) -> tuple[float, float]:
    """Median seconds of the update's logprob pass without and with sampler replay (see the module docstring)."""
    rows = batch.tokens.shape[0]
    replayed = batch.replace(sampling=SamplerParams.from_batch(SamplerParams(*(np.full(rows, x) for x in REPLAY))))
    passes = []
    for config, rollouts in ((dataclasses.replace(update_config, temperature=REPLAY.temperature), batch),
                             (update_config, replayed)):
        fn = jax.jit(lambda params, b, config=config: recompute_logprobs(graphdef, params, b, config, mesh))
        timed(fn, params, rollouts)  # compile
        passes.append((fn, rollouts))
    times = [[timed(fn, params, rollouts) for fn, rollouts in passes] for _ in range(repeats)]
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def update_setup(length: int) -> tuple:
    """The timed update's mesh (every local device), optimizer (AdamW) and `UpdateConfig` (decoupled PPO with token
    TIS) for rows of ``length`` tokens: what this benchmark and `scripts.bench.lora` time."""
    mesh = make_mesh(data=-1)
    optimizer = make_optimizer(OptimizerConfig(peak_learning_rate=1e-5, total_steps=1000))
    update_config = UpdateConfig(
        corrections=corrections.CorrectionConfig(importance=corrections.ImportanceWeights("token", high=2.0)),
        logprob_chunk_size=min(length, 512))
    return mesh, optimizer, update_config


def bench(name: str, batch_size: int, length: int, steps: int, repeats: int) -> dict:
    """Compile and time the update for one model config; returns a table row."""
    config = model_config(name)
    mesh, optimizer, update_config = update_setup(length)
    graphdef, state, shardings = create_sharded_train_state(config, optimizer, mesh)
    update = make_update_fn(graphdef, optimizer, update_config, mesh, shardings)
    batch = synthetic_batch(config, batch_size, length)
    start = time.perf_counter()
    state, metrics, _ = update(state, batch, None)
    jax.block_until_ready(metrics)
    compile_seconds = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics, _ = update(state, batch, None)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    logprob_s, replay_s = logprob_pass_seconds(graphdef, state.params, batch, update_config, mesh, repeats)
    del state
    seconds = float(np.median(times))
    flops = update_flops(config, batch_size, length)
    return dict(config=name, params=count_params(config), batch=batch_size, length=length,
                compile_s=compile_seconds, step_s=seconds, tokens_per_s=batch_size * length / seconds,
                flops=flops, flops_per_s=flops / seconds, logprob_s=logprob_s, replay_s=replay_s)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.learner", description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["tiny", "100m"])
    parser.add_argument("--batch", nargs="+", type=int, default=[16, 4], help="rows B, one per config")
    parser.add_argument("--length", nargs="+", type=int, default=[128, 128], help="tokens T, one per config")
    parser.add_argument("--steps", type=int, default=3, help="timed calls after the compiling one")
    parser.add_argument("--repeats", type=int, default=15, help="timed logprob passes, with and without replay")
    args = parser.parse_args()
    if not len(args.configs) == len(args.batch) == len(args.length):
        parser.error("--configs, --batch and --length need one value per config")
    peak = peak_flops()
    print(f"devices: {jax.device_count()} x {jax.devices()[0].device_kind}; "
          f"peak (float32 2048^3 matmul): {peak / 1e9:.1f} GFLOP/s")
    print(f"replayed sampler: {dict(REPLAY._asdict())}")
    header = ("config", "params", "B", "T", "compile s", "step s", "tokens/s", "GFLOP/step", "GFLOP/s", "MFU",
              "logprob pass s", "with replay s", "replay ratio")
    print(" | ".join(header))
    for name, batch_size, length in zip(args.configs, args.batch, args.length):
        row = bench(name, batch_size, length, args.steps, args.repeats)
        print(" | ".join([row["config"], f"{row['params'] / 1e6:.1f}M", str(row["batch"]), str(row["length"]),
                          f"{row['compile_s']:.1f}", f"{row['step_s']:.3f}", f"{row['tokens_per_s']:.0f}",
                          f"{row['flops'] / 1e9:.1f}", f"{row['flops_per_s'] / 1e9:.1f}",
                          f"{row['flops_per_s'] / peak:.1%}", f"{row['logprob_s']:.3f}", f"{row['replay_s']:.3f}",
                          f"{row['replay_s'] / row['logprob_s']:.3f}"]), flush=True)


if __name__ == "__main__":
    main()
