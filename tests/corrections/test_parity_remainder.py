"""The parity remainder of issue 30, each against the reference's own code (the NumPy ports under
tests/support/reference_ports, re-checked against the upstream lines cited in each test):

1. the KL estimators k1 and k2 take no exp and are not clamped (slime ``compute_approx_kl``, verl
   ``kl_penalty_forward``), nor is verl's REINFORCE ``actor/ppo_kl``;
2. AReaL's rejection zeroes the behaviour weights of the tokens it rejects;
3. ``from_areal`` reads ``rejection_sampling.agg = "max"`` as the outlier veto;
4. ``reduce_loss(..., count_rows=True)`` is verl's ``seq-mean-token-sum-norm`` over weights computed elsewhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import corrections
from corrections import CorrectionConfig, Objective
from tests.corrections.test_reference_compat import AREAL_RS_ROWS, close, data, run, same_mask
from tests.support.reference_ports import areal, slime, verl


@pytest.mark.parametrize("estimator, value, gradient", [("k1", 25.0, 1.0), ("k2", 312.5, 25.0)])
def test_k1_k2_kl_is_not_clamped(estimator, value, gradient):
    """lp = 0, ref = -25: slime's compute_approx_kl (slime/utils/ppo_utils.py:28-33 at 624b824a, no clamp) and
    verl's kl_penalty_forward (verl/trainer/ppo/core_algos.py:1879-1886 at b178a3cd) give k1 = 25 and
    k2 = 312.5; the gradient in lp is 1 and l = 25 (the old clamp to [-20, 20] gave 20 / 200 and gradient 0)."""
    lp, ref = np.array([0.0]), np.array([-25.0])
    assert slime.compute_approx_kl(lp, ref, estimator)[0] == value
    assert verl.kl_penalty(lp, ref, estimator)[0] == value
    got = corrections.kl_penalty(lp, ref, estimator)
    grad = jax.grad(lambda x: jnp.sum(corrections.kl_penalty(x, ref, estimator)))(jnp.asarray(lp, jnp.float32))
    close(got, value, what="value")
    close(grad, gradient, what="gradient")


def test_k1_kl_loss_in_compute_matches_slime_far_from_ref():
    """The KL term of ``compute`` (k1, slime's default) on tokens 25 nats from the reference: slime's loss."""
    lp, m, adv = np.zeros((1, 3), np.float32), np.ones((1, 3), np.float32), np.zeros(1, np.float32)
    ref = np.array([[-25.0, -1.0, 30.0]], np.float32)
    config = corrections.from_slime("--use-kl-loss --kl-loss-coef 0.5 --kl-loss-type k1 --calculate-per-token-loss")
    out = corrections.compute(lp, adv, m, config, proximal_logprobs=lp, ref_logprobs=ref)
    want = 0.5 * slime.compute_approx_kl(lp, ref, "k1").mean()
    close(out.loss, want, what="k1 KL loss")


def test_verl_reinforce_ppo_kl_is_not_clamped():
    """verl's REINFORCE reports ``actor/ppo_kl = masked_mean(rollout - lp)`` without a clamp
    (verl/trainer/ppo/core_algos.py:2054-2055 at b178a3cd); a token 30 nats off moves it by 30, not 20."""
    lp = np.array([[-1.0, -2.0, -31.0]])
    roll = np.array([[-1.5, -2.0, -1.0]])
    m, adv = np.ones((1, 3)), np.array([1.0])
    _, want = verl.compute_policy_loss_reinforce(roll, lp, adv[:, None] * m, m, "token-mean")
    config = corrections.from_verl(bypass_mode=True, loss_type="reinforce")
    out = corrections.compute(lp.astype(np.float32), adv.astype(np.float32), m.astype(np.float32), config,
                              rollout_logprobs=roll.astype(np.float32))
    close(out.metrics["actor/ppo_kl"], want["actor/ppo_kl"], what="actor/ppo_kl")


def test_areal_sequence_rejection_zeroes_the_weights_it_rejects():
    """The issue's row: two tokens at behaviour ratio 0.8, bounds [0.95, 1.05], sequence level: AReaL's
    apply_rejection_sampling (areal/utils/functional/functional.py:405-420 at 4aef98d8:
    ``behave_imp_weight = torch.where(updated_mask.bool(), behave_imp_weight, 0.0)``) returns mask [0, 0] and
    weights [0, 0]; so does Tether through from_areal (it returned weights [0.8, 0.8])."""
    old = np.log(np.array([[0.4, 0.4]]))
    prox = old + np.log(0.8)
    m = np.ones((1, 2))
    rs = dict(level="sequence", metric="ratio", agg="mean", action="mask", lower=0.95, upper=1.05)
    mask, weights, _ = areal.apply_rejection_sampling(prox, old, m, **rs)
    config = corrections.from_areal(actor={"use_decoupled_loss": True, "rejection_sampling": rs})
    out = corrections.compute(prox.astype(np.float32), np.ones(1, np.float32), m.astype(np.float32), config,
                              proximal_logprobs=prox.astype(np.float32), rollout_logprobs=old.astype(np.float32))
    assert mask.tolist() == [[False, False]] and weights.tolist() == [[0.0, 0.0]]
    same_mask(out.mask, mask)
    close(out.weights, weights, what="weights")



@pytest.mark.parametrize("name", sorted(n for n in AREAL_RS_ROWS if "/max/" in n))
def test_from_areal_reads_agg_max(name):
    """``agg: max`` with ``action: mask``: from_areal gives the config of docs/from-other-frameworks.md's AReaL
    table (the outlier veto for ratio and kl_k1, seq_max_k2 for kl_k2), and its mask, weights and loss are AReaL's
    (apply_rejection_sampling's ``agg == "max"`` branch, functional.py at 4aef98d8)."""
    kwargs, want_config = AREAL_RS_ROWS[name]
    config = corrections.from_areal(actor={"use_decoupled_loss": True, "rejection_sampling": kwargs})
    assert config.rejection == want_config.rejection and config.importance == want_config.importance
    n = data().n
    mask, bw, _ = areal.apply_rejection_sampling(n["old"], n["roll"], n["m"], **kwargs)
    want, _ = areal.ppo_actor_loss_fn_rs(n["lp"], n["old"], n["roll"], n["A"], 0.2, n["m"], rejection_sampling=kwargs)
    got = run(config)
    assert 0 < mask.sum() < n["m"].sum(), "the rule rejects some rows on this batch"
    same_mask(got.mask, mask)
    close(got.weights, bw, where=n["m"] > 0, what="weights")
    close(got.loss, want, what="loss")


def test_from_areal_agg_max_with_lower_is_refused():
    with pytest.raises(ValueError, match=r"rejection_sampling.lower=0.5 is not supported: with agg='max'"):
        corrections.from_areal(actor={"use_decoupled_loss": True, "rejection_sampling": dict(
            level="sequence", agg="max", metric="ratio", lower=0.5, upper=2.0)})


def test_reduce_loss_count_rows_is_verls_seq_mean_token_sum_norm():
    """verl's agg_loss("seq-mean-token-sum-norm") (the port's, verl 1dda039b: the sum of row sums over the rows
    that kept a token, divided by T) from a per-token loss and a mask with a fully rejected row: reduce_loss
    with count_rows=True; without it, the B * T of the Dr. GRPO paper. ``compute``'s denominator="kept" agrees."""
    rng = np.random.default_rng(3)
    loss = rng.normal(size=(4, 6))
    mask = (rng.uniform(size=(4, 6)) < 0.7).astype(np.float64)
    mask[2] = 0.0
    want = verl.agg_loss(loss, mask, "seq-mean-token-sum-norm")
    close(corrections.reduce_loss(loss, mask, mode="seq-mean-token-sum-norm", count_rows=True), want)
    close(corrections.reduce_loss(loss, mask, mode="seq-mean-token-sum-norm"), (loss * mask).sum() / (4 * 6))
    # compute with precomputed weights: the same number through the pipeline's denominator="kept"
    config = CorrectionConfig(objective=Objective("reinforce"), reduction="seq-mean-token-sum-norm",
                              denominator="kept")
    lp = rng.normal(size=(4, 6)).astype(np.float32) - 1.0
    adv = np.array([1.0, -0.5, 0.3, 2.0], np.float32)
    out = corrections.compute(lp, adv, mask.astype(np.float32), config)
    per_token = -adv[:, None].astype(np.float64) * lp
    close(out.loss, verl.agg_loss(per_token, mask, "seq-mean-token-sum-norm"), what="compute")
