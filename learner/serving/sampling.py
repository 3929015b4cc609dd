"""Drawing one token from the sampling distribution.

The transform itself (temperature, then top-k, top-p, min-p) lives in `learner.logprobs.sampling_transform`: the learner
replays the same code on its own logits, so PROCESSED logprobs of both sides are of the same distribution.
PROCESSED logprobs are ``log_softmax`` of the kept scaled logits (-inf elsewhere); RAW logprobs are
``log_softmax(logits)`` of the untouched model logits.
"""

import functools

import jax
import jax.numpy as jnp

from learner.logprobs.sampling_transform import processed_logprobs, uncut


def sample_token(logits: jax.Array, key: jax.Array, temperature, top_k, top_p, min_p, processed_mode,
                 cut: bool = True) -> tuple[jax.Array, jax.Array]:
    """Draws one token from the processed distribution (``cut=False``: top-k, top-p and min-p are known to be off,
    `processed_logprobs`).

    Returns:
      (token id int32, its logprob: processed if `processed_mode`, else raw).
    """
    processed = processed_logprobs(logits, temperature, top_k, top_p, min_p, cut=cut)
    token = jax.random.categorical(key, processed).astype(jnp.int32)
    raw = jax.nn.log_softmax(logits.astype(jnp.float32))
    return token, jnp.where(processed_mode, processed[token], raw[token])


def sample_rows(logits: jax.Array, keys: jax.Array, temperature, top_k, top_p, min_p, processed_mode
                ) -> tuple[jax.Array, jax.Array]:
    """`sample_token` for each row of ``logits`` ``[R, V]`` (the other arguments ``[R]``): the same numbers, but when
    no row cuts its distribution (no top-k, top-p or min-p, as in most RL sampling) the sort of the vocabulary that
    finds the cut is skipped. That sort is a bitonic network over the vocabulary padded to a power of two, so it
    reads and writes every row's logits ~log2(V)^2 / 2 times (171 times at Qwen's 151,936 tokens): far more than the
    decode step's weights at a small model. One `jax.lax.cond` on a predicate shared by all rows: under `jax.vmap`
    a per-row predicate would run both branches."""
    arguments = (logits, keys, temperature, top_k, top_p, min_p, processed_mode)
    return jax.lax.cond(uncut(top_k, top_p, min_p),
                        jax.vmap(functools.partial(sample_token, cut=False)), jax.vmap(sample_token), *arguments)
