"""Issue #16: a metric with a reference's name has that reference's meaning and value.

One golden test per item (C1-C10, Dr. GRPO after rejection, slime's off_policy_is), each number checked against
NumPy float64 written from the formula AND against the reference's port (tests/support/reference_ports); then the added
metrics and options against the ports. Floats are compared at 1e-5 relative: JAX computes in float32.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import corrections as c
from corrections import CorrectionConfig, ImportanceWeights, Objective, RejectionRule
from tests.support.reference_ports import areal, fw_cookbook, skyrl, slime, verl

P = "rollout_corr/"
RTOL, ATOL = 1e-5, 1e-6


def close(got, want, what=""):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=RTOL, atol=ATOL, err_msg=what)


def run(cfg, lp, adv, m, old=None, roll=None, **kw):
    return c.compute(jnp.asarray(lp, jnp.float32), np.asarray(adv, np.float32), np.asarray(m, np.float32), cfg,
                     proximal_logprobs=None if old is None else np.asarray(old, np.float32),
                     rollout_logprobs=None if roll is None else np.asarray(roll, np.float32), **kw)


def ratios_batch(ratios, mask=None):
    """lp = old (PPO ratio 1) and roll such that exp(old - roll) = ratios."""
    ratios = np.asarray(ratios, np.float64)
    old = np.log(np.full(ratios.shape, 0.5))
    return old, old, old - np.log(ratios), np.ones(ratios.shape) if mask is None else np.asarray(mask, np.float64)


def test_c1_sequence_fraction_high_counts_sequences():
    # rows [1 token, ratio 3] and [4 tokens, ratio 1]; sequence IS threshold 2: verl 0.5 (one row of two)
    lp, old, roll, m = ratios_batch([[3.0, 1, 1, 1], [1, 1, 1, 1]], [[1, 0, 0, 0], [1, 1, 1, 1]])
    out = run(CorrectionConfig(importance=ImportanceWeights("sequence", high=2.0)), lp, [1, 1], m, old, roll)
    close(out.metrics[P + "rollout_is_ratio_fraction_high"], 0.5)
    _, want = verl.compute_rollout_correction_weights(old - roll, m, "sequence", 2.0)
    close(out.metrics[P + "rollout_is_ratio_fraction_high"], want["rollout_is_ratio_fraction_high"])
    for key in ("rollout_is_max", "rollout_is_min", "rollout_is_mean"):
        close(out.metrics[P + key], want[key], key)  # max/min: raw sequence ratios 3 and 1


def test_c2_fraction_low_uses_the_lower_bound():
    # IcePop "0.5_5.0": ratios [0.3, 1.0] -> verl 0.5 (0.3 < 0.5), not 1/5
    lp, old, roll, m = ratios_batch([[0.3, 1.0]])
    cfg = CorrectionConfig(importance=ImportanceWeights("token", low=0.5, high=5.0, overflow="mask"))
    out = run(cfg, lp, [1], m, old, roll)
    close(out.metrics[P + "rollout_is_ratio_fraction_low"], 0.5)
    _, want = verl.compute_rollout_correction_weights(old - roll, m, "token", "0.5_5.0")
    close(out.metrics[P + "rollout_is_ratio_fraction_low"], want["rollout_is_ratio_fraction_low"])


def test_c3_is_metrics_are_over_the_original_mask():
    # ratios [3, 1.2, 1, 0.8], token TIS 2, token_k1 keeps [0.5, 2]: verl mean 1.25, min 0.8, ESS 0.8828
    lp, old, roll, m = ratios_batch([[3.0, 1.2, 1.0, 0.8]])
    cfg = CorrectionConfig(importance=ImportanceWeights("token", high=2.0),
                           rejection=(RejectionRule("token_k1", 0.5, 2.0),))
    out = run(cfg, lp, [1], m, old, roll)
    w = np.array([2.0, 1.2, 1.0, 0.8])
    golden = {"rollout_is_mean": 1.25, "rollout_is_min": 0.8, "rollout_is_max": 2.0,
              "rollout_is_eff_sample_size": w.mean() ** 2 / np.mean(w**2), "rollout_is_std": w.std()}
    for key, value in golden.items():
        close(out.metrics[P + key], value, key)
    _, want = verl.compute_rollout_correction_weights(old - roll, m, "token", 2.0)
    for key in golden:
        close(out.metrics[P + key], want[key], key)
    assert out.weights.tolist() == [[0.0, 1.2000000476837158, 1.0, 0.800000011920929]]  # the loss drops token 0


def test_c4_per_rule_fractions_are_each_rule_on_its_own():
    # ratios [[1.3, 1.3], [1.0, 1.3]], token_k2 and token_k3 at 0.02: verl's token_k3 fraction 0.75
    lp, old, roll, m = ratios_batch([[1.3, 1.3], [1.0, 1.3]])
    cfg = CorrectionConfig(rejection=(RejectionRule("token_k2", high=0.02), RejectionRule("token_k3", high=0.02)))
    out = run(cfg, lp, [1, 1], m, old, roll)
    close(out.metrics[P + "rollout_rs_token_k3_masked_fraction"], 0.75)
    _, want = verl.compute_rollout_rejection_mask(old - roll, m, "token_k2,token_k3", "0.02")
    for key, value in want.items():
        close(out.metrics[P + key], value, key)  # every per-rule statistic too


def test_c5_reinforce_reports_verls_ppo_kl():
    rng = np.random.default_rng(5)
    lp = np.log(rng.uniform(0.2, 0.9, (2, 3)))
    roll = lp + rng.normal(0, 0.1, (2, 3))
    m = np.array([[1, 1, 0], [1, 1, 1.0]])
    adv = np.array([1.0, -1.0])
    out = run(c.preset("bypass_pg_is"), lp, adv, m, roll=roll)
    close(out.metrics["actor/ppo_kl"], ((roll - lp) * m).sum() / m.sum())
    _, want = verl.compute_policy_loss_bypass_mode(roll, lp, adv[:, None] * m, m, "seq-mean-token-sum",
                                                   loss_type="reinforce", rollout_is="token")
    close(out.metrics["actor/ppo_kl"], want["actor/ppo_kl"])


def test_c6_token_ratio_family_is_skyrls_is_ratio_mean_and_max():
    lp, old, roll, m = ratios_batch([[3.408, 0.9, 1.0], [1.1, 0.5, 2.0]], [[1, 1, 0], [1, 1, 1]])
    out = run(c.preset("skyrl_token_tis"), lp, [1, 1], m, old, roll)
    rho = np.array([3.408, 0.9, 1.1, 0.5, 2.0])
    close(out.metrics[P + "token_ratio_mean"], rho.mean())
    close(out.metrics[P + "token_ratio_max"], 3.408)
    close(out.metrics[P + "token_ratio_min"], 0.5)
    close(out.metrics[P + "token_ratio_std"], rho.std())
    close(out.metrics[P + "rollout_is_max"], 2.0)  # the applied (capped) weight is another quantity
    _, want = skyrl.compute_off_policy_correction(old, roll, m, {"tis_ratio_type": "token"})[:2]
    close(out.metrics[P + "token_ratio_mean"], want["is_ratio_mean"])
    close(out.metrics[P + "token_ratio_max"], want["is_ratio_max"])


def test_c7_skyrl_cross_entropy_is_a_token_sum():
    lp = np.log([[0.5, 0.25, 0.9], [0.3, 0.6, 1.0]])
    m = np.array([[1, 1, 1], [1, 1, 0.0]])
    out = run(CorrectionConfig(objective=Objective("cross_entropy"), reduction="token-sum"), lp, [0, 0], m)
    want, _ = skyrl.cross_entropy_loss(lp, lp, np.zeros_like(lp), {}, loss_mask=m)
    close(out.loss, want)
    close(out.loss, -(np.log([0.5, 0.25, 0.9, 0.3, 0.6])).sum())


def test_c8_clip_ratio_is_over_the_original_mask_pg_clipfrac_over_kept():
    # token 2 is clipped (ratio 1.5, A > 0) and rejected by the token mask: SkyRL counts it, verl does not
    lp = np.log([[0.5, 0.5, 0.75, 0.5]])
    old = np.log([[0.5, 0.5, 0.5, 0.5]])
    roll = old - np.log([[1.0, 1.0, 3.0, 1.0]])
    m = np.ones((1, 4))
    cfg = CorrectionConfig(rejection=(RejectionRule("token", 0.5, 2.0),))
    out = run(cfg, lp, [1.0], m, old, roll)
    close(out.metrics["actor/clip_ratio"], 0.25)
    close(out.metrics["actor/pg_clipfrac"], 0.0)
    opc = {"token_mask_is_threshold_low": 0.5, "token_mask_is_threshold_high": 2.0}
    _, want = skyrl.ppo_policy_loss(lp, old, np.ones((1, 4)), {"off_policy_correction": opc}, m, roll)
    close(out.metrics["actor/clip_ratio"], want["clip_ratio"])


def _gspo_rows():
    lp = np.log([[0.5, 0.5, 0.5]])
    old = lp.copy()
    roll = old - np.log([[1.0, 0.25, 1.0]])  # behaviour weights [1, 0.25]; token 2 padding
    m = np.array([[1, 1, 0.0]])
    return lp, old, roll, m


@pytest.mark.parametrize("form,want", [("token", [-1.0, -0.25, 0.0]), ("sequence", [-0.625, -0.625, 0.0])])
def test_c9_gspo_gradient_forms(form, want):
    lp, old, roll, m = _gspo_rows()
    cfg = CorrectionConfig(objective=Objective("gspo", clip_low=0.2, clip_high=0.2, gspo_form=form),
                           importance=ImportanceWeights("token", high=None), reduction="token-sum")
    grad = jax.grad(lambda x: run(cfg, x, [1.0], m, old, roll).loss)(jnp.asarray(lp, jnp.float32))
    close(grad[0], want)
    assert float(run(cfg, lp, [1.0], m, old, roll).loss) == pytest.approx(-1.25)  # the same loss value


def test_c9_gspo_sequence_form_matches_areal_over_the_kept_mask():
    rng = np.random.default_rng(9)
    lp = np.log(rng.uniform(0.3, 0.9, (2, 4)))
    old = lp + rng.normal(0, 0.05, (2, 4))
    roll = old + rng.normal(0, 0.3, (2, 4))
    m = np.array([[1, 1, 1, 0], [1, 1, 1, 1.0]])
    adv = np.array([[1.0, 0.5, 2.0, 0.0], [-1.0, -0.5, -1.5, -1.0]]) * m
    lo, hi = 0.7, 1.4
    cfg = CorrectionConfig(objective=Objective("gspo", clip_low=0.2, clip_high=0.2, gspo_form="sequence"),
                           importance=ImportanceWeights("token", high=None),
                           rejection=(RejectionRule("token_k1", lo, hi),))
    rs = dict(metric="ratio", level="token", action="mask", upper=hi, lower=lo)

    def areal_loss(x):
        return areal.ppo_actor_loss_fn_rs(x, old, roll, adv, 0.2, m, rejection_sampling=rs,
                                          importance_sampling_level="sequence")[0]

    close(run(cfg, lp, adv, m, old, roll).loss, areal_loss(lp))
    grad = jax.grad(lambda x: run(cfg, x, adv, m, old, roll).loss)(jnp.asarray(lp, jnp.float32))
    h = 1e-6
    numeric = np.zeros_like(lp)
    for i in np.ndindex(lp.shape):
        e = np.zeros_like(lp)
        e[i] = h
        numeric[i] = (areal_loss(lp + e) - areal_loss(lp - e)) / (2 * h)
    np.testing.assert_allclose(np.asarray(grad, np.float64), numeric, rtol=1e-3, atol=1e-5)


def test_c10_geometric_weight_clamps_each_token_like_the_fw_cookbook():
    prox = np.log([[0.5, 0.5, 0.5]])
    inf = prox - np.array([[30.0, 0.0, -2.0]])  # one |log-ratio| > 20
    m = np.ones((1, 3))
    for each, want in ((True, np.exp((20.0 + 0.0 - 2.0) / 3)), (False, np.exp(28.0 / 3))):
        cfg = CorrectionConfig(importance=ImportanceWeights("geometric", high=1e9, clamp_each_token=each))
        out = run(cfg, prox, [1.0], m, prox, inf)
        close(out.weights[0, 0], want, f"clamp_each_token={each}")
    ref, _ = fw_cookbook.compute_tis_weight(prox[0], inf[0], tis_cap=1e9, tis_level="sequence")
    cfg = CorrectionConfig(importance=ImportanceWeights("geometric", high=1e9, clamp_each_token=True))
    close(run(cfg, prox, [1.0], m, prox, inf).weights[0], ref)


def test_fw_cookbook_grpo_loss_is_token_sum_with_token_tis():
    rng = np.random.default_rng(11)
    pi, prox = np.log(rng.uniform(0.2, 0.9, (1, 5))), np.log(rng.uniform(0.2, 0.9, (1, 5)))
    inf = prox + rng.normal(0, 0.5, (1, 5))
    cfg = CorrectionConfig(importance=ImportanceWeights("token", high=5.0), reduction="token-sum")
    want, _ = fw_cookbook.grpo_response_loss(pi[0], prox[0], inf[0], 0.7)
    close(run(cfg, pi, [0.7], np.ones((1, 5)), prox, inf).loss, want)


def test_dr_grpo_kept_denominator_counts_rows_that_kept_a_token():
    # two rows of T = 3, the second rejected by the geometric rule; the kept row's loss sums to 0.35:
    # verl 0.35 / (1 row * 3) = 0.1167, the paper's B * T: 0.35 / 6 = 0.0583
    lp = np.log([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]])
    roll = lp - np.log([[1.0, 1.0, 1.0], [3.0, 3.0, 3.0]])
    m = np.ones((2, 3))
    adv = np.array([-0.35 / 3, -0.35 / 3])
    base = dict(rejection=(RejectionRule("geometric", 0.5, 2.0),), reduction="seq-mean-token-sum-norm")
    kept = run(CorrectionConfig(denominator="kept", **base), lp, adv, m, lp, roll)
    original = run(CorrectionConfig(**base), lp, adv, m, lp, roll)
    close(kept.loss, 0.35 / 3)
    close(original.loss, 0.35 / 6)
    assert round(float(kept.loss), 4) == 0.1167 and round(float(original.loss), 4) == 0.0583
    want = verl.agg_loss(-adv[:, None] * np.ones((2, 3)), np.asarray(kept.mask, np.float64),
                         "seq-mean-token-sum-norm")
    close(kept.loss, want)


def test_slime_off_policy_is():
    # PR #2084 (8e0d556e): PPO vs the recomputed logprobs, times clamp(exp(sg(lp) - roll), 0, 2)
    rng = np.random.default_rng(20)
    lp = np.log(rng.uniform(0.2, 0.9, (2, 4)))
    old = lp + rng.normal(0, 0.1, (2, 4))
    roll = lp + rng.normal(0, 0.6, (2, 4))
    m = np.ones((2, 4))
    adv = np.array([1.0, -1.0])
    cfg = CorrectionConfig(importance=ImportanceWeights("token", low=0.0, high=2.0, numerator="current"),
                           reduction="seq-mean-token-mean")
    want, metrics = slime.policy_loss_function(lp, old, adv[:, None] * m, m, roll, use_tis=True,
                                               tis_func=slime.off_policy_is_function)
    out = run(cfg, lp, adv, m, old, roll)
    close(out.loss * 2, want)  # slime: a sum of sample means over the 2 samples
    close(out.metrics[P + "tis_clipfrac"], metrics["tis_clipfrac"] / 2)


@pytest.mark.parametrize("estimator", ["k3", "low_var_kl"])
def test_slime_unbiased_kl(estimator):
    rng = np.random.default_rng(21)
    lp = np.log(rng.uniform(0.2, 0.9, (2, 3)))
    old = lp + rng.normal(0, 0.2, (2, 3))
    ref = lp + rng.normal(0, 0.5, (2, 3))
    m = np.array([[1, 1, 1], [1, 1, 0.0]])
    cfg = CorrectionConfig(objective=Objective("cross_entropy"), kl_coef=1.0, kl_estimator=estimator,
                           kl_importance_weighted=True, reduction="seq-mean-token-mean")
    out = c.compute(lp, np.zeros(2), m, cfg, proximal_logprobs=old, ref_logprobs=ref)
    ce = -(lp * m).sum(-1) / m.sum(-1)
    want = slime.unbiased_kl_loss(lp, old, ref, estimator, m) / 2 + ce.mean()
    close(out.loss, want)


def test_opsm_needs_no_rollout_logprobs_and_matches_slime_clipfrac():
    rng = np.random.default_rng(22)
    lp = np.log(rng.uniform(0.2, 0.9, (3, 4)))
    old = lp + np.array([[0.2], [0.2], [-0.2]])
    m = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1.0]])
    adv = np.array([-1.0, 1.0, -1.0])
    cfg = CorrectionConfig(opsm_delta=1e-4)
    assert not cfg.needs_rollout_logprobs
    out = run(cfg, lp, adv, m, old)
    assert out.mask.sum(-1).tolist() == [0.0, 4.0, 4.0]
    _, clipfrac = slime.compute_opsm_mask_pr1917(adv[:, None] * m, lp, old, m)
    close(out.metrics[P + "opsm_clipfrac"], clipfrac / 3)
    close(out.metrics[P + "opsm_clipfrac"], 1 / 3)


def test_training_ppl_without_rollout_logprobs_is_verls():
    lp = np.log([[0.5, 0.25, 0.9], [0.3, 0.6, 0.7]])
    m = np.array([[1, 1, 0], [1, 1, 1.0]])
    out = run(CorrectionConfig(), lp, [1, 1], m, lp)
    want = verl.compute_offpolicy_metrics(lp, None, m)
    assert {k for k in out.metrics if "ppl" in k} == {P + "training_ppl", P + "training_log_ppl"}
    for key, value in want.items():
        close(out.metrics[P + key], value, key)


def test_compute_on_one_sequence():
    lp, roll = np.log([0.5, 0.25, 0.9]), np.log([0.25, 0.25, 0.5])
    m = np.array([1, 1, 0.0])
    cfg = CorrectionConfig(importance=ImportanceWeights("token", high=1.5))
    one = c.compute(lp, 2.0, m, cfg, proximal_logprobs=lp, rollout_logprobs=roll, policy_lag=1)
    batch = c.compute(lp[None], np.array([2.0]), m[None], cfg, proximal_logprobs=lp[None],
                      rollout_logprobs=roll[None], policy_lag=np.array([1]))
    assert one.weights.shape == one.mask.shape == one.per_token_loss.shape == (3,)
    close(one.weights, [1.5, 1.0, 0.0])
    close(one.loss, -2.0 * 2.5 / 2)
    assert one.metrics.keys() == batch.metrics.keys()
    for key in batch.metrics:
        close(one.metrics[key], batch.metrics[key], key)


@pytest.mark.parametrize("name", ["outlier", "geometric", "product"])
def test_skyrl_over_high_under_low_ratios(name):
    lp, old, roll, m = ratios_batch([[1.0, 250.0, 1.0], [1.0, 1.0, 1.0], [0.3, 0.4, 0.5], [1.5, 1.6, 1.2]])
    bounds = {"outlier": (1e-4, 100.0), "geometric": (0.99, 1.01), "product": (0.5, 2.0)}[name]
    opc = {"outlier": {"outlier_token_is_threshold_low": bounds[0], "outlier_token_is_threshold_high": bounds[1]},
           "geometric": {"sequence_mask_metric": "geometric"},
           "product": {"sequence_mask_metric": "product"}}[name]
    out = run(CorrectionConfig(rejection=(RejectionRule(name, *bounds),)), lp, [1] * 4, m, old, roll)
    _, want, _ = skyrl.compute_off_policy_correction(old, roll, m, opc)
    prefix = {"outlier": "outlier_seq", "geometric": "geo_sequence_mask", "product": "product_sequence_mask"}[name]
    for side in ("over_high", "under_low"):
        close(out.metrics[f"{P}{prefix}_{side}_ratio"], want[f"{prefix}_{side}_ratio"], side)


def test_skyrl_cispo_ratio_metrics_and_areal_behave_approx_kl():
    rng = np.random.default_rng(23)
    lp = np.log(rng.uniform(0.2, 0.9, (2, 4)))
    old = lp + rng.normal(0, 0.3, (2, 4))
    roll = old + rng.normal(0, 0.3, (2, 4))
    m = np.array([[1, 1, 1, 0], [1, 1, 1, 1.0]])
    cfg = CorrectionConfig(objective=Objective("cispo", clip_low=0.2, clip_high=0.2),
                           importance=ImportanceWeights("token", high=None),
                           rejection=(RejectionRule("token", 0.7, 1.4),))
    out = run(cfg, lp, [1.0, -1.0], m, old, roll)
    alg = {"cispo": {"cispo_eps_clip_low": 0.2, "cispo_eps_clip_high": 0.2}}
    _, want = skyrl.compute_policy_loss_cispo(lp, old, np.ones((2, 4)), alg, m)
    for key in ("cispo/ratio_mean", "cispo/ratio_clamped_mean", "cispo/ratio_max", "cispo/ratio_min"):
        close(out.metrics["actor/" + key], want[key], key)
    rs = dict(metric="ratio", level="token", action="mask", upper=1.4, lower=0.7)
    _, stat = areal.ppo_actor_loss_fn_rs(lp, old, roll, np.ones((2, 4)), 0.2, m, rejection_sampling=rs)
    close(out.metrics[P + "behave_approx_kl"], stat["behave_approx_kl"][stat["behave_mask"]].mean())


def test_verl_sequence_level_is_seq_metrics():
    rng = np.random.default_rng(24)
    lr = rng.normal(0, 0.4, (3, 4))
    m = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0.0]])
    old = np.log(np.full((3, 4), 0.5))
    for level, thr in (("token", 2.0), ("sequence", 1.5), ("token", "0.7_1.5")):
        if isinstance(thr, str):
            imp = ImportanceWeights(level, low=0.7, high=1.5, overflow="mask")
        else:
            imp = ImportanceWeights(level, high=thr)
        out = run(CorrectionConfig(importance=imp), old, [1, 1, 1], m, old, old - lr)
        _, want = verl.compute_rollout_correction_weights(lr, m, level, thr)
        for key, value in want.items():
            close(out.metrics[P + key], value, f"{level} {thr} {key}")
