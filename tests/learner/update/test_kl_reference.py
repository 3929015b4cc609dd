"""The KL-to-reference penalty inside the learner's update, against a float64 reference (issue #12, item 6).

With ``corrections.kl_coef = c > 0`` the update recomputes the frozen reference policy's logprobs with
``ref_params`` and adds ``c * KL`` to the loss, ``KL`` the token mean (over the loss mask: ``token-mean``,
denominator ``original``, no rejection rule so every valid token is kept) of the per-token estimator of
corrections.md section 5, with ``l = lp - ref``: k1 ``l``, k3 ``exp(-l) - 1 + l``, low_var_kl that clamped to
``[-10, 10]``.

What is independent of the code under test: the estimator's value, its clamp, its derivative ``d k / d lp``, the
masked reduction and the coefficient are written here from corrections.md in NumPy float64; the optimizer step is
plain SGD with learning rate 1 (`update_problem.OPTIMIZER`), so a parameter change IS minus the gradient. What is
the learner's own: the per-token logprobs (``learner.logprobs.token_logprobs``, tested in
tests/learner/logprobs/test_logprobs.py) and their pull-back to the parameters (``jax.vjp`` of that same function,
float32). So:

- ``actor/kl_loss`` must equal the float64 token mean of the estimator of the learner's float32 logprobs;
- ``(params after the update with kl_coef = c) - (after it with kl_coef = 0)`` (same state, same batch, token-TIS
  PPO loss with non-zero advantages in both) must equal ``-vjp(c * k'(l) * mask / N)``.

The update runs jitted (`make_update_fn`) on a (2, 2, 2) mesh of the 8 CPU devices with 2 micro-batches, so the
KL's token mean must be global over shards and micro-batches. The reference parameters are the current ones plus
Gaussian noise (std 0.15, about the size of the weights themselves), so the per-token log-ratios span several nats:
every estimator is far from zero and low_var_kl's clamp binds on some tokens (asserted, so that the clamp is really
exercised).
"""

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from learner.logprobs.chunked import token_logprobs
from learner.model.sharding import make_mesh
from learner.update.step import make_update_fn, update_step
from learner.update.train_state import create_sharded_train_state
from tests.support import update_problem
from tests.support.update_problem import FAST_COMPILE, MODEL, OPTIMIZER

KL_COEF = 0.25  # not 1, so that a dropped or squared coefficient shows; a power of 2, so c * x is exact.
NUM_MICROBATCHES = 2  # the KL's token mean must be global over the micro-batches, not a mean of their means.

# Tolerances. The update's training forward and this file's logprob pass are different XLA programs, so the same
# float32 logprob may differ by a few ulp: |lp| < 16 here (asserted), ulp(8) ~ 1e-6, so the per-token log-ratios
# agree to ~2e-6 absolute. The KL's value is a mean of k(l); its error is about mean(|k'(l)|) * that (|k'| = 1 for
# k1, |1 - e^-l| for k3: a few on average here), inside VALUE_RTOL * KL + VALUE_ATOL ~ 2e-5. (Seen: <= 6e-7.)
VALUE_RTOL, VALUE_ATOL = 1e-5, 2e-6
# The gradient difference is read off float32 parameters: ``after_c`` and ``after_0`` are each rounded to half an
# ulp of the parameter, so their difference carries up to ~1 ulp(|p|) (GRAD_ULPS = 4 for margin; this dominates
# the norm scales, |p| ~ 1). On top of that, each gradient entry is a float32 sum of many per-token terms (model
# backward, 2 micro-batches, the float32 cotangent): its error scales with the size of those terms, not with the
# entry (which can cancel to ~0), so GRAD_RTOL is relative to the leaf's largest entry. Seen: <= 1e-5 of it; a
# coefficient or derivative 0.1% off is 20x over (checked in the test, so the tolerance is known to be tight).
GRAD_RTOL, GRAD_ULPS = 5e-5, 4.0


def _estimator64(estimator: str, lp: np.ndarray, ref: np.ndarray):
    """Per-token ``(k, dk/dlp)`` in float64, from corrections.md section 5 (l clamped to [-20, 20] first, the
    library's safety clamp; inactive here since |l| < 20 is asserted)."""
    l = np.clip(lp - ref, -20.0, 20.0)
    if estimator == "k1":
        return l, np.ones_like(l)
    k3, dk3 = np.exp(-l) - 1.0 + l, 1.0 - np.exp(-l)
    if estimator == "k3":
        return k3, dk3
    if estimator == "low_var_kl":  # clip(k3, -10, 10): k3 >= 0, so only the upper edge binds; flat beyond it.
        return np.clip(k3, -10.0, 10.0), np.where(k3 < 10.0, dk3, 0.0)
    raise AssertionError(estimator)


@functools.partial(jax.jit, static_argnums=0, compiler_options=FAST_COMPILE)
def _logprobs_and_pullback(graphdef, params, batch, cotangent):
    """The learner's float32 per-token logprobs of ``batch`` under ``params`` and the pull-back of ``cotangent``
    ([B, T]) to the parameters (one device, no sharding: independent of the mesh the update runs on)."""
    def logprobs(p):
        return token_logprobs(nnx.merge(graphdef, p), batch.tokens, batch.positions, batch.attention_mask,
                              chunk_size=8)
    lp, pullback = jax.vjp(logprobs, params)
    return lp, pullback(cotangent)[0]


@pytest.fixture(scope="module")
def problem():
    """The tiny model on a (2, 2, 2) mesh, its state and a perturbed reference as host copies, the batch, and a
    runner of one update call (one compiled program per correction config)."""
    mesh = make_mesh(2, 2, 2)
    graphdef, state, shardings = create_sharded_train_state(MODEL, OPTIMIZER, mesh, seed=0)
    host_state = jax.device_get(state)
    rng = np.random.default_rng(12)
    host_ref = jax.tree.map(lambda p: (p + rng.normal(0.0, 0.15, p.shape)).astype(p.dtype), host_state.params)
    host_batch = update_problem.rollout_batch()
    batch = update_problem.global_batch(host_batch, mesh)
    compiled = {}

    def run(corrections, ref_params):
        """One update of a fresh copy of the state (it is donated); host ``(params_after, metrics)``."""
        if corrections not in compiled:
            config = update_problem.update_config(NUM_MICROBATCHES, corrections)
            compiled[corrections] = make_update_fn(graphdef, OPTIMIZER, config, mesh, shardings, FAST_COMPILE)
        ref = None if ref_params is None else jax.device_put(ref_params, shardings.params)
        new_state, metrics, _ = compiled[corrections](jax.device_put(host_state, shardings), batch, ref)
        return jax.device_get(new_state.params), jax.device_get(metrics)

    baseline = run(update_problem.CORRECTIONS.replace(kl_coef=0.0), None)
    lp, _ = _logprobs_and_pullback(graphdef, host_state.params, host_batch, np.zeros(host_batch.tokens.shape,
                                                                                      np.float32))
    ref_lp, _ = _logprobs_and_pullback(graphdef, host_ref, host_batch, np.zeros(host_batch.tokens.shape, np.float32))
    return dict(graphdef=graphdef, host_state=host_state, host_ref=host_ref, host_batch=host_batch, run=run,
                baseline=baseline, lp=np.asarray(lp, np.float64), ref_lp=np.asarray(ref_lp, np.float64))


def _kl_config(estimator: str, kl_coef: float = KL_COEF):
    return update_problem.CORRECTIONS.replace(kl_coef=kl_coef, kl_estimator=estimator)


def _assert_params_close(got, want, before, after, what):
    """Leaf by leaf: ``|got - want| <= GRAD_RTOL * max|want| + GRAD_ULPS * ulp(max(|before|, |after|))`` (see the
    tolerances)."""
    for (path, g), w, b, a in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want),
                                  jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        ulp = np.spacing(np.maximum(np.abs(np.asarray(b, np.float32)), np.abs(np.asarray(a, np.float32))))
        tolerance = GRAD_RTOL * np.abs(w).max() + GRAD_ULPS * ulp.astype(np.float64)
        excess = np.abs(g - w) / tolerance
        assert np.all(excess <= 1), (f"{what} {jax.tree_util.keystr(path)}: |got - want| up to {excess.max():.3g} "
                                     f"times the tolerance; max |got - want| {np.abs(g - w).max():.3g}, "
                                     f"max |want| {np.abs(w).max():.3g}")


def test_the_reference_differs_from_the_policy(problem):
    """The premise of the golden checks: large log-ratios on the loss tokens (but inside the [-20, 20] clamp),
    some beyond low_var_kl's clamp."""
    mask = problem["host_batch"].loss_mask > 0
    l = (problem["lp"] - problem["ref_lp"])[mask]
    assert mask.sum() > 100
    assert np.abs(l).mean() > 0.5 and np.abs(l).max() < 20.0
    assert max(np.abs(problem["lp"][mask]).max(), np.abs(problem["ref_lp"][mask]).max()) < 16.0
    k3, _ = _estimator64("k3", problem["lp"][mask], problem["ref_lp"][mask])
    assert 0 < np.sum(k3 > 10.0) < mask.sum() // 2


@pytest.mark.parametrize("estimator", ["k1", "k3", "low_var_kl"])
def test_kl_value_and_gradient_match_float64(problem, estimator):
    mask = (problem["host_batch"].loss_mask > 0).astype(np.float64)
    tokens = mask.sum()  # token-mean, denominator "original": every loss token, no rejection rule here
    k, dk = _estimator64(estimator, problem["lp"], problem["ref_lp"])
    want_kl = np.sum(k * mask) / tokens

    after, metrics = problem["run"](_kl_config(estimator), problem["host_ref"])
    after_0, metrics_0 = problem["baseline"]

    # The value: actor/kl_loss, and the KL's share of the loss (pg_loss with minus without it).
    assert abs(want_kl) > 1e-3  # far from 0 (k1's signed mean is the smallest)
    np.testing.assert_allclose(metrics["actor/kl_loss"], [want_kl], rtol=VALUE_RTOL, atol=VALUE_ATOL)
    np.testing.assert_allclose(metrics["actor/pg_loss"] - metrics_0["actor/pg_loss"], [KL_COEF * want_kl],
                               rtol=VALUE_RTOL, atol=KL_COEF * VALUE_ATOL + 2e-6)  # + float32 loss rounding
    np.testing.assert_array_equal(metrics["actor/loss_denominator"], [tokens])

    # The gradient: SGD(1) moves the params by minus the gradient, so after_c - after_0 = -c dKL/dparams.
    cotangent = (KL_COEF * dk * mask / tokens).astype(np.float32)
    _, kl_grads = _logprobs_and_pullback(problem["graphdef"], problem["host_state"].params, problem["host_batch"],
                                         cotangent)
    got = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), after, after_0)
    want = jax.tree.map(lambda g: -np.asarray(g, np.float64), jax.device_get(kl_grads))
    assert max(np.abs(w).max() for w in jax.tree.leaves(want)) > 1e-3  # a step far above float32 rounding
    _assert_params_close(got, want, problem["host_state"].params, after_0, estimator)
    with pytest.raises(AssertionError):  # the tolerance is tight enough to see a coefficient off by 0.1%
        _assert_params_close(got, jax.tree.map(lambda w: 1.001 * w, want), problem["host_state"].params, after_0,
                             "0.1% off")


def test_kl_to_the_policy_itself_is_zero_with_zero_gradient(problem):
    """k3 with ref_params = the current params: value 0 and no change to the update (the log-ratios are 0 up to
    float32 rounding of two logprob passes, so k3 ~ l^2/2 and its gradient ~ l, both negligible)."""
    after, metrics = problem["run"](_kl_config("k3"), problem["host_state"].params)
    after_0, metrics_0 = problem["baseline"]
    np.testing.assert_allclose(metrics["actor/kl_loss"], [0.0], atol=1e-10)
    np.testing.assert_allclose(metrics["actor/pg_loss"], metrics_0["actor/pg_loss"], rtol=1e-6, atol=1e-7)
    got = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), after, after_0)
    zeros = jax.tree.map(np.zeros_like, got)
    _assert_params_close(got, zeros, problem["host_state"].params, after_0, "k3 to itself")


def test_kl_without_ref_params_is_a_value_error(problem):
    """Raised before anything is traced, naming the missing argument."""
    config = update_problem.update_config(NUM_MICROBATCHES, _kl_config("k3"))
    with pytest.raises(ValueError, match="ref_params"):
        update_step(problem["host_state"], problem["host_batch"], None, graphdef=problem["graphdef"],
                    optimizer=OPTIMIZER, config=config)


def test_jitted_update_without_ref_params_names_them(problem):
    with pytest.raises(ValueError, match="ref_params"):
        problem["run"](_kl_config("k3"), None)
