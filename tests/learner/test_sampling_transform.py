"""The sort-free paths of the sampler's truncation equal a full sort: `descending` (bitonic network) equals
`jnp.sort`, and the thresholds of `replayed_thresholds` (all tokens of a small vocabulary; `jax.lax.top_k`
candidates with the full-sort fallback for a large one) keep the set that a float64 NumPy reference keeps."""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import assume, given, settings

from learner.sampler_replay import SamplerParams, replayed_thresholds
from learner.sampling_transform import FULL_SORT_MAX_VOCAB, descending, kept_threshold, top_candidates


def reference_kept(scaled: np.ndarray, top_k: int, top_p: float, min_p: float) -> tuple[np.ndarray, float]:
    """Kept mask of one position by the definition (float64, NumPy sort), and the top-p mass closest to p (how
    near the top-p cut is to a rounding tie)."""
    desc = np.sort(scaled.astype(np.float64))[::-1]
    keep = np.ones(scaled.shape, bool)
    if top_k > 0:
        keep &= scaled >= desc[min(top_k, desc.size) - 1]
    margin = np.inf
    if top_p < 1.0:
        kept = np.sort(scaled[keep].astype(np.float64))[::-1]
        probs = np.exp(kept - kept.max())
        probs /= probs.sum()
        mass_above = np.concatenate([[0.0], np.cumsum(probs)[:-1]])
        margin = np.min(np.abs(mass_above - top_p))
        keep &= scaled >= kept[np.sum(mass_above < top_p) - 1]
    if min_p > 0:
        keep &= scaled.astype(np.float64) >= desc[0] + np.log(min_p)
    return keep, margin


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), vocab=st.sampled_from([5, 128, FULL_SORT_MAX_VOCAB, 1500, 3000]),
       levels=st.sampled_from([3, 8, 0]), scale=st.floats(0.5, 8.0))
def test_bitonic_descending_equals_sort(seed, vocab, levels, scale):
    """Ties (few distinct values, `levels` > 0) and continuous logits; -inf logits sort last."""
    rng = np.random.default_rng(seed)
    logits = rng.integers(0, levels, (3, vocab)) * 0.5 if levels else rng.standard_normal((3, vocab)) * scale
    logits[0, rng.integers(0, vocab)] = -np.inf
    logits = jnp.asarray(logits, jnp.float32)
    np.testing.assert_array_equal(jax.jit(descending)(logits), jnp.flip(jnp.sort(logits, axis=-1), axis=-1))


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), vocab=st.sampled_from([7, 128, FULL_SORT_MAX_VOCAB, 1500, 4000]),
       levels=st.sampled_from([2, 5, 40, 0]), scale=st.floats(0.3, 6.0), top_k=st.integers(0, 100),
       top_p=st.floats(0.05, 1.0), min_p=st.sampled_from([0.0, 0.001, 0.05, 0.3]))
def test_replayed_threshold_keeps_the_full_sort_set(seed, vocab, levels, scale, top_k, top_p, min_p):
    """Both paths (small vocabulary: all tokens sorted; large: top_k candidates, falling back when they do not
    decide), with ties at every cutoff when `levels` > 0; equal to the full-sort `kept_threshold` bit for bit."""
    rng = np.random.default_rng(seed)
    shape = (2, 3, vocab)
    logits = rng.integers(0, levels, shape) * scale / levels if levels else rng.standard_normal(shape) * scale
    scaled = jnp.asarray(logits, jnp.float32)
    log_normalizer = jax.nn.logsumexp(scaled, axis=-1)
    params = SamplerParams(*(jnp.full(2, x, dtype) for x, dtype in
                             ((1.0, jnp.float32), (top_k, jnp.int32), (top_p, jnp.float32), (min_p, jnp.float32))))
    threshold = jax.jit(replayed_thresholds)(scaled, log_normalizer, params)
    full, _ = kept_threshold(descending(scaled), log_normalizer, *(x[:, None] for x in params[1:]))
    np.testing.assert_array_equal(threshold, full)
    for position in np.ndindex(*shape[:2]):
        want, margin = reference_kept(np.asarray(scaled[position]), top_k, top_p, min_p)
        assume(margin > 1e-5)  # a cut within float32 rounding of p: either side is right
        np.testing.assert_array_equal(np.asarray(scaled[position] >= threshold[position]), want)


def test_top_candidates_drop_the_last_tied_group():
    """`jax.lax.top_k` may cut a tie; the tied value becomes -inf so every token not listed is below the list."""
    scaled = jnp.concatenate([jnp.array([9.0, 8.0, 7.0, 7.0, 7.0]), jnp.zeros(FULL_SORT_MAX_VOCAB)])
    assert top_candidates(scaled, count=4).tolist() == [9.0, 8.0, -jnp.inf, -jnp.inf]
    _, determined = kept_threshold(top_candidates(scaled, count=4), jax.nn.logsumexp(scaled), 3, 1.0, 0.0)
    assert not bool(determined)  # top-3 reaches the tie that was cut: needs the full sort


def test_large_vocabulary_candidates_use_xla_topk_not_sort():
    """On CPU a sort of the vocabulary costs ~10x the output projection: the candidate path must not contain one."""
    scaled = jnp.zeros((2, 4, FULL_SORT_MAX_VOCAB + 1))
    hlo = jax.jit(top_candidates).lower(scaled).compile().as_text()
    if jax.default_backend() == "cpu":
        assert 'custom_call_target="TopK"' in hlo and " sort(" not in hlo
