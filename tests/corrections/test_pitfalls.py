"""One regression test per pitfall of section 8 of ../shared/reference/corrections.md (items 1-9).

Each builds a small batch by hand on which the buggy behaviour gives a different number, asserts Tether's value,
and shows the buggy number through the reference port (tests/support/reference_ports) where one exists.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import corrections
from corrections import CorrectionConfig, ImportanceWeights, Objective, RejectionRule
from tests.support.reference_ports import areal, skyrl, slime, verl

P = "rollout_corr/"
EAGER = {"rows_per_chunk": 0}  # one vmap, no row loop: many configs, each traced once


def compute(config, lp, adv, m, old=None, roll=None):
    f32 = lambda x: None if x is None else np.asarray(x, np.float32)  # noqa: E731
    return corrections.compute(f32(lp), f32(adv), f32(m), config, proximal_logprobs=f32(old),
                               rollout_logprobs=f32(roll), **EAGER)


def approx(x, **kw):
    return pytest.approx(np.asarray(x, np.float64), rel=1e-5, abs=1e-6, **kw)


# --------------------------------------------------------------------------------------------------- 1
def test_pitfall_1_sequence_decision_applied_per_token():
    """slime's OPSM compares the sequence KL with each token's OWN advantage sign, so a sequence with mixed-sign
    advantages is only partly masked; the decision is per sequence (PR #1917)."""
    m = np.ones((2, 4))
    lp = np.log(np.full((2, 4), 0.5))
    old = lp + 0.1  # mean(old - lp) = 0.1 > delta in both rows
    adv = np.array([[0.5, -1.0, -1.0, -1.0],  # mean < 0: the whole sequence goes
                    [1.0, 1.0, -0.5, 1.0]])  # mean > 0: the whole sequence stays
    out = compute(corrections.preset("slime_opsm", reduction="seq-mean-token-mean"), lp, adv, m, old, lp)
    np.testing.assert_array_equal(np.asarray(out.mask), [[0, 0, 0, 0], [1, 1, 1, 1]])
    fixed, _ = slime.compute_opsm_mask_pr1917(adv, lp, old, m, 1e-4)
    buggy, _ = slime.compute_opsm_mask(adv, lp, old, m, 1e-4)
    np.testing.assert_array_equal(fixed, [[0, 0, 0, 0], [1, 1, 1, 1]])
    np.testing.assert_array_equal(buggy, [[1, 0, 0, 0], [1, 1, 0, 1]])
    pg, _ = slime.compute_policy_loss(old - lp, adv, 0.2, 0.2)  # r = e^-0.1: -r*A (inside the clip window)
    reducer = slime.get_sum_of_sample_mean(m)
    r = math.exp(-0.1)
    assert float(out.loss_numerator) == approx(reducer(pg * fixed)) == approx(-r * 2.5 / 4)
    assert reducer(pg * buggy) == approx(-r * 0.5 / 4 - r * 3.0 / 4)  # the buggy number


# --------------------------------------------------------------------------------------------------- 2
def test_pitfall_2_is_weights_carry_no_gradient():
    """Bypass mode computes the weight from the current policy, w = exp(lp - roll): the gradient must treat it as a
    constant (verl PR #4105), d/dlp [-w A lp] = -w A, not -w A (1 + lp)."""
    m = np.array([[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # every test here uses [2, 4]: one compile
    lp = np.log(np.array([[0.5, 0.25, 0.8, 0.5], [0.5, 0.5, 0.5, 0.5]]))
    roll = np.log(np.array([[0.4, 0.3, 0.8, 0.5], [0.5, 0.5, 0.5, 0.5]]))
    adv = np.array([1.5, 0.0])
    config = CorrectionConfig(mode="bypass", objective=Objective("reinforce"),
                              importance=ImportanceWeights("token", high=10.0))

    def loss(x):
        return corrections.compute(x, np.float32(adv), np.float32(m), config, rollout_logprobs=np.float32(roll),
                                   **EAGER).loss

    grad = np.asarray(jax.grad(loss)(jnp.asarray(lp, jnp.float32)))
    w = np.exp(lp - roll) * m
    assert grad == approx(-w * adv[:, None] / 3)
    buggy = -w * adv[:, None] * (1 + lp) / 3  # what a weight with gradient gives
    assert not np.allclose(grad[0, :3], buggy[0, :3], rtol=1e-2)
    # verl's bypass REINFORCE loss value is the same either way (the bug is in the gradient only)
    want, _ = verl.compute_policy_loss_bypass_mode(roll, lp, adv[:, None] * m, m, "token-mean", "reinforce",
                                                   "token", 10.0)
    assert float(loss(jnp.asarray(lp, jnp.float32))) == approx(want)


# --------------------------------------------------------------------------------------------------- 3
def test_pitfall_3_inverted_k1_bounds():
    """verl's "0.8_1.6" keeps 1/1.6 <= rho <= 1/0.8; Tether's bounds mean what they say; reproduce_inverted_k1=True
    gives verl's mask on purpose."""
    rho = np.array([[0.7, 0.9, 1.4, 1.7], [1.0, 1.0, 1.0, 1.0]])
    m = np.ones((2, 4))
    roll = np.log(np.full((2, 4), 0.3))
    old = roll + np.log(rho)
    lp = old
    _, verl_mask, _ = verl.compute_rollout_correction_and_rejection_mask(old, roll, m, rollout_rs="token_k1",
                                                                        rollout_rs_threshold="0.8_1.6")
    np.testing.assert_array_equal(verl_mask[0], [1, 1, 0, 0])  # the buggy mask: 0.7 kept, 1.4 dropped
    ours = compute(corrections.from_verl(rollout_rs="token_k1", rollout_rs_threshold="0.8_1.6"), lp, [1.0, 1.0], m,
                   old, roll)
    np.testing.assert_array_equal(np.asarray(ours.mask), [[0, 1, 1, 0], [1, 1, 1, 1]])
    compat = compute(corrections.from_verl(rollout_rs="token_k1", rollout_rs_threshold="0.8_1.6",
                                           reproduce_inverted_k1=True), lp, [1.0, 1.0], m, old, roll)
    np.testing.assert_array_equal(np.asarray(compat.mask), verl_mask)


# --------------------------------------------------------------------------------------------------- 4
def test_pitfall_4_statistics_over_masked_positions():
    """SkyRL's is_ratio_min is the min of ratio * mask over ALL positions: 0 whenever there is padding. The fw
    cookbook's geometric weight averages the log-ratio over padding too. Both are taken over valid tokens here."""
    m = np.array([[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    roll = np.log(np.full((2, 4), 0.3))
    lr = np.array([[0.2, 0.4, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    old = roll + lr
    _, metrics, _ = skyrl.compute_off_policy_correction(old, roll, m, dict(tis_ratio_type="token"))
    assert metrics["is_ratio_min"] == 0.0  # the quirk
    out = compute(CorrectionConfig(importance=ImportanceWeights("token", high=None)), old, [1.0, 1.0], m, old, roll)
    assert float(out.metrics[P + "rollout_is_min"]) == approx(math.exp(0.2))
    assert float(out.metrics[P + "rollout_is_max"]) == approx(metrics["is_ratio_max"]) == approx(math.exp(0.4))
    garbage = np.where(m > 0, lr, 7.0)  # padding values must not matter
    geo = np.asarray(corrections.geometric_sequence_weights(np.float32(garbage[0]), m[0]))
    assert geo[:2] == approx([math.exp(0.3)] * 2)
    assert math.exp(lr[0].mean()) == approx(math.exp(0.15))  # the cookbook's number (mean over all 4 positions)


# --------------------------------------------------------------------------------------------------- 5
def test_pitfall_5_all_rejected_batch():
    """verl divides 0 by 0 for the loss, raises ZeroDivisionError in ESS when every weight is 0 and AssertionError
    in its metrics on an empty mask. Here: finite metrics, zero loss, zero gradient, a warning metric."""
    m = np.ones((2, 4))
    roll = np.log(np.full((2, 4), 0.3))
    old = roll + np.array([[0.5], [-0.5]])  # every sequence far outside Geo-RS, every token outside IcePop
    lp = old + 0.05
    adv = np.array([1.0, -1.0])
    A = adv[:, None] * m
    config = corrections.preset("decoupled_geo_rs_token_tis")
    out = compute(config, lp, adv, m, old, roll)
    assert float(out.loss) == 0.0 and not np.asarray(out.mask).any()
    assert float(out.metrics[P + "all_rejected"]) == 1.0
    assert all(np.isfinite(float(v)) for v in out.metrics.values())
    grad = jax.grad(lambda x: corrections.compute(x, np.float32(adv), np.float32(m), config,
                                                  proximal_logprobs=np.float32(old), rollout_logprobs=np.float32(roll),
                                                  **EAGER).loss)(jnp.asarray(lp, jnp.float32))
    assert np.all(np.asarray(grad) == 0.0)
    w, mask, _ = verl.compute_rollout_correction_and_rejection_mask(old, roll, m, "token", 2.0, False, "seq_mean_k1",
                                                                   "0.999_1.001")
    assert mask.sum() == 0
    with np.errstate(invalid="ignore"):
        assert math.isnan(verl.compute_policy_loss_vanilla(old, lp, A, mask, "token-mean", rollout_is_weights=w)[0])
    # every IcePop weight zero: verl's ESS divides by zero, Tether reports 0
    icepop = dict(rollout_is="token", rollout_is_threshold="0.8_1.2")
    with pytest.raises(ZeroDivisionError):
        verl.compute_rollout_correction_weights(old - roll, m, **icepop)
    out = compute(corrections.from_verl(**icepop), lp, adv, m, old, roll)
    assert float(out.metrics[P + "rollout_is_eff_sample_size"]) == 0.0
    assert float(out.loss) == 0.0
    # an all-padding batch: verl asserts, Tether's metrics are finite zeros
    empty = np.zeros((2, 4))
    with pytest.raises(AssertionError):
        verl.compute_offpolicy_metrics(old, roll, empty)
    out = compute(config, lp, adv, empty, old, roll)
    assert float(out.loss) == 0.0 and float(out.metrics[P + "training_ppl"]) == 0.0
    assert all(np.isfinite(float(v)) for v in out.metrics.values())


# --------------------------------------------------------------------------------------------------- 6
def test_pitfall_6_empty_rows_excluded():
    """An empty row enters verl's per-sequence means as masked_mean = 0 (training_ppl gets exp(0) = 1,
    rollout_rs_seq_masked_fraction divides by every row). Here it is excluded from every per-sequence statistic."""
    m = np.array([[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    roll = np.log(np.full((2, 4), 0.5))
    old = roll + np.array([[0.0], [0.1]])  # row 1 is rejected by Geo-RS
    config = corrections.preset("decoupled_geo_rs")
    out = compute(config, old, [1.0, 1.0], m, old, roll)
    _, _, theirs = verl.compute_rollout_correction_and_rejection_mask(old, roll, m, rollout_rs="seq_mean_k1",
                                                                     rollout_rs_threshold="0.999_1.001")
    ppl = math.exp(-math.log(0.5) - 0.1)  # row 1 only
    assert float(out.metrics[P + "training_ppl"]) == approx(ppl)
    assert theirs[P + "training_ppl"] == approx((ppl + 1.0) / 2)
    assert float(out.metrics[P + "rollout_rs_seq_masked_fraction"]) == approx(1.0)
    assert theirs[P + "rollout_rs_seq_masked_fraction"] == approx(1 / 2)
    assert float(out.metrics[P + "chi2_seq"]) == approx(math.exp(0.8) - 1)
    assert theirs[P + "chi2_seq"] == approx((math.exp(0.8) + 1) / 2 - 1)


# --------------------------------------------------------------------------------------------------- 7
def test_pitfall_7_unclamped_exponentials():
    """slime's compute_policy_loss, AReaL's behaviour weight and verl's k3_kl exponentiate raw log-ratios: a
    log-ratio of 100 gives exp(100) ~ 2.7e43, past float32's max (inf in the frameworks' torch float32; the float64
    ports show the value). Every exponent here is clamped to [-20, 20] (exp(20) ~ 4.85e8)."""
    m = np.array([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    old = np.array([[-100.0, -1.0, -1.0, -1.0], [-1.0] * 4])
    lp = np.array([[-0.5, -1.0, -1.0, -1.0], [-1.0] * 4])  # lp - old = 99.5 on token 0
    roll = np.array([[-200.0, -1.0, -1.0, -1.0], [-1.0] * 4])  # old - roll = 100 on token 0
    adv = np.array([-1.0, 0.0])
    f32_max = float(np.finfo(np.float32).max)
    pg, _ = slime.compute_policy_loss(old - lp, adv[:, None] * m, 0.2, 0.2)
    assert pg[0, 0] > f32_max  # slime
    _, stat = areal.ppo_actor_loss_fn(lp, old, roll, adv[:, None] * m, 0.2, m)
    assert stat["behave_imp_weight"][0, 0] > f32_max  # AReaL without a cap
    assert verl.compute_offpolicy_metrics(old, roll, m)["k3_kl"] > f32_max  # verl
    out = compute(CorrectionConfig(importance=ImportanceWeights("token", high=None)), lp, adv, m, old, roll)
    per_token = np.asarray(out.per_token_loss)
    big = math.exp(20.0)
    assert per_token[0, 0] == approx(big * big)  # r = e^20 (A < 0: loss r*|A|), times the weight e^20
    assert np.all(np.isfinite(per_token)) and np.isfinite(float(out.loss))
    assert float(out.metrics[P + "k3_kl"]) == approx((math.expm1(20.0) - 20.0) / 4)
    assert float(out.metrics[P + "chi2_token"]) == approx((math.exp(40.0) + 3) / 4 - 1)
    assert all(np.isfinite(float(v)) for v in out.metrics.values())


# --------------------------------------------------------------------------------------------------- 8
def test_pitfall_8_denominator_after_rejection():
    """After rejection SkyRL, slime and AReaL divide by the ORIGINAL token count, verl by the KEPT count: both are
    offered (``denominator``), and each equals its framework."""
    m = np.ones((2, 4))
    roll = np.log(np.full((2, 4), 0.5))
    old = roll + np.array([[0.0], [0.1]])  # row 1 rejected by the geometric mask
    lp = old  # ratio 1: per-token PPO loss is -A
    adv = np.array([2.0, 1.0])
    A = adv[:, None] * m
    rule = RejectionRule("seq_mean_k1", 0.99, 1.01)
    original = compute(CorrectionConfig(rejection=(rule,)), lp, adv, m, old, roll)
    kept = compute(CorrectionConfig(rejection=(rule,), denominator="kept"), lp, adv, m, old, roll)
    assert float(original.loss) == approx(-2.0 * 4 / 8)
    assert float(kept.loss) == approx(-2.0 * 4 / 4)
    # SkyRL: advantages pre-divided by the original count, then a masked sum
    opc = dict(sequence_mask_metric="geometric")
    adv_scaled = skyrl.apply_loss_reduction_to_advantages_minibatch(A, m, "token_mean")
    skyrl_loss, _ = skyrl.ppo_policy_loss(lp, old, adv_scaled, dict(off_policy_correction=opc), loss_mask=m,
                                          rollout_logprobs=roll)
    assert skyrl_loss == approx(float(original.loss))
    # AReaL: rejection sampling, loss over the count saved before it
    areal_loss, _ = areal.ppo_actor_loss_fn_rs(lp, old, roll, A, 0.2, m, rejection_sampling=dict(
        metric="ratio", level="sequence", agg="mean", upper=1.01, lower=0.99))
    assert areal_loss == approx(float(original.loss))
    # slime: per-sample means over the original counts (rejection as a multiplicative mask)
    keep = np.asarray(original.mask, np.float64)
    slime_sum = slime.get_sum_of_sample_mean(m)(-A * keep)
    by_sample = compute(CorrectionConfig(rejection=(rule,), reduction="seq-mean-token-mean"), lp, adv, m, old, roll)
    assert float(by_sample.loss_numerator) == approx(slime_sum) == approx(-2.0)
    # verl: token-mean over the kept mask
    _, verl_mask, _ = verl.compute_rollout_correction_and_rejection_mask(old, roll, m, rollout_rs="seq_mean_k1",
                                                                        rollout_rs_threshold="0.99_1.01")
    verl_loss, _ = verl.compute_policy_loss_vanilla(old, lp, A, verl_mask, "token-mean")
    assert verl_loss == approx(float(kept.loss))


# --------------------------------------------------------------------------------------------------- 9
def processed_reference(logits, temperature, top_p):
    """NumPy float64: softmax(logits / T), keep the smallest prefix (by probability) with mass >= top_p; returns the
    plain and the renormalised (PROCESSED) logprobs, the kept set and the cumulative masses (for a margin check)."""
    scaled = np.asarray(logits, np.float64) / temperature
    plain = scaled - scaled.max() - np.log(np.exp(scaled - scaled.max()).sum())
    order = np.argsort(-plain)
    cumulative = np.cumsum(np.exp(plain[order]))
    kept = np.zeros(plain.shape, bool)
    kept[order[np.concatenate([[0.0], cumulative[:-1]]) < top_p]] = True
    return plain, plain - np.log(np.exp(plain[kept]).sum()), kept, cumulative


def test_pitfall_9_sampler_truncation_replayed_from_recorded_params():
    """Top-p at T != 1: the server's PROCESSED logprob is log_softmax(logits / T) - log(kept mass); the client records
    the parameters with every sample and the learner replays them, giving the server's value, not the biased one."""
    from learner.logprobs.sampler_replay import replayed_token_stats
    from learner.update.logprob_mode import replay_params
    from rollout_client import FinishReason, LogprobMode, RolloutRequest, SamplingParams, collate
    from rollout_client.protocol import pb
    from rollout_client.samples import RawSample, build_sample

    # values exact in float32 (the wire's type), so the echoed parameters compare equal
    logits = np.random.default_rng(9).normal(0.0, 2.0, (2, 3, 16)).astype(np.float32)
    params = [SamplingParams(temperature=0.75, top_k=0, top_p=0.75, min_p=0.0, max_new_tokens=3, seed=1),
              SamplingParams(temperature=1.25, top_k=0, top_p=0.625, min_p=0.0, max_new_tokens=3, seed=2)]
    refs = [[processed_reference(logits[b, t], params[b].temperature, params[b].top_p) for t in range(3)]
            for b in range(2)]
    targets = np.array([[np.flatnonzero(k)[np.argmin(p[k])] for _, p, k, _ in row] for row in refs])  # last kept
    plain = np.array([[p[i] for (p, _, _, _), i in zip(row, ti)] for row, ti in zip(refs, targets)])
    want = np.array([[q[i] for (_, q, _, _), i in zip(row, ti)] for row, ti in zip(refs, targets)])
    mass = np.array([[np.exp(p[k]).sum() for p, _, k, _ in row] for row in refs])
    assert all(np.abs(c - params[b].top_p).min() > 1e-3 for b in range(2) for *_, c in refs[b])  # no float32 tie
    # (a) without replay the ratio is off by exactly -log(kept mass), here at least 0.02 nats
    np.testing.assert_allclose(want - plain, -np.log(mass), rtol=0, atol=1e-12)
    assert np.all(-np.log(mass) > 0.02)
    # (c) the request carries the parameters, the server echoes them into every Sample, collate keeps them per row
    samples = []
    for b, sp in enumerate(params):
        wire = RolloutRequest([1, 2], sp).to_proto()
        assert SamplingParams.from_proto(wire.sampling) == sp
        raw = RawSample(targets[b].astype(np.int32), want[b].astype(np.float32), [(0, 3, 0)],
                        pb.SampleResult(finish_reason=int(FinishReason.LENGTH), sampling=wire.sampling))
        samples.append(build_sample(raw, f"r{b}", 0, np.array([1, 2], np.int32), LogprobMode.PROCESSED))
        assert samples[-1].sampling == sp
    batch = collate(samples, pad_to_multiple=1)
    np.testing.assert_array_equal(batch.temperature, [0.75, 1.25])
    np.testing.assert_array_equal(batch.top_p, [0.75, 0.625])
    # (b) the learner's replay from the batch's parameters gives the server's value; its kept mass is the same
    sampling = replay_params("PROCESSED", batch)
    stats = replayed_token_stats(jnp.asarray(logits), jnp.asarray(targets, jnp.int32), sampling)
    np.testing.assert_allclose(np.asarray(stats["logprobs"]), want, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(stats["logprobs"]), batch.rollout_logprobs[:, 2:], rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(stats["log_kept_mass"]), np.log(mass), rtol=0, atol=1e-5)
