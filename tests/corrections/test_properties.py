"""Invariants of the correction pipeline, checked by hypothesis on random padded batches."""

import functools

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import corrections
from corrections import CorrectionConfig, ImportanceWeights, RejectionRule

B, T = 4, 6
CONFIGS = {
    "token_tis": corrections.preset("decoupled_token_is"),
    "seq_is_rs": corrections.preset("decoupled_seq_is_rs"),
    "geo_rs_token_tis": corrections.preset("decoupled_geo_rs_token_tis"),
    "k3_rs_seq_tis": corrections.preset("decoupled_k3_rs_seq_tis"),
    "icepop": corrections.preset("decoupled_token_icepop"),
    "bypass_pg_is": corrections.preset("bypass_pg_is"),
    "outlier_token_mask": CorrectionConfig(
        rejection=(RejectionRule("outlier", 1e-2, 50.0), RejectionRule("token", 0.5, 2.0))
    ),
    "gspo_seq_mean": CorrectionConfig(
        objective=corrections.Objective("gspo", clip_low=3e-4, clip_high=4e-4), reduction="seq-mean-token-mean"
    ),
    "cispo_opsm": CorrectionConfig(objective=corrections.Objective("cispo", clip_low=1.0, clip_high=4.0),
                                   opsm_delta=1e-4, reduction="seq-mean-token-sum"),
    "sapo_kl": CorrectionConfig(objective=corrections.Objective("sapo"), kl_coef=0.1, kl_estimator="k3"),
    "rollout_is_batch_norm": CorrectionConfig(
        objective=corrections.Objective("rollout_is"),
        importance=ImportanceWeights("sequence", high=5.0, batch_normalize=True),
        reduction="seq-mean-token-sum-norm",
    ),
}


@functools.cache
def jitted(name):
    config = CONFIGS[name]

    def run(lp, adv, mask, old, roll, ref):
        return corrections.compute(
            lp, adv, mask, config, proximal_logprobs=old, rollout_logprobs=roll,
            ref_logprobs=ref if config.kl_coef else None,
        )

    return jax.jit(run)


@st.composite
def batches(draw):
    lengths = draw(st.lists(st.integers(0, T), min_size=B, max_size=B))
    mask = (np.arange(T)[None, :] < np.array(lengths)[:, None]).astype(np.float32)
    logprob = hnp.arrays(np.float32, (B, T), elements=st.floats(-6.0, -0.015625, width=32))
    lp, old, roll, ref = (draw(logprob) for _ in range(4))
    adv = draw(hnp.arrays(np.float32, (B,), elements=st.floats(-2.0, 2.0, width=32)))
    return lp, adv, mask, old, roll, ref


def with_garbage(array, mask, fill):
    return np.where(mask.astype(bool), array, fill).astype(np.float32)


def as_numpy(out):
    return jax.tree.map(np.asarray, out._asdict())


@pytest.mark.parametrize("name", sorted(CONFIGS))
@settings(max_examples=15, deadline=None)
@given(batch=batches(), fill=st.sampled_from([np.nan, np.inf, -np.inf, 1e30]))
def test_padding_values_never_change_any_output(name, batch, fill):
    lp, adv, mask, old, roll, ref = batch
    clean = as_numpy(jitted(name)(lp, adv, mask, old, roll, ref))
    dirty_inputs = [with_garbage(a, mask, fill) for a in (lp, old, roll, ref)]
    dirty = as_numpy(jitted(name)(dirty_inputs[0], adv, mask, *dirty_inputs[1:]))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), clean, dirty)
    assert all(np.isfinite(v) for v in clean["metrics"].values())


@pytest.mark.parametrize("name", ["seq_is_rs", "geo_rs_token_tis", "k3_rs_seq_tis", "outlier_token_mask"])
@settings(max_examples=25, deadline=None)
@given(batch=batches())
@pytest.mark.slow  # 38 s on a quiet 2-core run: out of the default run's 15 minutes
def test_sequence_decisions_are_constant_over_valid_tokens(name, batch):
    lp, adv, mask, old, roll, ref = batch
    config = CONFIGS[name]
    sequence_only = config.replace(rejection=tuple(r for r in config.rejection if r.sequence_level))
    out = corrections.compute(lp, adv, mask, sequence_only, proximal_logprobs=old, rollout_logprobs=roll)
    for row in range(B):
        valid = mask[row].astype(bool)
        kept = np.asarray(out.mask)[row][valid]
        assert len(set(kept.tolist())) <= 1, "a sequence rule split a sequence"
        if config.importance is not None and config.importance.level != "token":
            weights = np.asarray(out.weights)[row][valid & (np.asarray(out.mask)[row] > 0)]
            np.testing.assert_allclose(weights, weights[:1].repeat(weights.size), rtol=1e-6)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@settings(max_examples=8, deadline=None)
@given(batch=batches())
@pytest.mark.slow  # 46 s on a quiet 2-core run: out of the default run's 15 minutes
def test_weights_carry_no_gradient(name, batch):
    lp, adv, mask, old, roll, ref = batch
    config = CONFIGS[name]

    def weight_sum(lp):
        out = corrections.compute(lp, adv, mask, config, proximal_logprobs=old, rollout_logprobs=roll,
                                  ref_logprobs=ref if config.kl_coef else None)
        return jnp.sum(out.weights) + sum(jnp.sum(v) for v in out.metrics.values())

    np.testing.assert_array_equal(np.asarray(jax.grad(weight_sum)(lp)), 0.0)


@settings(max_examples=20, deadline=None)
@given(batch=batches())
@pytest.mark.slow  # 16 s on a quiet 2-core run: out of the default run's 15 minutes
def test_bypass_reinforce_gradient_treats_weights_as_constants(batch):
    lp, adv, mask, old, roll, _ = batch
    config = corrections.preset("bypass_pg_is", importance={"level": "token", "high": 2.0})
    out = corrections.compute(lp, adv, mask, config, rollout_logprobs=roll)
    grad = jax.grad(lambda lp: corrections.compute(lp, adv, mask, config, rollout_logprobs=roll).loss)(lp)
    weights = np.minimum(np.exp(np.clip(lp.astype(np.float64) - roll, -20, 20)), 2.0) * mask
    expected = -weights * adv[:, None] * mask / max(float(np.asarray(out.loss_denominator)), 1.0)
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@settings(max_examples=4, deadline=None)
@given(batch=batches())
@pytest.mark.slow  # 58 s on a quiet 2-core run: out of the default run's 15 minutes
def test_all_rejected_batch_gives_finite_metrics_zero_loss_zero_gradient(name, batch):
    lp, adv, mask, old, _, _ = batch
    roll = (old - 3.0).astype(np.float32)  # ratio e^3 ~ 20 on every token: outside the geometric bounds below
    config = CONFIGS[name].replace(mode="decoupled", rejection=(RejectionRule("geometric", 0.999, 1.001),))

    def loss(lp):
        return corrections.compute(lp, adv, mask, config, proximal_logprobs=old, rollout_logprobs=roll,
                                   ref_logprobs=old if config.kl_coef else None)

    out = loss(lp)
    assert float(out.loss) == 0.0
    assert float(out.metrics["rollout_corr/all_rejected"]) == float(mask.any())  # 0 for an all-padding batch
    assert float(out.metrics["rollout_corr/kept_tokens"]) == 0.0
    assert all(np.isfinite(np.asarray(v)) for v in out.metrics.values())
    np.testing.assert_array_equal(np.asarray(jax.grad(lambda lp: loss(lp).loss)(lp)), 0.0)


@pytest.mark.parametrize("name", ["token_tis", "gspo_seq_mean", "rollout_is_batch_norm", "cispo_opsm"])
@settings(max_examples=10, deadline=None)
@given(batch=batches())
def test_jit_vmap_and_eager_agree(name, batch):
    lp, adv, mask, old, roll, ref = batch
    eager = as_numpy(corrections.compute(lp, adv, mask, CONFIGS[name], proximal_logprobs=old, rollout_logprobs=roll))
    jit = as_numpy(jitted(name)(lp, adv, mask, old, roll, ref))
    stacked = [np.stack([a, a[::-1]]) for a in (lp, adv, mask, old, roll, ref)]
    vmapped = jax.vmap(jitted(name))(*stacked)
    first = jax.tree.map(lambda a: np.asarray(a)[0], vmapped._asdict())
    for other in (jit, first):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-6), eager, other)


def test_bfloat16_inputs_compute_in_float32():
    rng = np.random.default_rng(1)
    lp, old, roll = (jnp.asarray(rng.uniform(-3, -0.1, (B, T)), jnp.bfloat16) for _ in range(3))
    mask, adv = np.ones((B, T)), rng.normal(size=B)
    config = CONFIGS["geo_rs_token_tis"]
    low = corrections.compute(lp, adv, mask, config, proximal_logprobs=old, rollout_logprobs=roll)
    high = corrections.compute(*(a.astype(jnp.float32) for a in (lp,)), adv, mask, config,
                               proximal_logprobs=old.astype(jnp.float32), rollout_logprobs=roll.astype(jnp.float32))
    assert low.per_token_loss.dtype == jnp.float32
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), low, high)


def test_loss_gradient_matches_finite_differences():
    rng = np.random.default_rng(2)
    lp, old, roll = (rng.uniform(-2, -0.5, (B, T)) for _ in range(3))
    mask = (np.arange(T)[None] < np.array([[6], [3], [1], [0]])).astype(np.float64)
    adv = rng.normal(size=B)
    config = corrections.preset("decoupled_token_is", objective={"clip_low": 10.0, "clip_high": 10.0})
    with jax.enable_x64(True):
        def loss(lp):
            return corrections.compute(lp, adv, mask, config, proximal_logprobs=old, rollout_logprobs=roll).loss

        jax.test_util.check_grads(loss, (jnp.asarray(lp, jnp.float32),), order=1, modes=("rev",), eps=1e-3,
                                  atol=1e-2, rtol=1e-2)
