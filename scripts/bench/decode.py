"""Decode throughput of the reference server's model engine against its memory-bandwidth floor.

In this process: a `learner.serving.model_generator.ModelGenerator` of ``--model`` (random weights, ``--dtype``),
``--rows`` sequences prefilled (one prompt of ``--prompt-tokens``), then decode steps until each has
``--new-tokens`` tokens (random weights never stop early). Reported: decode tokens/s (rows x tokens / decode time,
prefill and compile excluded: every program is compiled first, `ModelGenerator.compile_all`'s).

The floor is what memory bandwidth allows: each decode step reads every weight once and the keys and values of every
row's context so far, ``bytes/step = weight bytes + rows x mean context x layers x 2 x kv_heads x head_dim x
itemsize``, so ``tokens/s <= rows x bandwidth / bytes/step``. The bandwidth is measured here (a device copy of 1 GiB,
read + write, best of 5), next to the spec's when the device is known. The engine's decode attends over every cache
slot of a row (``max_seq_len``), masked: its own bytes per step are reported too (``implementation_floor``).

Each `ModelGenerator.step` call is one program dispatch, one upload of the rows' state and one wait for the tokens
(tests/learner/serving/test_decode_dispatches.py): per generated token 1 / (rows x ``--steps-per-call``) of each.
Sampling without top-k, top-p or min-p (``--top-p 1``, the default, as the RL recipes sample) skips the sort of the
vocabulary; ``--top-p 0.9`` measures the decode with it.

    python -m scripts.bench.decode --model qwen2-0.5b --dtype bfloat16 --rows 128 --new-tokens 512   # a GPU
"""

from __future__ import annotations

import argparse
import pathlib
import time

import numpy as np

from scripts.bench.common import write_json

SPEC_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}  # bytes/s, SXM parts


def measured_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device memory bandwidth: a copy reads and writes ``nbytes``; best of 5."""
    import jax
    import jax.numpy as jnp

    source = jnp.ones(nbytes // 4, jnp.float32)
    copy = jax.jit(lambda x: x * 1.0)
    copy(source).block_until_ready()
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        copy(source).block_until_ready()
        best = min(best, time.perf_counter() - started)
    return 2 * nbytes / best


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.decode", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="learner.model.model_config name")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--steps-per-call", type=int, default=16, help="decode steps per jitted call")
    parser.add_argument("--top-p", type=float, default=1.0, help="< 1: every row cuts (the vocabulary sort runs)")
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args(argv)

    import jax
    from flax import nnx

    from learner.model import Transformer, count_params, model_config
    from learner.serving.model_generator import ModelGenerator
    from rollout_client.sampling_params import LogprobMode
    from rollout_client.server.generator import ResolvedSampling, SequenceSpec

    max_seq_len = args.prompt_tokens + args.new_tokens + args.steps_per_call
    config = model_config(args.model, max_seq_len=max(max_seq_len, 16))
    generator = ModelGenerator(Transformer(config, rngs=nnx.Rngs(0)), dtype=args.dtype, max_batch_size=args.rows,
                               max_seq_len=max_seq_len, decode_steps_per_call=args.steps_per_call)
    started = time.perf_counter()
    generator.compile_all()
    compile_s = time.perf_counter() - started
    sampling = ResolvedSampling(temperature=1.0, top_k=0, top_p=args.top_p, min_p=0.0, max_new_tokens=args.new_tokens,
                                stop_token_ids=(), seed=0)
    prompt = np.random.default_rng(0).integers(0, config.vocab_size, args.prompt_tokens).astype(np.int32)
    started = time.perf_counter()
    for row in range(args.rows):
        generator.add(row, SequenceSpec(prompt, sampling, row, LogprobMode.RAW))
    jax.block_until_ready(generator._cache)
    prefill_s = time.perf_counter() - started
    calls = -(-(args.new_tokens - 1) // args.steps_per_call)
    started = time.perf_counter()
    for _ in range(calls):
        generator.step()  # returns host arrays: every call waits for its tokens, as the scheduler does
    decode_s = time.perf_counter() - started
    tokens = args.rows * calls * args.steps_per_call

    itemsize = np.dtype(args.dtype).itemsize
    weight_bytes = count_params(config) * itemsize
    kv_per_slot = config.num_layers * 2 * config.num_kv_heads * config.head_dim * itemsize
    mean_context = args.prompt_tokens + calls * args.steps_per_call / 2
    ideal_step_bytes = weight_bytes + args.rows * mean_context * kv_per_slot
    engine_step_bytes = weight_bytes + args.rows * max_seq_len * kv_per_slot
    bandwidth = measured_bandwidth()
    device = jax.devices()[0]
    spec = next((value for name, value in SPEC_BANDWIDTH.items() if name in getattr(device, "device_kind", "")), None)
    result = {"model": args.model, "parameters": count_params(config), "dtype": args.dtype, "rows": args.rows,
              "new_tokens": args.new_tokens, "top_p": args.top_p, "decode_calls": calls,
              "dispatches_per_token": 1 / (args.rows * args.steps_per_call), "device": str(device),
              "compile_s": compile_s, "prefill_s": prefill_s,
              "decode_s": decode_s, "decode_tokens_per_s": tokens / decode_s, "measured_bandwidth": bandwidth,
              "spec_bandwidth": spec,
              "floor_tokens_per_s": args.rows * bandwidth / ideal_step_bytes,
              "implementation_floor_tokens_per_s": args.rows * bandwidth / engine_step_bytes}
    print(f"{args.model} {args.dtype} on {device}: {args.rows} rows x {args.new_tokens} new tokens, top_p "
          f"{args.top_p:g}: decode {result['decode_tokens_per_s']:,.0f} tokens/s ({decode_s:.2f} s in {calls} calls of "
          f"{args.steps_per_call} steps: {decode_s / calls * 1e3:.1f} ms a call; prefill {prefill_s:.2f} s, compile "
          f"{compile_s:.1f} s)", flush=True)
    print(f"floor at {bandwidth / 1e9:,.0f} GB/s measured{f' (spec {spec / 1e9:,.0f})' if spec else ''}: "
          f"{result['floor_tokens_per_s']:,.0f} tokens/s (weights + live KV per step); "
          f"{result['implementation_floor_tokens_per_s']:,.0f} reading every cache slot as the engine does; "
          f"reached {result['decode_tokens_per_s'] / result['floor_tokens_per_s']:.0%} of the floor", flush=True)
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
