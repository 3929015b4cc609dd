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
`kept_threshold` computes it from the largest scaled logits in descending order, with prefix sums whose entry ``r``
depends only on the first ``r + 1`` logits, so a correct prefix of the sorted vocabulary gives the same threshold,
bit for bit, as all of it. XLA:CPU's sort calls a comparator per comparison and costs ~10x the output projection,
so neither side uses it: `descending` sorts with a bitonic network of elementwise max / min (the server, and the
learner up to `FULL_SORT_MAX_VOCAB` tokens); above that the learner takes the candidates of `top_candidates`
(`jax.lax.top_k`, a partial sort) and falls back to `descending` when they are too few.
"""

import jax
import jax.numpy as jnp
import numpy as np

FULL_SORT_MAX_VOCAB = 1024  # Up to this vocabulary size the bitonic sort of all tokens beats jax.lax.top_k(64).


def kept_threshold(desc: jax.Array, log_normalizer: jax.Array, top_k: jax.Array, top_p: jax.Array,
                   min_p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The threshold of the kept set ``scaled >= threshold``, from descending scaled logits.

    Args:
      desc: ``[..., K]`` the largest scaled logits in descending order; -inf marks unknown entries (every token
        not listed is < the last finite entry). ``K = V`` with no -inf entry is the full vocabulary.
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
    num_finite = jnp.sum(desc > -jnp.inf, axis=-1)
    top_k_on = top_k > 0
    top_k_index = jnp.clip(top_k, 1, size)[..., None] - 1
    top_k_threshold = jnp.where(top_k_on, jnp.take_along_axis(desc, top_k_index, axis=-1)[..., 0], -jnp.inf)
    in_top_k = desc >= top_k_threshold[..., None]
    largest = desc[..., 0]
    weights = jnp.exp(desc - largest[..., None])  # probabilities times exp(largest - log_normalizer)
    cumulative = prefix_sums(weights)
    last_top_k = jnp.sum(in_top_k, axis=-1, keepdims=True) - 1
    top_k_mass = jnp.where(top_k_on, jnp.take_along_axis(cumulative, last_top_k, axis=-1)[..., 0],
                           jnp.exp(log_normalizer - largest))
    mass_above = jnp.concatenate([jnp.zeros_like(cumulative[..., :1]), cumulative[..., :-1]], axis=-1)
    num_top_p = jnp.sum(in_top_k & (mass_above < (top_p * top_k_mass)[..., None]), axis=-1)
    last_top_p = jnp.take_along_axis(desc, jnp.maximum(num_top_p, 1)[..., None] - 1, axis=-1)[..., 0]
    top_p_threshold = jnp.where(top_p < 1.0, last_top_p, -jnp.inf)
    min_p_threshold = jnp.where(min_p > 0, largest + jnp.log(jnp.maximum(min_p, 1e-30)), -jnp.inf)
    threshold = jnp.maximum(jnp.maximum(top_k_threshold, top_p_threshold), min_p_threshold)
    num_kept = jnp.sum(desc >= threshold[..., None], axis=-1)
    complete = num_finite == size
    top_k_known = ~top_k_on | (top_k <= num_finite)
    cut_known = (num_kept < num_finite) | (top_k_on & (top_k <= num_finite))
    return threshold, complete | (top_k_known & cut_known)


def prefix_sums(x: jax.Array) -> jax.Array:
    """Inclusive sums along the last axis (Hillis-Steele: log2 steps of shifted adds); entry ``r`` is computed from
    ``x[..., :r + 1]`` alone, in an order that does not depend on the length.

    >>> prefix_sums(jnp.array([1., 2., 3., 4., 5.])).tolist()
    [1.0, 3.0, 6.0, 10.0, 15.0]
    """
    shift = 1
    while shift < x.shape[-1]:
        x = x + jnp.pad(x[..., :-shift], [(0, 0)] * (x.ndim - 1) + [(shift, 0)])
        shift *= 2
    return x


def descending(scaled: jax.Array) -> jax.Array:
    """All scaled logits ``[..., V]`` in descending order (the full-vocabulary input of `kept_threshold`).

    A bitonic sorting network over the vocabulary padded with -inf to a power of two, laid out vocabulary-major so
    that every compare-exchange step is an elementwise max / min of contiguous rows: the values of `jnp.sort`, ~10x
    faster on XLA:CPU.

    >>> descending(jnp.array([[1., 3., 2.], [0., -1., 0.]])).tolist()
    [[3.0, 2.0, 1.0], [0.0, 0.0, -1.0]]
    """
    vocab_size = scaled.shape[-1]
    size = 1 << max(vocab_size - 1, 1).bit_length()
    x = jnp.pad(scaled.reshape(-1, vocab_size), ((0, 0), (0, size - vocab_size)), constant_values=-jnp.inf).T
    rows = x.shape[1]
    run = 2
    while run <= size:  # Merge bitonic runs into sorted runs of length `run`, alternately descending and ascending.
        stride = run // 2
        while stride:
            pairs = x.reshape(size // (2 * stride), 2, stride, rows)
            high, low = jnp.maximum(pairs[:, 0], pairs[:, 1]), jnp.minimum(pairs[:, 0], pairs[:, 1])
            down = jnp.asarray((np.arange(0, size, 2 * stride) & run) == 0)[:, None, None]
            x = jnp.stack([jnp.where(down, high, low), jnp.where(down, low, high)], axis=1).reshape(size, rows)
            stride //= 2
        run *= 2
    return x[:vocab_size].T.reshape(scaled.shape)


def top_candidates(scaled: jax.Array, count: int = 64) -> jax.Array:
    """The largest scaled logits in descending order, -inf past the ones known exactly; a cheap `descending`.

    Up to `FULL_SORT_MAX_VOCAB` tokens, all of them (`descending`). Beyond, the ``count`` largest from
    `jax.lax.top_k` (XLA:CPU's partial sort, a fraction of a full sort), with the smallest of them set to -inf: a
    token not listed may tie with it, and `kept_threshold` needs every token not listed below the finite entries.

    >>> top_candidates(jnp.arange(2000.) % 1000, count=3).tolist()
    [999.0, 999.0, -inf]
    """
    if scaled.shape[-1] <= FULL_SORT_MAX_VOCAB:
        return descending(scaled)
    largest = jax.lax.top_k(scaled, count)[0]
    # The minimum, not a slice: a slice of the output would stop XLA:CPU from rewriting top_k's sort into TopK.
    return jnp.where(largest > jnp.min(largest, axis=-1, keepdims=True), largest, -jnp.inf)


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
