"""Time of the chunked logprob pass with and without sampler replay, measured in the same run.

The pass is `learner.logprobs.logprobs_from_hidden` (output projection, log-softmax, gather, chunk by chunk),
jitted,
forward only (the proximal-logprob recompute). "Without" divides by the temperature only; "with" replays the
per-sequence temperature, top-k, top-p and min-p in the engine's order (``--order first``: Tether's, temperature
first; ``--order last``: mlx-lm's, cut on the temperature-1 logits, ties broken by token id). Runs alternate so that
load on a shared machine hits both alike; the ratio of the medians is reported (target <= 1.3).

    python -m scripts.bench.sampler_replay --batch 4 --seq-len 256 --width 1024 --vocab 32768 --order last
"""

import argparse
import statistics

import jax
import jax.numpy as jnp

from learner.logprobs.chunked import logprobs_from_hidden
from learner.logprobs.sampler_replay import SamplerParams
from rollout_client.sampling_params import SamplerOrder
from scripts.bench.common import timed

ORDERS = {"first": SamplerOrder.TEMPERATURE_FIRST, "last": SamplerOrder.TEMPERATURE_LAST}


def main():
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.sampler_replay", description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--chunk-size", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--min-p", type=float, default=0.05)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--order", choices=ORDERS, default="first", help="the engine's sampler order")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    keys = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(keys[0], (args.batch, args.seq_len, args.width), jnp.float32)
    kernel = jax.random.normal(keys[1], (args.width, args.vocab), jnp.float32) * 3 / args.width ** 0.5
    tokens = jax.random.randint(keys[2], (args.batch, args.seq_len), 0, args.vocab)
    full = lambda value, dtype: jnp.full((args.batch,), value, dtype)
    order = ORDERS[args.order]
    sampling = SamplerParams(full(args.temperature, jnp.float32), full(args.top_k, jnp.int32),
                             full(args.top_p, jnp.float32), full(args.min_p, jnp.float32),
                             None if order == SamplerOrder.TEMPERATURE_FIRST else full(order, jnp.int32))
    plain = jax.jit(lambda h, k, t: logprobs_from_hidden(h, k, t, temperature=args.temperature,
                                                         chunk_size=args.chunk_size))
    replay = jax.jit(lambda h, k, t, s: logprobs_from_hidden(h, k, t, chunk_size=args.chunk_size, sampling=s))
    timed(plain, hidden, kernel, tokens)
    timed(replay, hidden, kernel, tokens, sampling)
    plain_s, replay_s = [], []
    for _ in range(args.repeats):
        plain_s.append(timed(plain, hidden, kernel, tokens))
        replay_s.append(timed(replay, hidden, kernel, tokens, sampling))
    without, with_replay = statistics.median(plain_s), statistics.median(replay_s)
    print(f"backend={jax.default_backend()} B={args.batch} T={args.seq_len} D={args.width} V={args.vocab} "
          f"chunk={args.chunk_size} top_k={args.top_k} top_p={args.top_p} min_p={args.min_p} order={order.name}")
    print(f"without replay: {without * 1e3:.1f} ms  with replay: {with_replay * 1e3:.1f} ms (medians of "
          f"{args.repeats})")
    print(f"ratio with/without: {with_replay / without:.3f} (target <= 1.3)")


if __name__ == "__main__":
    main()
