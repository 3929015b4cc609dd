"""The sampler's truncation (temperature, top-k, top-p, min-p): ONE implementation for the server and the learner.

The reference server samples from this transform, and the learner replays it on its own logits so that PROCESSED
logprobs of both sides are of the same distribution (otherwise every importance ratio is off by the log of the kept
probability mass). Order, each step acting on the renormalised result of the previous one:

1. temperature: ``scaled = logits / temperature``.
2. top-k (k > 0): keep tokens whose scaled logit is >= the k-th largest.
3. top-p (p < 1): sort the kept tokens by probability, descending; keep each token whose mass strictly above its
   value is < p (the smallest prefix reaching p).
4. min-p (m > 0): keep tokens whose probability is >= m times the largest.

Ties at a cutoff are all kept (or all dropped), so the result does not depend on sort order. Every step keeps the
tokens at or above a value, so the kept set is ``scaled >= threshold`` for one threshold per position:
`kept_threshold` computes it from the scaled logits sorted in descending order. The server sorts the full vocabulary;
the learner sorts only the candidates from `top_candidates` and falls back to the full sort when they are too few.
"""

import math

import jax
import jax.numpy as jnp


def kept_threshold(desc: jax.Array, log_normalizer: jax.Array, top_k: jax.Array, top_p: jax.Array,
                   min_p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The threshold of the kept set ``scaled >= threshold``, from descending scaled logits.

    Args:
      desc: ``[..., K]`` the largest scaled logits in descending order; -inf marks unknown entries (every token
        not listed is <= the last finite entry). ``K = V`` with no -inf entry is the full vocabulary.
      log_normalizer: ``[...]`` logsumexp of all V scaled logits.
      top_k: ``[...]`` int, 0 disables.
      top_p: ``[...]`` in (0, 1]; 1 disables.
      min_p: ``[...]`` in [0, 1); 0 disables.

    Returns:
      ``(threshold, determined)``: float32 ``[...]`` and bool ``[...]``; ``determined`` is False when the kept
      set may reach beyond the finite entries of ``desc`` (the threshold is then meaningless).

    >>> desc = jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05]))
    >>> threshold, determined = kept_threshold(desc, 0.0, 0, 0.7, 0.0)
    >>> round(float(jnp.exp(threshold)), 3), bool(determined)
    (0.3, True)
    """
    top_k, top_p, min_p, log_normalizer = (jnp.asarray(x) for x in (top_k, top_p, min_p, log_normalizer))
    size = desc.shape[-1]
    finite = desc > -jnp.inf
    num_finite = jnp.sum(finite, axis=-1)
    top_k_on = top_k > 0
    top_k_index = jnp.clip(top_k, 1, size)[..., None] - 1
    top_k_threshold = jnp.where(top_k_on, jnp.take_along_axis(desc, top_k_index, axis=-1)[..., 0], -jnp.inf)
    in_top_k = desc >= top_k_threshold[..., None]
    log_top_k_mass = jnp.where(top_k_on, jax.nn.logsumexp(jnp.where(in_top_k, desc, -jnp.inf), axis=-1),
                               log_normalizer)
    probs = jnp.where(in_top_k, jnp.exp(desc - log_top_k_mass[..., None]), 0.0)
    cumulative = jnp.cumsum(probs, axis=-1)
    mass_above = jnp.concatenate([jnp.zeros_like(cumulative[..., :1]), cumulative[..., :-1]], axis=-1)
    num_top_p = jnp.sum(in_top_k & (mass_above < top_p[..., None]), axis=-1)
    last_top_p = jnp.take_along_axis(desc, jnp.maximum(num_top_p, 1)[..., None] - 1, axis=-1)[..., 0]
    top_p_threshold = jnp.where(top_p < 1.0, last_top_p, -jnp.inf)
    min_p_threshold = jnp.where(min_p > 0, desc[..., 0] + jnp.log(jnp.maximum(min_p, 1e-30)), -jnp.inf)
    threshold = jnp.maximum(jnp.maximum(top_k_threshold, top_p_threshold), min_p_threshold)
    num_kept = jnp.sum(desc >= threshold[..., None], axis=-1)
    complete = num_finite == size
    top_k_known = ~top_k_on | (top_k <= num_finite)
    cut_known = (num_kept < num_finite) | (top_k_on & (top_k <= num_finite))
    return threshold, complete | (top_k_known & cut_known)


def descending(scaled: jax.Array) -> jax.Array:
    """All scaled logits ``[..., V]`` in descending order (the full-vocabulary input of `kept_threshold`)."""
    return jnp.flip(jnp.sort(scaled, axis=-1), axis=-1)


def top_candidates(scaled: jax.Array, num_blocks: int = 64, block_size: int = 32) -> jax.Array:
    """The largest scaled logits in descending order, -inf past the ones known exactly; a cheap `descending`.

    The vocabulary is cut into blocks; the ``num_blocks`` blocks with the largest maxima are sorted, which is far
    cheaper than sorting ``V`` (XLA's CPU sort is ~10x the output projection). Every entry above the next block's
    maximum is exact and in order; the rest are -inf.

    >>> top_candidates(jnp.array([0., 5., 1., 4., 2., 3.]), num_blocks=1, block_size=2).tolist()
    [5.0, -inf]
    """
    vocab_size = scaled.shape[-1]
    num_all = math.ceil(vocab_size / block_size)
    if num_all <= num_blocks:
        return descending(scaled)
    padding = [(0, 0)] * (scaled.ndim - 1) + [(0, num_all * block_size - vocab_size)]
    blocks = jnp.pad(scaled, padding, constant_values=-jnp.inf).reshape(*scaled.shape[:-1], num_all, block_size)
    block_max = jnp.max(blocks, axis=-1)
    order = jnp.argsort(-block_max, axis=-1)
    bound = jnp.take_along_axis(block_max, order[..., num_blocks:num_blocks + 1], axis=-1)
    chosen = jnp.take_along_axis(blocks, order[..., :num_blocks, None], axis=-2)
    desc = descending(chosen.reshape(*scaled.shape[:-1], num_blocks * block_size))
    return jnp.where(desc > bound, desc, -jnp.inf)


def processed_logprobs(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                       min_p: jax.Array) -> jax.Array:
    """Log-probabilities of the sampling distribution for one position (the server's PROCESSED logprobs).

    Args:
      logits: float32 [V].
      temperature: > 0.
      top_k: int, 0 disables.
      top_p: in (0, 1]; 1 disables.
      min_p: in [0, 1); 0 disables.

    Returns:
      float32 [V], -inf outside the kept set.

    >>> logp = processed_logprobs(jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05])), 1.0, 0, 0.7, 0.0)
    >>> [round(float(p), 3) for p in jnp.exp(logp)]
    [0.625, 0.375, 0.0, 0.0]
    """
    scaled = logits.astype(jnp.float32) / temperature
    threshold, _ = kept_threshold(descending(scaled), jax.nn.logsumexp(scaled), top_k, top_p, min_p)
    return jax.nn.log_softmax(jnp.where(scaled >= threshold, scaled, -jnp.inf))
