"""Golden tests: every public function of ``corrections`` against the NumPy float64 reference in
``tests/support/corrections_reference.py`` (written from ../shared/reference/corrections.md), on random padded batches.

The batch has an all-padding row, a row of length 1, leading and trailing padding, and garbage (NaN, +-inf,
1e30) at every padded position of every input given to JAX; the reference only ever sees valid values. Log-ratio
scales are moderate and every row is designed to sit clearly on one side of each rejection bound, so float32
(JAX) and float64 (reference) agree to rtol 1e-5 / atol 1e-6.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import corrections
from corrections import CorrectionConfig, ImportanceWeights, Objective, RejectionRule
from tests.support import corrections_reference as ref

RTOL, ATOL = 1e-5, 1e-6
B, T = 8, 12
GARBAGE = (np.nan, np.inf, -np.inf, 1e30, -1e30)


def close(got, want, where=None, rtol=RTOL, atol=ATOL, what=""):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if where is not None:
        where = np.broadcast_to(np.asarray(where).astype(bool), got.shape)
        got, want = got[where], want[where]
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=what)


def same(got, want, where=None, what=""):
    got = np.asarray(got).astype(bool)
    want = np.asarray(want).astype(bool)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if where is not None:
        where = np.broadcast_to(np.asarray(where).astype(bool), got.shape)
        got, want = got[where], want[where]
    np.testing.assert_array_equal(got, want, err_msg=what)


def dirty(x, m):
    """float32 copy of x with garbage at every padded position."""
    x = np.array(x, np.float32)
    pad = ~np.asarray(m).astype(bool)
    idx = np.flatnonzero(pad)
    flat = x.reshape(-1)
    for j, i in enumerate(idx):
        flat[i] = GARBAGE[j % len(GARBAGE)]
    return x


def as64(x):
    """The exact float32 values JAX sees, as float64 for the reference."""
    return np.asarray(np.asarray(x, np.float32), np.float64)


# Row layout: (start, length, log-ratio noise, target mean of old - roll, noise of lp - old, spike).
ROWS = [
    (0, 0, 0.0, 0.0, 0.0, None),  # all padding
    (3, 1, 0.0, 3e-4, 1e-5, None),  # length 1
    (0, 12, 1e-4, 2e-4, 1e-5, None),  # tiny mismatch: kept by every rule
    (2, 8, 0.02, 5e-3, 0.1, None),  # Geo-RS (0.999/1.001) rejects, SkyRL geometric (0.99/1.01) keeps
    (1, 6, 0.45, -3e-4, 0.02, None),  # Geo-RS keeps, k3 rejects, token rules reject some
    (0, 9, 0.05, 0.1, 0.2, None),  # product (sum) rejects, k3 keeps
    (3, 9, 0.1, None, 0.1, 6.0),  # ratio 403 > 100: outlier veto
    (0, 5, 0.2, None, 0.3, -10.0),  # ratio 4.5e-5 < 1e-4: outlier veto
]


@functools.cache
def batch(seed=0):
    rng = np.random.default_rng(seed)
    m = np.zeros((B, T), np.float32)
    lr = np.zeros((B, T))
    d = np.zeros((B, T))
    for b, (start, length, noise, mean, dnoise, spike) in enumerate(ROWS):
        m[b, start : start + length] = 1
        x = rng.normal(0.0, noise, length) if length else np.zeros(0)
        if mean is not None and length:
            x = x - x.mean() + mean
        if spike is not None:
            x[length // 2] = spike
        lr[b, start : start + length] = x
        d[b] = rng.normal(0.0, dnoise, T) if dnoise else 0.0
    roll = -rng.uniform(0.05, 3.0, (B, T))
    old = roll + lr
    lp = old + d
    adv = rng.normal(0.0, 1.0, B)
    adv[6] = -0.7  # dual clip binds on the spike row in bypass mode
    adv[2] = 0.9
    adv_tok = rng.normal(0.0, 1.0, (B, T))
    ref_lp = lp + rng.uniform(-4.0, 4.0, (B, T))
    entropy = rng.uniform(0.0, 3.0, (B, T))
    lag = rng.integers(0, 5, (B, T))
    clean = dict(m=m, lr=lr, roll=roll, old=old, lp=lp, adv=adv, adv_tok=adv_tok, ref=ref_lp, entropy=entropy,
                 lag=lag)
    # float32 versions for JAX (garbage in padding) and their exact float64 values for the reference.
    jx = {k: dirty(v, m) for k, v in clean.items() if k in ("roll", "old", "lp", "adv_tok", "ref", "entropy")}
    jx["lr"] = dirty(np.float32(old) - np.float32(roll), m)
    jx["adv"] = np.float32(adv)
    jx["m"] = m
    np64 = {k: as64(np.where(m.astype(bool), np.float32(v), 0.0)) for k, v in clean.items() if v.shape == (B, T)}
    np64["lr"] = np.where(m.astype(bool), as64(np.float32(old)) - as64(np.float32(roll)), 0.0)
    np64["adv"] = as64(adv)
    np64["m"] = m.astype(bool)
    np64["lag"] = lag
    return jx, np64


@pytest.fixture(scope="module")
def data():
    return batch()


def test_batch_has_the_promised_shape(data):
    _, n = data
    lengths = n["m"].sum(-1)
    assert lengths[0] == 0 and lengths[1] == 1 and lengths.max() == T
    assert not n["m"][:, 0].all() and not n["m"][:, -1].all()


# ----------------------------------------------------------------------------------------- importance weights


@pytest.mark.parametrize("high,low,overflow", [(2.0, 0.0, "truncate"), (1.5, 0.8, "truncate"), (None, 0.0, "truncate"),
                                               (2.0, 0.0, "mask"), (1.5, 0.8, "mask")])
def test_token_tis_weights(data, high, low, overflow):
    j, n = data
    got = jax.vmap(lambda x, mm: corrections.token_tis_weights(x, mm, high, low, overflow))(j["lr"], j["m"])
    close(got, ref.token_tis(n["lr"], n["m"], high, low, overflow))


@pytest.mark.parametrize("high,low,overflow", [(5.0, 0.0, "truncate"), (2.0, 0.9, "truncate"), (None, 0.0, "truncate"),
                                               (2.0, 0.0, "mask"), (2.0, 0.9, "mask")])
def test_sequence_tis_weights(data, high, low, overflow):
    j, n = data
    got = jax.vmap(lambda x, mm: corrections.sequence_tis_weights(x, mm, high, low, overflow))(j["lr"], j["m"])
    close(got, ref.sequence_tis(n["lr"], n["m"], high, low, overflow))


@pytest.mark.parametrize("high,low,overflow", [(None, 0.0, "truncate"), (1.05, 0.97, "truncate"), (1.05, 0.97, "mask")])
def test_geometric_sequence_weights(data, high, low, overflow):
    j, n = data
    got = jax.vmap(lambda x, mm: corrections.geometric_sequence_weights(x, mm, high, low, overflow))(j["lr"], j["m"])
    close(got, ref.geometric_weight(n["lr"], n["m"], high, low, overflow))


@pytest.mark.parametrize("low,high", [(0.5, 5.0), (0.9, 1.1)])
def test_icepop_weights(data, low, high):
    j, n = data
    got = jax.vmap(lambda x, mm: corrections.icepop_weights(x, mm, low, high))(j["lr"], j["m"])
    close(got, ref.icepop(n["lr"], n["m"], low, high))


@pytest.mark.parametrize("low,high", [(0.0, 2.0), (0.8, 1.2)])
def test_off_policy_is_weights(data, low, high):
    j, n = data
    got = jax.vmap(lambda a, b, mm: corrections.off_policy_is_weights(a, b, mm, low, high))(j["lp"], j["roll"], j["m"])
    close(got, ref.off_policy_is(n["lp"], n["roll"], n["m"], low, high))


def test_weights_clamp_extreme_log_ratios():
    lr = np.array([[30.0, -30.0, 0.5, np.nan], [25.0, 0.0, 0.0, np.inf]], np.float32)
    m = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], np.float32)
    n = np.where(m.astype(bool), lr.astype(np.float64), 0.0)
    vm = lambda f: jax.vmap(f)(lr, m)  # noqa: E731
    close(vm(lambda x, mm: corrections.token_tis_weights(x, mm, high=None)), ref.token_tis(n, m, high=None), rtol=2e-6)
    close(vm(lambda x, mm: corrections.sequence_tis_weights(x, mm, high=None)), ref.sequence_tis(n, m, high=None),
          rtol=2e-6)
    close(vm(lambda x, mm: corrections.geometric_sequence_weights(x, mm)), ref.geometric_weight(n, m), rtol=2e-6)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_batch_normalize_weights(data, level):
    j, n = data
    w = ref.token_tis(n["lr"], n["m"], 2.0) if level == "token" else ref.sequence_tis(n["lr"], n["m"], 2.0)
    got = corrections.batch_normalize_weights(dirty(w, n["m"]), n["m"], level)
    close(got, ref.batch_normalize(w, n["m"], level), where=n["m"])
    # A batch whose mean weight is <= 1e-8 is returned unchanged.
    zeros = np.zeros((B, T), np.float32)
    close(corrections.batch_normalize_weights(zeros, n["m"], level), zeros)


# ------------------------------------------------------------------------------------------- rejection masks


@pytest.mark.parametrize("low,high", [(0.8, 1.25), (None, 1.25), (0.8, None), (0.5, 2.0)])
def test_token_mask(data, low, high):
    j, n = data
    got = jax.vmap(lambda x, mm: corrections.token_mask(x, mm, low, high))(j["lr"], j["m"])
    same(got, ref.token_keep(n["lr"], low, high), where=n["m"])


@pytest.mark.parametrize("low,high", [(1e-4, 100.0), (None, 100.0), (1e-4, None), (0.5, 2.0)])
def test_outlier_sequence_mask(data, low, high):
    j, n = data
    got = jax.vmap(lambda x, mm: corrections.outlier_sequence_mask(x, mm, low, high))(j["lr"], j["m"])
    want = ref.outlier_keep(n["lr"], n["m"], low, high)
    same(got, want, where=ref.rows_valid(n["m"])[:, None])
    assert not want.all() and want[ref.rows_valid(n["m"])].any()


DIVERGENCE_CASES = [
    ("token_k1", 0.8, 1.25), ("token_k1", None, 1.1), ("seq_sum_k1", 0.5, 2.0), ("seq_sum_k1", 0.9, None),
    ("seq_mean_k1", 0.999, 1.001), ("seq_mean_k1", 0.99, 1.01), ("seq_mean_k1", None, 1.001),
    ("token_k2", None, 0.02), ("seq_sum_k2", None, 0.05), ("seq_mean_k2", None, 0.005), ("seq_max_k2", None, 0.05),
    ("token_k3", None, 0.02), ("seq_sum_k3", None, 0.05), ("seq_mean_k3", None, 0.01), ("seq_max_k3", None, 0.05),
]


@pytest.mark.parametrize("rule,low,high", DIVERGENCE_CASES)
def test_divergence_mask(data, rule, low, high):
    j, n = data
    got = jax.vmap(lambda x, mm: corrections.divergence_mask(x, mm, rule, low, high))(j["lr"], j["m"])
    want = ref.divergence_keep(n["lr"], n["m"], rule, low, high)
    if rule.startswith("token"):
        where = n["m"]
    else:  # a sequence decision covers every position of a non-empty row
        where = np.broadcast_to(ref.rows_valid(n["m"])[:, None], (B, T))
    same(got, want, where=where, what=rule)
    assert want[n["m"]].any() and not want[n["m"]].all(), "the data should split the valid tokens"


@pytest.mark.parametrize("fn,rule,bounds", [
    (corrections.geometric_sequence_mask, "seq_mean_k1", (0.999, 1.001)),
    (corrections.geometric_sequence_mask, "seq_mean_k1", (0.99, 1.01)),
    (corrections.product_sequence_mask, "seq_sum_k1", (0.5, 2.0)),
])
def test_geometric_and_product_masks(data, fn, rule, bounds):
    j, n = data
    got = jax.vmap(lambda x, mm: fn(x, mm, *bounds))(j["lr"], j["m"])
    same(got, ref.divergence_keep(n["lr"], n["m"], rule, *bounds), where=ref.rows_valid(n["m"])[:, None])


@pytest.mark.parametrize("delta", [1e-4, 0.05])
def test_opsm_mask(data, delta):
    j, n = data
    adv = np.array([-1.0, -1.0, -0.5, 0.5, -1.0, -1.0, 1.0, -0.3])[:, None] + 0.1 * n["adv_tok"]
    got = jax.vmap(lambda a, b, c, mm: corrections.opsm_mask(a, b, c, mm, delta))(
        j["lp"], j["old"], dirty(adv, n["m"]), j["m"])
    want = ref.opsm_keep(n["lp"], n["old"], adv, n["m"], delta)
    same(got, want, where=ref.rows_valid(n["m"])[:, None])


# ------------------------------------------------------------------------------------------------ objectives


def objective_inputs(data, spread=1.0):
    """lp and old with log-ratios up to ~2 (so every clip branch fires), per-token advantages."""
    j, n = data
    old = n["old"]
    lp = old + spread * (n["lp"] - n["old"]) * 3.0
    return (dirty(lp, n["m"]), j["old"], j["adv_tok"]), (as64(np.where(n["m"], lp, 0.0)), old, n["adv_tok"]), n["m"]


@pytest.mark.parametrize("clip_low,clip_high,dual", [(0.2, 0.2, None), (0.2, 0.28, None), (0.2, 0.2, 3.0),
                                                     (0.1, 0.3, 1.5)])
def test_ppo_clip_loss(data, clip_low, clip_high, dual):
    (lp, old, adv), (nlp, nold, nadv), m = objective_inputs(data, spread=2.0)
    loss, aux = corrections.ppo_clip_loss(lp, old, adv, clip_low, clip_high, dual)
    want, clipfrac, lower, ppo_kl = ref.ppo(nlp, nold, nadv, clip_low, clip_high, dual)
    close(loss, want, where=m)
    close(aux["pg_clipfrac"], clipfrac, where=m)
    close(aux["ppo_kl"], ppo_kl, where=m)
    assert 0 < clipfrac[m.astype(bool)].mean() < 1
    if dual is None:
        assert "pg_clipfrac_lower" not in aux
    else:
        close(aux["pg_clipfrac_lower"], lower, where=m)
        assert lower[m.astype(bool)].any()


@pytest.mark.parametrize("clip_low,clip_high", [(1.0, 4.0), (0.2, 0.28)])
def test_cispo_loss(data, clip_low, clip_high):
    (lp, old, adv), (nlp, nold, nadv), m = objective_inputs(data, spread=2.0)
    loss, aux = corrections.cispo_loss(lp, old, adv, clip_low, clip_high)
    want, clipfrac, ppo_kl = ref.cispo(nlp, nold, nadv, clip_low, clip_high)
    close(loss, want, where=m)
    close(aux["pg_clipfrac"], clipfrac, where=m)
    close(aux["ppo_kl"], ppo_kl, where=m)


def test_cispo_gradient_treats_the_clipped_ratio_as_constant(data):
    (lp, old, adv), (nlp, nold, nadv), m = objective_inputs(data, spread=2.0)
    lp = np.where(m.astype(bool), lp, 0.0).astype(np.float32)
    grad = jax.grad(lambda x: jnp.sum(jnp.where(m > 0, corrections.cispo_loss(x, old, adv)[0], 0.0)))(lp)
    r = np.exp(ref.clamp(as64(lp) - nold))
    close(grad, np.where(m.astype(bool), -np.clip(r, 0.0, 5.0) * nadv, 0.0), where=m)


@pytest.mark.parametrize("tau_pos,tau_neg", [(1.0, 1.05), (2.0, 0.5)])
def test_sapo_loss(data, tau_pos, tau_neg):
    (lp, old, adv), (nlp, nold, nadv), m = objective_inputs(data, spread=2.0)
    loss, aux = corrections.sapo_loss(lp, old, adv, tau_pos, tau_neg)
    want, ppo_kl = ref.sapo(nlp, nold, nadv, tau_pos, tau_neg)
    close(loss, want, where=m)
    close(aux["ppo_kl"], ppo_kl, where=m)


def test_reinforce_and_cross_entropy(data):
    (lp, _, adv), (nlp, _, nadv), m = objective_inputs(data)
    close(corrections.reinforce_loss(lp, adv)[0], ref.reinforce(nlp, nadv), where=m)
    close(corrections.cross_entropy_loss(lp)[0], ref.cross_entropy(nlp), where=m)


@pytest.mark.parametrize("clip_low,clip_high", [(0.2, 0.2), (0.1, 0.3)])
def test_rollout_is_loss(data, clip_low, clip_high):
    j, n = data
    m = n["m"]
    loss, aux = corrections.rollout_is_loss(j["lp"], j["roll"], j["adv_tok"], clip_low, clip_high)
    want, outside = ref.rollout_is(n["lp"], n["roll"], n["adv_tok"], clip_low, clip_high)
    close(loss, want, where=m)
    close(aux["pg_clipfrac"], outside, where=m)
    assert 0 < outside[m].mean() < 1


def _gspo(lp, old, adv, m, clip_low=3e-4, clip_high=4e-4, cap=10.0):
    return jax.vmap(corrections.gspo_loss, in_axes=(0, 0, 0, 0, None, None, None))(
        lp, old, adv, m, clip_low, clip_high, cap)


@pytest.mark.parametrize("clip_low,clip_high", [(3e-4, 4e-4), (0.05, 0.05)])
def test_gspo_value_and_gradient(data, clip_low, clip_high):
    j, n = data
    m = n["m"]
    # Advantages: sequence-level for some rows, per token for others (GSPO accepts both).
    adv = np.where(np.arange(B)[:, None] % 2 == 0, n["adv"][:, None], n["adv_tok"])
    loss, aux = _gspo(j["lp"], j["old"], dirty(adv, m), j["m"], clip_low, clip_high)
    want, grad, clipfrac = ref.gspo(n["lp"], n["old"], adv, m, clip_low, clip_high)
    close(loss, want, where=m)
    close(aux["pg_clipfrac"], clipfrac, where=m)
    close(aux["ppo_kl"], -ref.clamp(n["lp"] - n["old"]), where=m)
    assert 0 < clipfrac[m].mean() < 1

    def total(lp):
        out, _ = _gspo(lp, j["old"], dirty(adv, m), j["m"], clip_low, clip_high)
        return jnp.sum(jnp.where(m, out, 0.0))

    got = jax.grad(total)(np.where(m, j["lp"], 0.0).astype(np.float32))
    close(got, grad, where=m)


def test_gspo_log_ratio_cap():
    m = np.array([[1, 1, 1, 0]], np.float32)
    old = np.zeros((1, 4), np.float32)
    lp = np.array([[11.0, 12.0, 13.0, 0.0]], np.float32)
    adv = -np.ones((1, 4), np.float32)
    loss, _ = _gspo(lp, old, adv, m)
    want, grad, _ = ref.gspo(lp, old, adv, m)
    close(loss, want, where=m)
    close(jax.grad(lambda x: jnp.sum(_gspo(x, old, adv, m)[0] * m))(lp), grad, where=m)


def cov_inputs(data):
    j, n = data
    m = n["m"]
    rng = np.random.default_rng(7)
    adv = rng.normal(0.0, 2.0, (B, T))
    lp = n["old"] + rng.normal(0.0, 0.2, (B, T))
    return (dirty(lp, m), j["old"], dirty(adv, m)), (as64(np.where(m, lp, 0.0)), n["old"], as64(np.where(m, adv,
                                                                                                         0.0))), m


@pytest.mark.parametrize("ratio", [0.05, 0.2, 1.0, 0.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_clip_cov_loss(data, ratio, seed):
    (lp, old, adv), (nlp, nold, nadv), m = cov_inputs(data)
    loss, aux = corrections.clip_cov_loss(lp, old, adv, m, jax.random.key(seed), clip_cov_ratio=ratio)
    cut = np.asarray(aux["pg_clipfrac"]).astype(bool)
    eligible = ref.clip_cov_eligible(nlp, nold, nadv, m)
    assert 3 <= eligible.sum() < m.sum() * 0.2 + 1, "the data should make a few tokens eligible"
    assert not (cut & ~eligible).any(), "only eligible tokens may be cut"
    assert cut.sum() == ref.clip_cov_count(m, eligible, ratio)
    ppo_loss, *_ = ref.ppo(nlp, nold, nadv)
    close(loss, np.where(cut, 0.0, ppo_loss), where=m)
    close(aux["ppo_kl"], -ref.clamp(nlp - nold), where=m)


@pytest.mark.parametrize("ratio,coef", [(2e-3, 1.0), (0.1, 0.5), (0.5, 2.0)])
def test_kl_cov_loss(data, ratio, coef):
    (lp, old, adv), (nlp, nold, nadv), m = cov_inputs(data)
    loss, aux = corrections.kl_cov_loss(lp, old, adv, m, ratio, coef)
    want, chosen = ref.kl_cov(nlp, nold, nadv, m, ratio, coef)
    same(aux["pg_clipfrac"], chosen, where=m)
    assert chosen.sum() == max(1, math.floor(m.sum() * ratio))
    close(loss, want, where=m)
    close(aux["ppo_kl"], np.abs(ref.clamp(nlp - nold)), where=m)  # verl's kl-cov ppo_kl: |lp - old|


# ------------------------------------------------------------------------------------------------ reductions


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                  "seq-mean-token-sum-norm", "token-sum"])
@pytest.mark.parametrize("denominator", ["original", "kept", "none"])
def test_loss_terms_and_reduce_loss(data, mode, denominator):
    j, n = data
    m = n["m"]
    loss = n["adv_tok"] * n["lp"]
    keep = m & ref.divergence_keep(n["lr"], m, "seq_mean_k1", 0.99, 1.01) & ref.token_keep(n["lr"], 0.8, 1.25)
    keep[2] = False  # a whole row rejected: counted by "original", not by "kept"
    den = {"original": m, "kept": keep, "none": None}[denominator]
    want_num, want_den = ref.reduction_terms(loss, keep, keep if den is None else den, mode)
    num, den_ = corrections.loss_terms(dirty(loss, keep), keep, den, mode)
    close(num, want_num, what="numerator")
    close(den_, want_den, what="denominator")
    close(corrections.reduce_loss(dirty(loss, keep), keep, den, mode),
          ref.reduce(loss, keep, keep if den is None else den, mode))
    if mode == "seq-mean-token-sum-norm":
        close(corrections.reduce_loss(dirty(loss, keep), keep, den, mode, max_len=20),
              ref.reduce(loss, keep, keep if den is None else den, mode, max_len=20))


def test_reduce_loss_of_an_empty_batch_is_zero():
    z = np.zeros((2, 3), np.float32)
    for mode in ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum"]:
        assert float(corrections.reduce_loss(np.full((2, 3), np.nan, np.float32), z, mode=mode)) == 0.0


# ------------------------------------------------------------------------------------------------ advantages


REWARDS = np.array([1.0, 0.0, 1.0, 1.0, 0.3, 0.3, 0.3, 0.3, 2.0, -1.0, 0.5, 0.25, 0.0, 0.0, 0.0, 1.0], np.float32)


@pytest.mark.parametrize("group_size", [1, 2, 4, 8])
def test_group_advantages(group_size):
    r = as64(REWARDS)
    close(corrections.grpo_advantages(REWARDS, group_size), ref.grpo(r, group_size), what="grpo")
    close(corrections.grpo_advantages(REWARDS, group_size, normalize_std=False), ref.grpo(r, group_size, False),
          what="grpo no std")
    close(corrections.dr_grpo_advantages(REWARDS, group_size), ref.dr_grpo(r, group_size), what="dr_grpo")
    close(corrections.rloo_advantages(REWARDS, group_size), ref.rloo(r, group_size), what="rloo")


@pytest.mark.parametrize("normalize_std", [True, False])
def test_group_advantages_over_the_scored_samples_alone(normalize_std):
    """A group's mean and std are over its scored samples (a failed one's reward, here NaN or huge, is ignored); an
    unscored sample, and every sample of a group with one scored, gets 0; all scored is plain GRPO."""
    scored = np.array([1, 1, 1, 1, 1, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0], bool)  # groups of 4 with 4, 2, 1, 0 scored
    rewards = np.where(scored, REWARDS[::-1], np.float32(np.nan))
    rewards[7] = 1e30  # unscored: ignored as a NaN is
    want = ref.grpo(as64(REWARDS[::-1]), 4, normalize_std, scored=scored)
    close(corrections.grpo_advantages(rewards, 4, normalize_std, scored=scored), want, what="grpo scored")
    assert want[4:6].tolist() != [0.0, 0.0] and not want[~scored].any() and not want[8:].any()
    close(corrections.grpo_advantages(REWARDS, 4, normalize_std, scored=np.ones(16, bool)),
          ref.grpo(as64(REWARDS), 4, normalize_std), what="grpo all scored")


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_advantages(data, gamma):
    j, n = data
    m = n["m"]
    rewards = np.zeros((B, T))
    rng = np.random.default_rng(3)
    rewards[m] = rng.normal(0.0, 0.3, m.sum())
    got = corrections.reinforce_pp_advantages(dirty(rewards, m), m, gamma)
    close(got, ref.reinforce_pp(as64(np.float32(rewards)), m, gamma), atol=1e-5)


def test_broadcast_to_tokens(data):
    _, n = data
    close(corrections.broadcast_to_tokens(np.float32(n["adv"]), n["m"]), ref.broadcast_rows(n["adv"], n["m"]))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_penalty(data, estimator):
    j, n = data
    m = n["m"].copy()
    lp, rf = n["lp"].copy(), n["ref"].copy()
    rf[2, :2] = lp[2, :2] + np.array([25.0, -25.0])  # beyond the [-20, 20] clamp
    got = corrections.kl_penalty(dirty(lp, m), dirty(rf, m), estimator)
    want = ref.kl_estimate(as64(np.float32(lp)), as64(np.float32(rf)), estimator)
    close(got, want, where=m, rtol=1e-5, atol=2e-6)
    if estimator == "low_var_kl":
        assert (want[m] == 10.0).any()


# ----------------------------------------------------------------------------------------------- diagnostics


def close_dict(got, want, rtol=RTOL, atol=ATOL, keys=None):
    keys = sorted(want) if keys is None else keys
    bad = []
    for k in keys:
        g, w = float(got[k]), float(want[k])
        if not (math.isfinite(g) and abs(g - w) <= atol + rtol * abs(w)):
            bad.append(f"{k}: got {g!r}, want {w!r}")
    assert not bad, "\n".join(bad)


def test_mismatch_metrics(data):
    j, n = data
    got = corrections.mismatch_metrics(j["old"], j["roll"], j["m"])
    want = ref.mismatch(n["old"], n["roll"], n["m"])
    assert set(got) == set(want)
    close_dict(got, want)


def test_mismatch_metrics_of_an_empty_batch_are_zero(data):
    j, _ = data
    z = np.zeros((B, T), np.float32)
    got = corrections.mismatch_metrics(j["old"], j["roll"], z)
    close_dict(got, ref.mismatch(np.zeros((B, T)), np.zeros((B, T)), z))
    assert all(float(v) == 0.0 for v in got.values())


@pytest.mark.parametrize("cap", [2.0, 1.1])
def test_weight_metrics_and_ess(data, cap):
    j, n = data
    m = n["m"]
    w = ref.token_tis(n["lr"], m, cap)
    raw = ref.token_tis(n["lr"], m, None)
    got = corrections.weight_metrics(dirty(w, m), dirty(raw, m), m, cap)
    want = ref.weight_stats(w, raw, m, cap)
    assert set(got) == set(want)
    close_dict(got, want)
    close(corrections.effective_sample_size(dirty(w, m), m), ref.ess(w, m))
    close(corrections.effective_sample_size(np.zeros((B, T), np.float32), m), 0.0)


@pytest.mark.parametrize("rule,low,high", [("seq_mean_k1", 0.999, 1.001), ("token_k1", 0.8, 1.25),
                                           ("seq_mean_k3", None, 0.01)])
def test_rejection_metrics(data, rule, low, high):
    _, n = data
    keep = ref.divergence_keep(n["lr"], n["m"], rule, low, high)
    got = corrections.rejection_metrics(rule, keep, n["m"])
    want = ref.rejection_stats(rule, keep, n["m"])
    assert set(got) == set(want)
    close_dict(got, want)


def test_staleness_metrics(data):
    _, n = data
    m = n["m"]
    close_dict(corrections.staleness_metrics(n["lag"], m), ref.staleness(n["lag"], m))
    per_seq = np.array([3, 1, 4, 1, 5, 9, 2, 6])
    close_dict(corrections.staleness_metrics(per_seq, m), ref.staleness(per_seq, m))


# ------------------------------------------------------------------------------------- compute: every preset


def check_compute(cfg, data, **extra):
    """compute() on the garbage-padded batch vs ``ref.pipeline`` on the clean one: outputs and every metric."""
    j, n = data
    out = corrections.compute(j["lp"], j["adv"], j["m"], cfg, proximal_logprobs=j["old"],
                              rollout_logprobs=j["roll"], policy_lag=n["lag"],
                              **{k: j[v] for k, v in extra.items()})
    want = ref.pipeline(corrections.config_to_dict(cfg), n["lp"], n["adv"], n["m"], n["old"], n["roll"],
                        policy_lag=n["lag"], **{k.replace("_logprobs", ""): n[v] for k, v in extra.items()})
    same(out.mask, want["mask"], what="final mask")
    close(out.weights, want["weights"], what="weights")
    close(out.per_token_loss, want["per_token_loss"], what="per-token loss")
    close(out.loss, want["loss"], what="loss")
    close(out.loss_numerator, want["numerator"], what="numerator")
    close(out.loss_denominator, want["denominator"], what="denominator")
    missing = set(want["metrics"]) - set(out.metrics)
    assert not missing, f"metrics missing: {sorted(missing)}"
    close_dict(out.metrics, want["metrics"])
    return out, want


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", sorted(corrections.PRESETS))
def test_compute_preset(name, seed):
    _, want = check_compute(corrections.preset(name), batch(seed))
    assert want["mask"].astype(bool).any(), "every preset should keep some tokens of this batch"


def _per_sequence(cfg):
    """Whether every output of a row depends on that row alone (no batch normalisation, no batch objective)."""
    normalized = cfg.importance is not None and cfg.importance.batch_normalize
    return not normalized and cfg.objective.name not in ("clip_cov", "kl_cov")


@pytest.mark.parametrize("name", sorted(n for n in corrections.PRESETS if _per_sequence(corrections.preset(n))))
@pytest.mark.slow  # 64 s on a quiet 2-core run: out of the default run's 15 minutes
def test_row_stats_of_parts_give_the_whole_batch_metrics(data, name):
    """Three uneven row blocks (as a learner's micro-batches), their row statistics concatenated: the metrics of
    the whole batch (float64 reference), maxima and moments included."""
    j, n = data
    cfg = corrections.preset(name)
    parts = [slice(0, 3), slice(3, 4), slice(4, B)]
    row_stats = [corrections.compute(j["lp"][p], j["adv"][p], j["m"][p], cfg, proximal_logprobs=j["old"][p],
                                     rollout_logprobs=j["roll"][p], policy_lag=n["lag"][p]).row_stats
                 for p in parts]
    combined = corrections.metrics_from_row_stats(jax.tree.map(lambda *r: jnp.concatenate(r), *row_stats), cfg)
    want = ref.pipeline(corrections.config_to_dict(cfg), n["lp"], n["adv"], n["m"], n["old"], n["roll"],
                        policy_lag=n["lag"])["metrics"]
    assert set(combined) == set(want) - {"actor/pg_loss"}
    close_dict(combined, want, keys=sorted(combined))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_weight_scale_normalises_parts_like_the_whole_batch(data, level):
    """Parts given the whole batch's ``weight_scale`` get the whole batch's weights, losses and weight metrics."""
    j, n = data
    cfg = CorrectionConfig(importance=ImportanceWeights(level, high=5.0, batch_normalize=True))
    run = lambda p, **kw: corrections.compute(j["lp"][p], j["adv"][p], j["m"][p], cfg,  # noqa: E731
                                              proximal_logprobs=j["old"][p], rollout_logprobs=j["roll"][p], **kw)
    whole = run(slice(None))
    want = ref.pipeline(corrections.config_to_dict(cfg), n["lp"], n["adv"], n["m"], n["old"], n["roll"])
    close(whole.weights, want["weights"])
    assert abs(float(whole.weight_scale) - 1.0) > 1e-3  # the batch is not already normalised
    parts = [run(p, weight_scale=whole.weight_scale) for p in (slice(0, 5), slice(5, B))]
    for field in ("weights", "per_token_loss", "mask"):
        same(np.concatenate([getattr(p, field) for p in parts]), getattr(whole, field), what=field)
    combined = corrections.metrics_from_row_stats(jax.tree.map(lambda *r: jnp.concatenate(r),
                                                               *[p.row_stats for p in parts]), cfg)
    close_dict(combined, want["metrics"], keys=sorted(combined))
    with pytest.raises(ValueError, match="weight_scale is only used by importance.batch_normalize"):
        corrections.compute(j["lp"], j["adv"], j["m"], CorrectionConfig(), proximal_logprobs=j["old"],
                            weight_scale=2.0)


EXTRA_CONFIGS = {
    "gspo_seq_mean": CorrectionConfig(objective=Objective("gspo", clip_low=0.05, clip_high=0.05),
                                      reduction="seq-mean-token-mean",
                                      importance=ImportanceWeights("geometric", high=1.05, low=0.9)),
    "sapo_kl_entropy": CorrectionConfig(objective=Objective("sapo"), kl_coef=0.1, kl_estimator="k3",
                                        entropy_coef=0.01, importance=ImportanceWeights("token", high=1.5)),
    "rollout_is_batch_norm": CorrectionConfig(
        objective=Objective("rollout_is"), importance=ImportanceWeights("sequence", high=5.0, batch_normalize=True),
        reduction="seq-mean-token-sum-norm"),
    "token_batch_norm_mask": CorrectionConfig(
        importance=ImportanceWeights("token", high=1.5, low=0.7, overflow="mask", batch_normalize=True),
        reduction="seq-mean-token-sum"),
    "kl_cov": CorrectionConfig(objective=Objective("kl_cov", kl_cov_ratio=0.1), kl_coef=0.05,
                               kl_estimator="low_var_kl"),
    "cross_entropy_token_sum": CorrectionConfig(objective=Objective("cross_entropy"), reduction="token-sum",
                                                rejection=(RejectionRule("seq_max_k2", high=0.05),)),
    "cispo_everything": CorrectionConfig(
        objective=Objective("cispo", clip_low=1.0, clip_high=4.0), opsm_delta=1e-4, denominator="kept",
        importance=ImportanceWeights("sequence", high=3.0),
        rejection=(RejectionRule("seq_mean_k3", high=0.01), RejectionRule("outlier", 1e-4, 100.0),
                   RejectionRule("token", 0.5, 2.0), RejectionRule("seq_sum_k1", 0.3, 3.0))),
    "duplicate_rules_bypass": CorrectionConfig(
        mode="bypass", objective=Objective("ppo", dual_clip=3.0), reduction="seq-mean-token-mean",
        rejection=(RejectionRule("token_k2", high=0.05), RejectionRule("token_k2", high=0.02),
                   RejectionRule("seq_max_k3", high=0.05))),
}


@pytest.mark.parametrize("name", sorted(EXTRA_CONFIGS))
def test_compute_extra_configs(data, name):
    check_compute(EXTRA_CONFIGS[name], data, ref_logprobs="ref", entropy="entropy")


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_compute_ratio_fractions_count_rejected_tokens_by_their_ratio(data, level):
    """Diagnostics are on the original mask (spec section 6): a token vetoed by an outlier rule (row 6 holds a
    ratio of 403) still has its ratio, so it counts in ``rollout_is_ratio_fraction_high``, not ``_low``."""
    cfg = CorrectionConfig(importance=ImportanceWeights(level, high=2.0),
                           rejection=(RejectionRule("outlier", 1e-4, 100.0), RejectionRule("token", 0.5, 2.0)))
    j, n = data
    out = corrections.compute(j["lp"], j["adv"], j["m"], cfg, proximal_logprobs=j["old"], rollout_logprobs=j["roll"])
    want = ref.pipeline(corrections.config_to_dict(cfg), n["lp"], n["adv"], n["m"], n["old"], n["roll"])
    keys = [ref.P + "rollout_is_ratio_fraction_high", ref.P + "rollout_is_ratio_fraction_low"]
    close_dict(out.metrics, want["metrics"], keys=keys)


# One preset per objective / mode / weight level (jit(grad) costs ~1-2 s of compilation each).
GRADIENT_PRESETS = ["decoupled_token_is", "bypass_ppo_clip", "bypass_pg_geo_rs_seq_tis", "skyrl_cispo",
                    "skyrl_rollout_is"]


@pytest.mark.parametrize("name", GRADIENT_PRESETS)
def test_compute_preset_gradient(data, name):
    """d loss / d lp: the objective's derivative times constant (stop-gradient) weights, over the reduction."""
    j, n = data
    cfg = corrections.preset(name)

    def loss(lp):
        return corrections.compute(lp, j["adv"], j["m"], cfg, proximal_logprobs=j["old"],
                                   rollout_logprobs=j["roll"]).loss

    got = jax.jit(jax.grad(loss))(j["lp"])
    want = ref.pipeline_grad(corrections.config_to_dict(cfg), n["lp"], n["adv"], n["m"], n["old"], n["roll"])
    close(got, want, what="d loss / d lp")


def test_bounds_are_inclusive_or_strict_as_specified():
    """Exact boundaries (rho = 1 exactly, lr = 0): token mask, IcePop and k1 rules are inclusive, the outlier
    veto and rollout IS window are strict."""
    lr = np.zeros((1, 3), np.float32)
    m = np.ones((1, 3), np.float32)
    assert np.asarray(jax.vmap(lambda x, mm: corrections.token_mask(x, mm, 1.0, 1.0))(lr, m)).all()
    np.testing.assert_array_equal(jax.vmap(lambda x, mm: corrections.icepop_weights(x, mm, 1.0, 1.0))(lr, m), m)
    assert np.asarray(jax.vmap(lambda x, mm: corrections.outlier_sequence_mask(x, mm, 1.0, 1.0))(lr, m)).all()
    half = np.array([[0.5, -0.5, 0.0]], np.float32)
    for rule in ("seq_mean_k1", "seq_sum_k1"):
        keep = jax.vmap(lambda x, mm: corrections.divergence_mask(x, mm, rule, 1.0, 1.0))(half, m)  # noqa: B023
        assert np.asarray(keep).all(), rule
    _, aux = corrections.rollout_is_loss(lr, lr, m, clip_low=0.0, clip_high=0.5)
    np.testing.assert_array_equal(aux["pg_clipfrac"], m)  # r = 1 is not inside (1 - 0, 1.5): strict
    w = jax.vmap(lambda x, mm: corrections.token_tis_weights(x, mm, 1.0, 1.0, "mask"))(lr, m)
    np.testing.assert_array_equal(w, m)


@pytest.mark.parametrize("rows_per_chunk", [3, 0])
def test_compute_under_jit_matches_the_reference(data, rows_per_chunk):
    """The jitted path (rows walked in chunks of 3 with a remainder, or one vmap) gives the same numbers."""
    j, n = data
    cfg = corrections.preset("decoupled_geo_rs_seq_tis")
    fn = jax.jit(lambda lp, adv, m, old, roll: corrections.compute(
        lp, adv, m, cfg, proximal_logprobs=old, rollout_logprobs=roll, rows_per_chunk=rows_per_chunk))
    out = fn(j["lp"], j["adv"], j["m"], j["old"], j["roll"])
    want = ref.pipeline(corrections.config_to_dict(cfg), n["lp"], n["adv"], n["m"], n["old"], n["roll"])
    same(out.mask, want["mask"])
    close(out.weights, want["weights"])
    close(out.per_token_loss, want["per_token_loss"])
    close(out.loss, want["loss"])
    close_dict(out.metrics, want["metrics"])


def test_masked_reductions_and_safe_exp(data):
    j, n = data
    assert corrections.SAFETY == ref.SAFETY
    close(corrections.masked_sum(j["lp"], j["m"]), ref.msum(n["lp"], n["m"]))
    close(corrections.masked_mean(j["lp"], j["m"]), ref.mmean(n["lp"], n["m"]))
    close(corrections.masked_sum(j["lp"], j["m"], axis=-1), ref.row_sum(n["lp"], n["m"]))
    close(corrections.masked_mean(j["lp"], j["m"], axis=-1), ref.row_mean(n["lp"], n["m"]))
    x = np.array([-50.0, -20.0, -3.0, 0.0, 3.0, 20.0, 50.0], np.float32)
    close(corrections.safe_exp(x), ref.sexp(x), rtol=2e-6)


@pytest.mark.parametrize("rule,threshold", [("token_k1", "0.8_1.6"), ("seq_mean_k1", "0.999_1.002"),
                                            ("seq_sum_k1", "0.6_1.5")])
def test_verl_inverted_k1_bounds_are_reproduced(data, rule, threshold):
    """Spec section 2: verl keeps ``log(lo) <= -stat <= log(up)`` (i.e. 1/up <= rho <= 1/lo); passing
    (1/up, 1/lo), as ``verl_rejection_rules(reproduce_inverted_k1=True)`` does, reproduces verl's mask."""
    j, n = data
    lo, up = (float(x) for x in threshold.split("_"))
    (r,) = corrections.verl_rejection_rules(rule, threshold, reproduce_inverted_k1=True)
    got = jax.vmap(lambda x, mm: corrections.divergence_mask(x, mm, r.name, r.low, r.high))(j["lr"], j["m"])
    k1 = ref.clamp(n["lr"])  # verl's k1 is -l; the statistic below is l, aggregated
    if rule == "token_k1":
        stat = k1
    else:
        agg = ref.row_sum(k1, n["m"]) if rule == "seq_sum_k1" else ref.row_mean(k1, n["m"])
        stat = np.broadcast_to(agg[:, None], k1.shape)
    verl_keep = (math.log(lo) <= -stat) & (-stat <= math.log(up))
    where = n["m"] if rule == "token_k1" else np.broadcast_to(ref.rows_valid(n["m"])[:, None], (B, T))
    same(got, verl_keep, where=where)
    assert verl_keep[n["m"]].any() and not verl_keep[n["m"]].all()
