"""Compiled temporary memory of loss + gradient through the logprob head: chunked vs unchunked.

Only the output head is benchmarked (hidden ``[B, T, D]`` @ kernel ``[D, V]`` -> log-softmax -> gather), which is
where ``[B, T, V]`` float32 logits would live. Nothing is executed: the numbers come from XLA's memory analysis of
the compiled program on the default backend.

    python -m scripts.bench.logprob_memory --batch 8 --seq-len 4096 --vocab 32768 --chunk-size 512
"""

import argparse

import jax
import jax.numpy as jnp

from learner.logprobs.chunked import logprobs_from_hidden


def unchunked_logprobs(hidden, kernel, tokens, mask):
    """The plain computation that materialises [B, T, V] float32 logits."""
    logp = jax.nn.log_softmax(jnp.einsum("btd,dv->btv", hidden, kernel, preferred_element_type=jnp.float32))
    lp = jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.where(mask, jnp.pad(lp, ((0, 0), (1, 0))), 0.0)


def temp_bytes(logprob_fn, batch, seq_len, width, vocab):
    """Temporary bytes of the compiled ``grad(sum(mask * logprobs))`` with respect to hidden and kernel."""

    def loss(hidden, kernel, tokens, mask):
        return jnp.sum(mask * logprob_fn(hidden, kernel, tokens, mask))

    args = (jax.ShapeDtypeStruct((batch, seq_len, width), jnp.float32),
            jax.ShapeDtypeStruct((width, vocab), jnp.float32),
            jax.ShapeDtypeStruct((batch, seq_len), jnp.int32),
            jax.ShapeDtypeStruct((batch, seq_len), jnp.bool_))
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def main():
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.logprob_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--chunk-size", type=int, default=512)
    args = parser.parse_args()
    shape = (args.batch, args.seq_len, args.width, args.vocab)
    full = temp_bytes(unchunked_logprobs, *shape)
    chunked = temp_bytes(lambda h, k, t, m: logprobs_from_hidden(h, k, t, m, chunk_size=args.chunk_size), *shape)
    logits_bytes = args.batch * args.seq_len * args.vocab * 4
    print(f"backend={jax.default_backend()} B={args.batch} T={args.seq_len} D={args.width} V={args.vocab} "
          f"chunk={args.chunk_size}; one [B,T,V] f32 logits = {logits_bytes / 2**30:.2f} GiB")
    print(f"unchunked temp: {full / 2**30:.3f} GiB")
    print(f"chunked temp:   {chunked / 2**30:.3f} GiB")
    print(f"ratio chunked/unchunked: {chunked / full:.3f} (target <= 0.25)")


if __name__ == "__main__":
    main()
