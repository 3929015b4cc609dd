"""The sort-free paths of the sampler's truncation equal a full sort: `descending` (bitonic network) equals
`jnp.sort`, `top_candidates` lists a prefix of it, and the thresholds of `replayed_thresholds` (candidates from the
bitonic network cut short for a small vocabulary, from `jax.lax.top_k` for a large one, with the full-sort fallback)
keep the set that a float64 NumPy reference keeps."""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings

from learner.logprobs.sampler_replay import SamplerParams, replayed_thresholds
from learner.logprobs.sampling_transform import NETWORK_MAX_VOCAB, descending, kept_threshold, top_candidates
from tests.support.sort_reference import descending_jitted, full_sort_cut


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
@given(seed=st.integers(0, 2**31 - 1), vocab=st.sampled_from([5, 128, NETWORK_MAX_VOCAB, 1500, 3000]),
       levels=st.sampled_from([3, 8, 0]), scale=st.floats(0.5, 8.0))
def test_bitonic_descending_equals_sort(seed, vocab, levels, scale):
    """Ties (few distinct values, `levels` > 0) and continuous logits; -inf logits sort last."""
    rng = np.random.default_rng(seed)
    logits = rng.integers(0, levels, (3, vocab)) * 0.5 if levels else rng.standard_normal((3, vocab)) * scale
    logits[0, rng.integers(0, vocab)] = -np.inf
    logits = jnp.asarray(logits, jnp.float32)
    np.testing.assert_array_equal(jax.jit(descending)(logits), jnp.flip(jnp.sort(logits, axis=-1), axis=-1).T)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), vocab=st.sampled_from([3, 64, 65, 128, 300, NETWORK_MAX_VOCAB, 1500]),
       count=st.sampled_from([4, 64]), levels=st.sampled_from([3, 40, 0]))
def test_top_candidates_are_the_sorted_prefix(seed, vocab, count, levels):
    """The finite candidates are the largest logits in order, every logit not listed is below them, and they are all
    of them exactly when there are at most `count` logits."""
    rng = np.random.default_rng(seed)
    logits = rng.integers(0, levels, (2, 3, vocab)) * 0.5 if levels else rng.standard_normal((2, 3, vocab))
    logits = jnp.asarray(logits, jnp.float32)
    got = np.moveaxis(np.asarray(jax.jit(top_candidates, static_argnums=1)(logits, count)), 0, -1)
    full = np.moveaxis(np.asarray(descending_jitted(logits)), 0, -1)
    assert got.shape[-1] == min(vocab, count)
    finite = got > -np.inf
    assert (finite[..., :-1] >= finite[..., 1:]).all()  # -inf only past the finite entries
    np.testing.assert_array_equal(np.where(finite, got, -np.inf), np.where(finite, full[..., :got.shape[-1]], -np.inf))
    num_finite = finite.sum(-1)
    for position in np.ndindex(*logits.shape[:2]):
        listed = num_finite[position]
        if vocab <= count:
            assert listed == vocab
        elif listed:
            assert (full[position][listed:] < got[position][listed - 1]).all()


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), vocab=st.sampled_from([7, 64, 65, 128, 300, NETWORK_MAX_VOCAB, 1500, 4000]),
       levels=st.sampled_from([2, 5, 40, 0]), scale=st.floats(0.3, 6.0), top_k=st.integers(0, 100),
       top_p=st.floats(0.05, 1.0), min_p=st.sampled_from([0.0, 0.001, 0.05, 0.3]))
@pytest.mark.slow  # 31 s on a quiet 2-core run: out of the default run's 15 minutes
def test_replayed_threshold_keeps_the_full_sort_set(seed, vocab, levels, scale, top_k, top_p, min_p):
    """All paths (up to 64 tokens: all sorted; up to `NETWORK_MAX_VOCAB`: the bitonic network's 64 largest; above:
    `jax.lax.top_k`'s; the last two falling back to the full sort when the candidates do not decide), with ties at
    every cutoff when `levels` > 0; equal to the full-sort `kept_threshold` bit for bit."""
    rng = np.random.default_rng(seed)
    shape = (2, 3, vocab)
    logits = rng.integers(0, levels, shape) * scale / levels if levels else rng.standard_normal(shape) * scale
    scaled = jnp.asarray(logits, jnp.float32)
    log_normalizer = jax.nn.logsumexp(scaled, axis=-1)
    params = SamplerParams(*(jnp.full(2, x, dtype) for x, dtype in
                             ((1.0, jnp.float32), (top_k, jnp.int32), (top_p, jnp.float32), (min_p, jnp.float32))))
    threshold = jax.jit(replayed_thresholds)(scaled, log_normalizer, params)
    full = full_sort_cut(scaled, log_normalizer, *(x[:, None] for x in params[1:4])).threshold
    np.testing.assert_array_equal(threshold, full)
    for position in np.ndindex(*shape[:2]):
        want, margin = reference_kept(np.asarray(scaled[position]), top_k, top_p, min_p)
        assume(margin > 1e-5)  # a cut within float32 rounding of p: either side is right
        np.testing.assert_array_equal(np.asarray(scaled[position] >= threshold[position]), want)


@pytest.mark.parametrize("vocab", [100, NETWORK_MAX_VOCAB + 5])
def test_top_candidates_drop_the_last_tied_group(vocab):
    """The count largest may cut a tie; the tied value becomes -inf so every token not listed is below the list."""
    scaled = jnp.concatenate([jnp.array([9.0, 8.0, 7.0, 7.0, 7.0]), jnp.zeros(vocab - 5)])
    candidates = jax.jit(top_candidates, static_argnums=1)(scaled, 4)  # eagerly, each op compiles on its own
    assert candidates.tolist() == [9.0, 8.0, -jnp.inf, -jnp.inf]
    determined = jax.jit(kept_threshold)(candidates, jax.nn.logsumexp(scaled), 3, 1.0, 0.0).determined
    assert not bool(determined)  # top-3 reaches the tie that was cut: needs the full sort


def test_large_vocabulary_candidates_use_xla_topk_not_sort():
    """On CPU a sort of the vocabulary costs ~10x the output projection: the candidate path must not contain one."""
    scaled = jnp.zeros((2, 4, NETWORK_MAX_VOCAB + 1))
    hlo = jax.jit(top_candidates).lower(scaled).compile().as_text()
    if jax.default_backend() == "cpu":
        assert 'custom_call_target="TopK"' in hlo and " sort(" not in hlo
