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
bit for bit, as all of it.

mlx-lm's order (the learner replays it for the MLX engine, `learner.logprobs.sampler_replay`) cuts the temperature-1
logits
with the same thresholds, top-p over the whole vocabulary (``top_p_after_top_k=False``), then applies the
temperature to the kept set; it breaks ties at a cut by token id, which `kept_by_rank` reproduces.

XLA:CPU's sort calls a comparator per comparison and costs ~10x the output projection, so neither side uses it:
`descending` sorts with a bitonic network of elementwise max / min (the server, and the learner's fallback), and
the learner takes the candidates of `top_candidates`: up to `NETWORK_MAX_VOCAB` tokens the same network stopped at
the ``count`` largest (blocks of ``count`` sorted, then merged pairwise keeping the larger half), above
`jax.lax.top_k` (a partial sort); it falls back to `descending` when they are too few. Sorted logits are laid out
vocabulary-major (``[K, ...]``, the sorted axis first) from the network through `kept_threshold`: every
compare-exchange and prefix-sum step is then an elementwise operation on contiguous rows, with no transpose between
them (a vocabulary-last `kept_threshold` after the network cost more than the network itself).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

NETWORK_MAX_VOCAB = 1024  # Up to this vocabulary size the bitonic network beats jax.lax.top_k(64) on XLA:CPU.


class Cut(NamedTuple):
    """Where a sampler cuts one position's descending logits (``[...]`` arrays, from `kept_threshold`)."""

    threshold: jax.Array  # float32: the kept set with ties at the cut kept together is ``logits >= threshold``
    determined: jax.Array  # bool: False when the cut may lie beyond the finite entries of desc (then meaningless)
    last: jax.Array  # float32: the value of the last kept token when ties are broken by rank (`kept_by_rank`)
    ties_from: jax.Array  # int32: of the tokens equal to ``last`` in id order, those ranked in
    ties_to: jax.Array  # [ties_from, ties_to) are kept when ties are broken by rank


def kept_threshold(desc: jax.Array, log_normalizer: jax.Array, top_k: jax.Array, top_p: jax.Array,
                   min_p: jax.Array, top_p_after_top_k: jax.Array | bool = True) -> Cut:
    """The kept set of one sampler's top-k, top-p and min-p, from descending logits on the scale they see.

    Args:
      desc: ``[K, ...]`` the largest logits in descending order along the first axis (vocabulary-major);
        -inf marks unknown entries (every token not listed is < the last finite entry). ``K = V`` with no -inf
        entry is the full vocabulary.
      log_normalizer: ``[...]`` logsumexp of all V logits.
      top_k: ``[...]`` int, 0 disables.
      top_p: ``[...]`` in (0, 1]; 1 disables.
      min_p: ``[...]`` in [0, 1); 0 disables.
      top_p_after_top_k: ``[...]`` bool: top-p cuts the mass of the top-k set (Tether's order) rather than of the
        whole vocabulary (mlx-lm's).

    Returns:
      A `Cut`: the threshold with ties at the cut kept together, and the cut within the tied group when ties
      are broken by rank (top-k keeps the first k tokens in descending order, top-p the prefix whose mass before
      each token is < p, min-p whole groups).

    >>> desc = jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05]))
    >>> cut = kept_threshold(desc, 0.0, 0, 0.7, 0.0)
    >>> round(float(jnp.exp(cut.threshold)), 3), bool(cut.determined)
    (0.3, True)
    """
    top_k, top_p, min_p, log_normalizer = (jnp.asarray(x) for x in (top_k, top_p, min_p, log_normalizer))
    size = desc.shape[0]
    num_finite = jnp.sum(desc > -jnp.inf, axis=0)
    top_k_on = top_k > 0
    top_k_threshold = jnp.where(top_k_on, at_row(desc, jnp.clip(top_k, 1, size) - 1), -jnp.inf)
    in_top_k = desc >= top_k_threshold
    largest = desc[0]
    weights = jnp.exp(desc - largest)  # probabilities times exp(largest - log_normalizer)
    cumulative = prefix_sums(weights)
    top_p_mass = jnp.where(top_k_on & top_p_after_top_k, at_row(cumulative, jnp.sum(in_top_k, axis=0) - 1),
                           jnp.exp(log_normalizer - largest))
    mass_above = jnp.concatenate([jnp.zeros_like(cumulative[:1]), cumulative[:-1]], axis=0)
    num_top_p = jnp.sum(in_top_k & (mass_above < top_p * top_p_mass), axis=0)
    top_p_on = top_p < 1.0
    top_p_threshold = jnp.where(top_p_on, at_row(desc, jnp.maximum(num_top_p, 1) - 1), -jnp.inf)
    min_p_threshold = jnp.where(min_p > 0, largest + jnp.log(jnp.maximum(min_p, 1e-30)), -jnp.inf)
    threshold = jnp.maximum(jnp.maximum(top_k_threshold, top_p_threshold), min_p_threshold)
    num_kept = jnp.sum(desc >= threshold, axis=0)
    complete = num_finite == size
    top_k_known = ~top_k_on | (top_k <= num_finite)
    cut_known = (num_kept < num_finite) | (top_k_on & (top_k <= num_finite))
    # Ties broken by rank: top-k keeps k, top-p its prefix, min-p whole groups; the last kept token's group.
    top_p_count = jnp.where(top_p_on, jnp.maximum(num_top_p, 1), size)
    count = jnp.minimum(jnp.minimum(jnp.where(top_k_on, top_k, size), top_p_count), num_kept)
    last = at_row(desc, count - 1)
    group_start, group_end = jnp.sum(desc > last, axis=0), jnp.sum(desc >= last, axis=0)
    ties_from = jnp.maximum(group_end - top_p_count, 0)  # top-p keeps the highest ids of the group
    return Cut(threshold, complete | (top_k_known & cut_known), last, ties_from, ties_from + count - group_start)


def kept_by_rank(logits: jax.Array, cut: Cut) -> jax.Array:
    """The kept set ``[..., V]`` with ties at the cut broken by token id as mlx-lm breaks them: its sorts order
    equal values by id, so top-p (ascending cumulative sum) keeps the highest ids of a tied group and top-k
    (``argpartition`` of the negated logprobs) the lowest of what is left.

    ``logits`` ``[..., V]`` on the scale of the ``cut`` ``[...]`` (`kept_threshold` of their descending values).
    Costs a cumulative count over the vocabulary: call it where `splits_ties`.

    >>> logits = jnp.log(jnp.array([0.2, 0.2, 0.2, 0.2, 0.2]))
    >>> kept_by_rank(logits, kept_threshold(descending(logits), 0.0, 0, 0.5, 0.0)).tolist()
    [False, False, True, True, True]
    """
    tied = logits == cut.last[..., None]
    rank = jnp.cumsum(tied, axis=-1, dtype=jnp.int32) - tied
    in_range = (rank >= cut.ties_from[..., None]) & (rank < cut.ties_to[..., None])
    return (logits > cut.last[..., None]) | (tied & in_range)


def splits_ties(desc: jax.Array, cut: Cut) -> jax.Array:
    """``[...]`` bool: breaking ties by rank keeps fewer tokens than ``desc >= cut.threshold``."""
    return cut.ties_to - cut.ties_from < jnp.sum(desc == cut.last, axis=0)


def at_row(x: jax.Array, row: jax.Array) -> jax.Array:
    """``x[row[...], ...]`` of ``x`` ``[K, ...]`` (values > -inf): a masked maximum over the rows, not a gather.

    >>> at_row(jnp.array([[1., 2.], [3., 4.]]), jnp.array([1, 0])).tolist()
    [3.0, 2.0]
    """
    rows = jnp.arange(x.shape[0]).reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.max(jnp.where(rows == row, x, -jnp.inf), axis=0)


def prefix_sums(x: jax.Array) -> jax.Array:
    """Inclusive sums along the first axis (Hillis-Steele: log2 steps of shifted adds); entry ``r`` is computed
    from ``x[:r + 1]`` alone, in an order that does not depend on the length.

    >>> prefix_sums(jnp.array([1., 2., 3., 4., 5.])).tolist()
    [1.0, 3.0, 6.0, 10.0, 15.0]
    """
    shift = 1
    while shift < x.shape[0]:
        x = x + jnp.pad(x[:-shift], [(shift, 0)] + [(0, 0)] * (x.ndim - 1))
        shift *= 2
    return x


def descending(scaled: jax.Array) -> jax.Array:
    """All scaled logits ``[..., V]`` in descending order, vocabulary-major ``[V, ...]`` (the full-vocabulary input
    of `kept_threshold`): the values of ``jnp.sort`` by a bitonic network, ~10x faster on XLA:CPU.

    >>> descending(jnp.array([[1., 3., 2.], [0., -1., 0.]])).tolist()
    [[3.0, 0.0], [2.0, 0.0], [1.0, -1.0]]
    """
    return bitonic_largest(scaled, scaled.shape[-1])


def bitonic_largest(scaled: jax.Array, count: int) -> jax.Array:
    """The ``min(count, V)`` largest scaled logits of ``[..., V]`` in descending order, vocabulary-major.

    A bitonic network of elementwise max / min over the vocabulary padded with -inf to a power of two, laid out
    ``[vocabulary, positions]`` so that every step acts on contiguous rows. Sorted runs double in length, each
    merge comparing the first run with the second reversed, then halving strides, all in one direction. With
    ``count`` below ``V`` (a power of two), the runs stop at ``count`` and each merge of two runs keeps
    only the larger half (the elementwise maximum of the first and the second reversed holds the ``count`` largest
    of both, as a bitonic sequence that the halving strides sort), so the steps past ``count`` act on fewer rows.

    >>> bitonic_largest(jnp.array([5., 1., 4., 2., 8., 7., 3., 6.]), 2).tolist()
    [8.0, 7.0]
    """
    vocab_size = scaled.shape[-1]
    size = 1 << max(vocab_size - 1, 1).bit_length()
    block = size if count >= vocab_size else count
    if size % block:
        raise ValueError(f"count {count} below the padded vocabulary {size} must be a power of two")
    x = jnp.pad(scaled.reshape(-1, vocab_size), ((0, 0), (0, size - vocab_size)), constant_values=-jnp.inf).T
    positions = x.shape[1]
    run = 2
    while run <= block:
        halves = x.reshape(-1, 2, run // 2, positions)
        first, second = halves[:, 0], jnp.flip(halves[:, 1], axis=1)
        x = jnp.stack([jnp.maximum(first, second), jnp.flip(jnp.minimum(first, second), axis=1)], axis=1)
        x = halving_strides(x.reshape(size, positions), run // 4)
        run *= 2
    while x.shape[0] > block:
        halves = x.reshape(-1, 2, block, positions)
        x = jnp.maximum(halves[:, 0], jnp.flip(halves[:, 1], axis=1)).reshape(-1, positions)
        x = halving_strides(x, block // 2)
    return x[:min(block, vocab_size)].reshape((-1,) + scaled.shape[:-1])


def halving_strides(x: jax.Array, stride: int) -> jax.Array:
    """Sorts bitonic runs of ``2 stride`` rows of ``x`` ``[size, positions]`` descending: compare-exchanges of rows
    ``stride`` apart, then ``stride / 2``, ..., 1."""
    while stride:
        pairs = x.reshape(-1, 2, stride, x.shape[1])
        x = jnp.stack([jnp.maximum(pairs[:, 0], pairs[:, 1]), jnp.minimum(pairs[:, 0], pairs[:, 1])], axis=1)
        x = x.reshape(-1, pairs.shape[-1])
        stride //= 2
    return x


def top_candidates(scaled: jax.Array, count: int = 64) -> jax.Array:
    """The largest scaled logits of ``[..., V]`` in descending order, vocabulary-major ``[K, ...]``, -inf past the
    ones known exactly; a cheap `descending`.

    Up to `NETWORK_MAX_VOCAB` tokens, the ``count`` largest (a power of two) from `bitonic_largest`, or all tokens
    if there are no more. Beyond, the ``count`` largest from `jax.lax.top_k` (XLA:CPU's partial sort, a fraction
    of a full sort). Where tokens are left out, the smallest value listed is set to -inf: a token not listed may
    tie with it, and `kept_threshold` needs every token not listed below the finite entries.

    >>> top_candidates(jnp.arange(2000.) % 1000, count=3).tolist()
    [999.0, 999.0, -inf]
    >>> top_candidates(jnp.arange(200.) % 100, count=4).tolist()
    [99.0, 99.0, -inf, -inf]
    >>> top_candidates(jnp.array([2., 1., 3.]), count=4).tolist()
    [3.0, 2.0, 1.0]
    """
    vocab_size = scaled.shape[-1]
    if vocab_size <= NETWORK_MAX_VOCAB:
        largest = bitonic_largest(scaled, count)
        if largest.shape[0] == vocab_size:
            return largest
    else:
        largest = jnp.moveaxis(jax.lax.top_k(scaled, count)[0], -1, 0)
    # The minimum, not a slice: a slice of the output would stop XLA:CPU from rewriting top_k's sort into TopK.
    return jnp.where(largest > jnp.min(largest, axis=0), largest, -jnp.inf)


def processed_logprobs(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                       min_p: jax.Array, cut: bool = True) -> jax.Array:
    """Log-probabilities of the sampling distribution for one position (the server's PROCESSED logprobs).

    Args:
      logits: float32 [V].
      temperature: > 0.
      top_k: int, 0 disables.
      top_p: in (0, 1]; 1 disables.
      min_p: in [0, 1); 0 disables.
      cut: False skips `kept_threshold` (and the sort of the vocabulary it needs) when top-k, top-p and min-p are
        all disabled: its threshold is then -inf, so the result is the same, bit for bit (`uncut`).

    Returns:
      float32 [V], -inf outside the kept set.

    >>> logp = processed_logprobs(jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05])), 1.0, 0, 0.7, 0.0)
    >>> [round(float(p), 3) for p in jnp.exp(logp)]
    [0.625, 0.375, 0.0, 0.0]
    """
    scaled = logits.astype(jnp.float32) / temperature
    threshold = (kept_threshold(descending(scaled), jax.nn.logsumexp(scaled), top_k, top_p, min_p).threshold if cut
                 else -jnp.inf)
    return jax.nn.log_softmax(jnp.where(scaled >= threshold, scaled, -jnp.inf))


def uncut(top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """bool: top-k, top-p and min-p are disabled at every position of the arrays (`processed_logprobs` may skip the
    cut).

    >>> bool(uncut(jnp.array([0, 0]), jnp.array([1.0, 1.0]), jnp.array([0.0, 0.0])))
    True
    """
    return ~jnp.any((jnp.asarray(top_k) > 0) | (jnp.asarray(top_p) < 1.0) | (jnp.asarray(min_p) > 0))
