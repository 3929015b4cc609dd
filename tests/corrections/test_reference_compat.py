"""Compatibility with the reference frameworks: configured alike, ``corrections`` gives verl's, SkyRL's, slime's
and AReaL's numbers (float32 JAX vs the float64 NumPy ports in ``tests/support/reference_ports``, rtol 1e-5); where this
project deliberately differs (a reference bug or quirk), a test shows both numbers and names the setting that
reproduces the reference.

One batch shape [B, T] = [8, 12] is used throughout and ``compute`` runs eagerly: after the first call every
primitive is cached for that shape, which on CPU is much cheaper than one XLA compile per config.

The main batch has no empty row (verl counts empty rows in several per-sequence metrics; that difference has its
own test) and every row sits clearly on one side of every bound used here (float32 and float64 agree).
"""

from __future__ import annotations

import functools
import math
import types

import numpy as np
import pytest

import corrections
from corrections import CorrectionConfig, ImportanceWeights, Objective, RejectionRule
from tests.support.reference_ports import areal, skyrl, slime, verl

RTOL, ATOL = 1e-5, 1e-6
B, T = 8, 12
P = "rollout_corr/"

# (start, length, noise of old - roll, target mean of old - roll, noise of lp - old, spike in old - roll)
ROWS = [
    (0, 12, 1e-4, 2e-4, 1e-5, None),  # tiny mismatch: kept by every rule, decoupled or bypass
    (3, 1, 0.0, 3e-4, 1e-5, None),  # length 1
    (2, 8, 0.02, 5e-3, 0.1, None),  # Geo-RS rejects, k3 keeps, product keeps
    (1, 6, 0.45, -3e-4, 0.02, None),  # Geo-RS keeps, k3 rejects, token rules reject some tokens
    (0, 9, 0.05, 0.1, 0.2, None),  # product rejects (sum 0.9), k3 keeps
    (3, 9, 0.1, None, 0.1, 6.0),  # ratio 403: outlier veto (high)
    (0, 5, 0.2, None, 0.3, -10.0),  # ratio 4.5e-5: outlier veto (low)
    (0, 11, 0.3, -0.08, 0.3, None),  # product rejects (low side); dual clip binds (A < 0, one r = e^1.5)
]


def _build(seed=0, rows=ROWS):
    rng = np.random.default_rng(seed)
    b = len(rows)
    m = np.zeros((b, T), np.float32)
    lr = rng.normal(0.0, 0.3, (b, T))  # finite values at padding too: every port must ignore them
    d = rng.normal(0.0, 0.3, (b, T))
    for i, (start, length, noise, mean, dnoise, spike) in enumerate(rows):
        m[i, start : start + length] = 1
        x = rng.normal(0.0, noise, length) if length else np.zeros(0)
        if mean is not None and length:
            x = x - x.mean() + mean
        if spike is not None:
            x[length // 2] = spike
        lr[i, start : start + length] = x
        d[i, start : start + length] = rng.normal(0.0, dnoise, length) if length else 0.0
    d[7, 4] = 1.5
    roll = -rng.uniform(0.05, 3.0, (b, T))
    adv = rng.normal(0.0, 1.0, b)
    adv[[2, 5, 7]] = [0.9, -0.7, -0.8]
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    roll32 = f32(roll)
    old32 = f32(roll + lr)
    lp32 = f32(roll + lr + d)
    ref32 = f32(lp32 + rng.uniform(-4.0, 4.0, (b, T)))
    adv32 = f32(adv)
    as64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    n = dict(m=as64(m), lp=as64(lp32), old=as64(old32), roll=as64(roll32), ref=as64(ref32), adv=as64(adv32))
    n["A"] = n["adv"][:, None] * n["m"]  # token-level advantages, as the frameworks store them
    j = dict(m=m, lp=lp32, old=old32, roll=roll32, ref=ref32, adv=adv32)
    return types.SimpleNamespace(j=j, n=n)


@functools.cache
def data():
    return _build()


@functools.cache
def data_with_empty_row():
    rows = list(ROWS)
    rows[1] = (0, 0, 0.0, 0.0, 0.0, None)
    return _build(rows=rows)


# vmap the per-row pass (not lax.map): eager vmap reuses cached primitives, a scan recompiles on every call.
EAGER = {"rows_per_chunk": 0}  # one vmap, no row loop: many configs, each traced once


def run(config, d=None, advantages=None, **extra):
    d = d or data()
    j = d.j
    out = corrections.compute(j["lp"], j["adv"] if advantages is None else advantages, j["m"], config,
                              proximal_logprobs=j["old"], rollout_logprobs=j["roll"], **EAGER, **extra)
    return types.SimpleNamespace(
        weights=np.asarray(out.weights, np.float64), mask=np.asarray(out.mask, np.float64),
        per_token=np.asarray(out.per_token_loss, np.float64), loss=float(out.loss),
        numerator=float(out.loss_numerator), denominator=float(out.loss_denominator),
        metrics={k: float(v) for k, v in out.metrics.items()})


def close(got, want, where=None, rtol=RTOL, atol=ATOL, what=""):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    want = np.broadcast_to(want, got.shape) if want.ndim == 0 else want
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if where is not None:
        where = np.broadcast_to(np.asarray(where).astype(bool), got.shape)
        got, want = got[where], want[where]
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=what)


def same_mask(got, want, what="final mask"):
    np.testing.assert_array_equal(np.asarray(got).astype(bool), np.asarray(want).astype(bool), err_msg=what)


def per_token_of(loss_fn, mask):
    """Per-token loss of a port's policy-loss function: the loss under ``token-sum`` of each one-hot mask."""
    out = np.zeros(mask.shape)
    for i, t in zip(*np.nonzero(mask)):
        onehot = np.zeros(mask.shape)
        onehot[i, t] = 1.0
        out[i, t] = loss_fn(onehot, "token-sum")
    return out


def test_batch_is_what_the_tests_assume():
    n = data().n
    lengths = n["m"].sum(-1)
    assert lengths.min() >= 1 and lengths[1] == 1 and lengths.max() == T
    assert data_with_empty_row().n["m"][1].sum() == 0


# ============================================================================================ verl

MISMATCH_KEYS = ("kl", "k3_kl", "training_ppl", "rollout_ppl", "training_log_ppl", "rollout_log_ppl", "log_ppl_diff",
                 "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio", "chi2_token", "chi2_seq")
GEO, K3 = dict(rs="seq_mean_k1", rs_thr="0.999_1.001"), dict(rs="seq_mean_k3", rs_thr=0.01)
TOKEN_IS, SEQ_IS, ICEPOP = dict(rollout_is="token"), dict(rollout_is="sequence"), dict(rollout_is="token",
                                                                                        thr="0.5_5.0")
BYPASS_PG = dict(bypass=True, loss_type="reinforce")

# Each Tether preset named after verl, and the verl settings it stands for (rollout_corr presets; verl always uses
# vanilla PPO with dual clip c = 3 and token-mean over the kept mask).
VERL_PRESETS = {
    "disabled": {},
    "decoupled_token_is": TOKEN_IS,
    "decoupled_seq_is": SEQ_IS,
    "decoupled_seq_is_rs": dict(SEQ_IS, rs="seq_sum_k1", rs_thr="0.5_2.0"),
    "decoupled_geo_rs": GEO,
    "decoupled_geo_rs_token_tis": dict(GEO, **TOKEN_IS),
    "decoupled_geo_rs_seq_tis": dict(GEO, **SEQ_IS),
    "decoupled_k3_rs": K3,
    "decoupled_k3_rs_token_tis": dict(K3, **TOKEN_IS),
    "decoupled_k3_rs_seq_tis": dict(K3, **SEQ_IS),
    "decoupled_token_icepop": ICEPOP,
    "bypass_ppo_clip": dict(bypass=True),
    "bypass_ppo_clip_geo_rs": dict(GEO, bypass=True),
    "bypass_ppo_clip_k3_rs": dict(K3, bypass=True),
    "bypass_pg_is": dict(BYPASS_PG, **SEQ_IS),
    "bypass_pg_geo_rs": dict(BYPASS_PG, **GEO),
    "bypass_pg_geo_rs_token_tis": dict(BYPASS_PG, **GEO, **TOKEN_IS),
    "bypass_pg_geo_rs_seq_tis": dict(BYPASS_PG, **GEO, **SEQ_IS),
    "bypass_pg_token_icepop": dict(BYPASS_PG, **ICEPOP),
}


def verl_reference(n, rollout_is=None, thr=2.0, bn=False, rs=None, rs_thr=None, bypass=False, loss_type="ppo_clip",
                   clip_c=3.0):
    """verl's numbers: weights and mask from rollout_corr_helper, per-token and token-mean loss from core_algos."""
    trainer = n["lp"] if bypass else n["old"]  # bypass: weights / rejection from the (detached) current policy
    w, mask, metrics = verl.compute_rollout_correction_and_rejection_mask(trainer, n["roll"], n["m"], rollout_is, thr,
                                                                         bn, rs, rs_thr)
    old = n["roll"] if bypass else n["old"]
    if loss_type == "reinforce":
        def loss_fn(mm, agg):
            return verl.compute_policy_loss_reinforce(old, n["lp"], n["A"], mm, agg, rollout_is_weights=w)[0]
    else:
        pg_w = None if bypass else w  # bypass ppo_clip ignores the IS weights

        def loss_fn(mm, agg):
            return verl.compute_policy_loss_vanilla(old, n["lp"], n["A"], mm, agg, clip_ratio_c=clip_c,
                                                    rollout_is_weights=pg_w)[0]
    loss = loss_fn(mask, "token-mean")
    if bypass:  # the same through verl's own bypass entry point
        loss_b, bypass_metrics = verl.compute_policy_loss_bypass_mode(
            n["roll"], n["lp"], n["A"], n["m"], "token-mean", loss_type, rollout_is, thr, bn, rs, rs_thr,
            **({"clip_ratio_c": clip_c} if loss_type == "ppo_clip" else {}))
        assert math.isclose(loss_b, loss, rel_tol=1e-12, abs_tol=1e-12)
        assert set(metrics) <= set(bypass_metrics)
    return types.SimpleNamespace(weights=w, mask=mask, per_token=per_token_of(loss_fn, mask), loss=loss,
                                 metrics=metrics)


def compare_metrics(got, want, keys, what=""):
    for key in keys:
        assert P + key in want, f"verl has no {key}"
        assert P + key in got, f"Tether has no {key}"
        close(got[P + key], want[P + key], what=f"{what} {key}")


def check_against_verl(config, verl_kwargs, is_metrics=True, d=None):
    d = d or data()
    got, want = run(config, d), verl_reference(d.n, **verl_kwargs)
    valid = d.n["m"].astype(bool)
    same_mask(got.mask, want.mask)
    kept = want.mask.astype(bool)
    if want.weights is not None:
        close(got.weights, want.weights, where=kept, what="IS weights on kept tokens")
    close(got.per_token, want.per_token, where=valid, what="per-token loss")
    close(got.loss, want.loss, what="token-mean loss over the kept mask")
    keys = list(MISMATCH_KEYS)
    if want.weights is not None and is_metrics:
        keys += ["rollout_is_mean", "rollout_is_std", "rollout_is_eff_sample_size"]
        if verl_kwargs.get("rollout_is") == "token":  # sequence level: verl reports raw ratios (own test)
            keys += ["rollout_is_max", "rollout_is_min"]
    if P + "rollout_is_oob_ratio" in want.metrics:  # "lo_up" (IcePop) thresholds
        keys.append("rollout_is_oob_ratio")
    if verl_kwargs.get("rs"):
        keys += ["rollout_rs_masked_fraction", "rollout_rs_seq_masked_fraction"]
        # Per-rule fractions: verl's are standalone, Tether's after the earlier rules (own test): first rule only.
        rule = verl_kwargs["rs"].split(",")[0].strip()
        keys += [f"rollout_rs_{rule}_masked_fraction", f"rollout_rs_{rule}_seq_masked_fraction"]
    compare_metrics(got.metrics, want.metrics, keys)
    return got, want


def test_every_verl_preset_is_listed():
    verl_names = {name for name in corrections.PRESETS
                  if name == "disabled" or name.startswith(("decoupled_", "bypass_"))}
    assert verl_names == set(VERL_PRESETS)


@pytest.mark.parametrize("name", sorted(VERL_PRESETS))
def test_verl_preset_matches_verl(name):
    got, want = check_against_verl(corrections.preset(name), VERL_PRESETS[name])
    kwargs = VERL_PRESETS[name]
    if kwargs.get("rs"):  # the rule does something on this batch
        assert 0 < want.mask.sum() < data().n["m"].sum()


def test_the_batch_makes_dual_clip_bind():
    """The ``disabled`` comparison above is only meaningful if verl's dual clip changes a number here."""
    n = data().n
    with_c = verl_reference(n).per_token
    without = per_token_of(lambda mm, agg: verl.compute_policy_loss_vanilla(
        n["old"], n["lp"], n["A"], mm, agg, clip_ratio_c=1e9)[0], n["m"])
    assert not np.allclose(with_c, without)


FROM_VERL = {
    "token_tis_comma_rules": (
        dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1,seq_max_k3",
             rollout_rs_threshold="0.999_1.001,0.05"),
        dict(rollout_is="token", thr=2.0, rs="seq_mean_k1,seq_max_k3", rs_thr="0.999_1.001,0.05")),
    "seq_tis_bare_string_and_bare_float_k1": (
        dict(rollout_is="sequence", rollout_is_threshold="3.0", rollout_rs="seq_sum_k1", rollout_rs_threshold=2.0),
        dict(rollout_is="sequence", thr="3.0", rs="seq_sum_k1", rs_thr=2.0)),
    "icepop_duplicate_rules": (
        dict(rollout_is="token", rollout_is_threshold="0.5_5.0", rollout_rs="seq_mean_k3, seq_mean_k3",
             rollout_rs_threshold="0.01"),
        dict(rollout_is="token", thr="0.5_5.0", rs="seq_mean_k3, seq_mean_k3", rs_thr="0.01")),
    "one_threshold_for_two_k2_rules": (
        dict(rollout_is="token", rollout_is_threshold=1.5, rollout_rs="seq_max_k2,seq_mean_k2",
             rollout_rs_threshold=0.05),
        dict(rollout_is="token", thr=1.5, rs="seq_max_k2,seq_mean_k2", rs_thr=0.05)),
    "bypass_reinforce_token_tis_seq_sum_k3": (
        dict(bypass_mode=True, loss_type="reinforce", rollout_is="token", rollout_is_threshold=1.5,
             rollout_rs="seq_sum_k3", rollout_rs_threshold=0.05),
        dict(bypass=True, loss_type="reinforce", rollout_is="token", thr=1.5, rs="seq_sum_k3", rs_thr=0.05)),
    "bypass_ppo_geo_bare_float": (
        dict(bypass_mode=True, rollout_rs="seq_mean_k1", rollout_rs_threshold="1.002"),
        dict(bypass=True, rs="seq_mean_k1", rs_thr="1.002")),
}


@pytest.mark.parametrize("name", sorted(FROM_VERL))
def test_from_verl_matches_verl(name):
    ours, theirs = FROM_VERL[name]
    got, want = check_against_verl(corrections.from_verl(**ours), theirs)
    if "rs" in theirs:
        assert 0 < want.mask.sum() < data().n["m"].sum()


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_from_verl_batch_normalize_matches_verl_weights_and_loss(level):
    """verl normalises the weights AFTER its IS metrics (``rollout_is_mean`` is pre-normalisation, with the factor
    in ``rollout_is_batch_norm_factor``); so does Tether: weights, loss and the metrics agree."""
    config = corrections.from_verl(rollout_is=level, rollout_is_threshold=2.0, rollout_is_batch_normalize=True)
    got, want = check_against_verl(config, dict(rollout_is=level, thr=2.0, bn=True), is_metrics=False)
    factor = want.metrics[P + "rollout_is_batch_norm_factor"]
    assert factor != pytest.approx(1.0, abs=1e-3)
    close(got.metrics[P + "rollout_is_batch_norm_factor"], factor, what="batch_norm_factor")
    close(got.metrics[P + "rollout_is_mean"], want.metrics[P + "rollout_is_mean"], what="mean")


def test_verl_inverted_k1_bounds_reproduced_only_on_request():
    """verl checks k1 on -log(rho): "0.8_1.6" keeps 1/1.6 <= rho <= 1/0.8. ``reproduce_inverted_k1=True`` gives
    verl's masks exactly; the default keeps 0.8 <= rho <= 1.6 as written (both shown)."""
    n = data().n
    rho = np.exp(n["old"] - n["roll"])
    valid = n["m"].astype(bool)
    for rule, (lo, up) in (("token_k1", (0.8, 1.6)), ("seq_mean_k1", (1.001, 1.1))):
        theirs = dict(rs=rule, rs_thr=f"{lo}_{up}")
        want = verl_reference(n, **theirs)
        check_against_verl(corrections.from_verl(rollout_rs=rule, rollout_rs_threshold=f"{lo}_{up}",
                                                 reproduce_inverted_k1=True), theirs)
        default = run(corrections.from_verl(rollout_rs=rule, rollout_rs_threshold=f"{lo}_{up}"))
        assert not np.array_equal(default.mask.astype(bool), want.mask.astype(bool))
        stat = rho if rule == "token_k1" else np.exp((np.log(rho) * n["m"]).sum(-1) / n["m"].sum(-1))[:, None]
        stat = np.broadcast_to(stat, rho.shape)
        np.testing.assert_array_equal(default.mask.astype(bool), valid & (stat >= lo) & (stat <= up))
        np.testing.assert_array_equal(want.mask.astype(bool), valid & (stat >= 1 / up) & (stat <= 1 / lo))


def test_verl_sequence_weights_use_the_original_mask_tether_uses_survivors():
    """With a token rule and sequence IS, verl sums the log-ratio over the ORIGINAL mask, Tether (SkyRL order) over
    the tokens that survived the token rules. Same weights on rows the token rule did not touch, different on the
    others. No Tether setting reproduces verl's order (reported)."""
    n = data().n
    theirs = dict(rollout_is="sequence", thr=5.0, rs="token_k1", rs_thr="0.5_2.0")
    config = corrections.from_verl(rollout_is="sequence", rollout_is_threshold=5.0, rollout_rs="token_k1",
                                   rollout_rs_threshold="0.5_2.0")
    got, want = run(config), verl_reference(n, **theirs)
    same_mask(got.mask, want.mask)
    valid, kept = n["m"].astype(bool), want.mask.astype(bool)
    untouched = (kept == valid).all(-1)
    touched = ~untouched & kept.any(-1)
    assert untouched.any() and touched.any()
    close(got.weights, want.weights, where=kept & untouched[:, None], what="rows without token rejection")
    lr = np.where(kept, n["old"] - n["roll"], 0.0).sum(-1, keepdims=True)
    close(got.weights, np.minimum(np.exp(lr), 5.0) * kept, where=kept, what="Tether: over survivors")
    for b in np.flatnonzero(touched):
        assert not np.allclose(got.weights[b][kept[b]], want.weights[b][kept[b]], rtol=1e-3)


def test_verl_sequence_rule_after_token_rule_uses_the_original_mask():
    """Same ordering difference for a sequence rule after a token rule: verl's Geo-RS statistic averages over the
    original mask, Tether's over the survivors of the token rule."""
    n = data().n
    theirs = dict(rs="token_k1,seq_mean_k1", rs_thr="0.5_2.0,0.9_1.1")
    config = corrections.from_verl(rollout_rs="token_k1,seq_mean_k1", rollout_rs_threshold="0.5_2.0,0.9_1.1")
    got, want = run(config), verl_reference(n, **theirs)
    token_keep = verl_reference(n, rs="token_k1", rs_thr="0.5_2.0").mask.astype(bool)
    survivors = np.where(token_keep, n["old"] - n["roll"], 0.0).sum(-1) / np.maximum(token_keep.sum(-1), 1)
    ours = token_keep & ((np.exp(survivors) >= 0.9) & (np.exp(survivors) <= 1.1))[:, None]
    np.testing.assert_array_equal(got.mask.astype(bool), ours)
    assert not np.array_equal(got.mask.astype(bool), want.mask.astype(bool))


def test_verl_per_rule_fractions_are_standalone_tether_after_earlier_rules():
    """With two sequence rules, verl's ``rollout_rs_<rule>_masked_fraction`` is what that rule alone rejects;
    so is Tether's (the loss still applies the second rule to the rows the first kept: same final mask)."""
    n = data().n
    theirs = dict(rollout_is="token", thr=2.0, rs="seq_mean_k1,seq_max_k3", rs_thr="0.999_1.001,0.05")
    got = run(corrections.from_verl(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1,seq_max_k3",
                                    rollout_rs_threshold="0.999_1.001,0.05"))
    want = verl_reference(n, **theirs)
    alone = verl_reference(n, rs="seq_max_k3", rs_thr=0.05)
    key = P + "rollout_rs_seq_max_k3_masked_fraction"
    close(want.metrics[key], alone.metrics[P + "rollout_rs_masked_fraction"])
    close(got.metrics[key], want.metrics[key])
    first_keeps = verl_reference(n, rs="seq_mean_k1", rs_thr="0.999_1.001").mask
    after_first = ((1 - alone.mask) * first_keeps).sum() / n["m"].sum()
    assert not math.isclose(after_first, want.metrics[key], rel_tol=1e-3)  # the case tells the two apart


def test_verl_sequence_is_max_min_metrics_report_raw_ratios():
    """verl's sequence-level ``rollout_is_max/min`` are the raw (untruncated) sequence ratios; so are Tether's."""
    n = data().n
    got = run(corrections.preset("decoupled_seq_is"))
    want = verl_reference(n, **SEQ_IS)
    seq = np.exp(np.clip((np.where(n["m"] > 0, n["old"] - n["roll"], 0.0)).sum(-1), -20, 20))
    close(want.metrics[P + "rollout_is_max"], seq.max())
    close(got.metrics[P + "rollout_is_max"], want.metrics[P + "rollout_is_max"])
    close(got.metrics[P + "rollout_is_min"], seq.min())


def test_verl_metrics_count_empty_rows_tether_does_not():
    """verl averages ``training_ppl`` (and chi2_seq, log_ppl_*, rollout_rs_seq_masked_fraction) over ALL rows, an
    empty row contributing exp(0) = 1; Tether skips empty rows: it equals verl on the batch without that row."""
    d = data_with_empty_row()
    n = d.n
    config = corrections.preset("decoupled_geo_rs")
    got = run(config, d)
    want = verl_reference(n, **GEO)
    rows = n["m"].sum(-1) > 0
    without = verl_reference({k: (v[rows] if np.ndim(v) else v) for k, v in n.items()}, **GEO)
    for key in ("training_ppl", "rollout_ppl", "chi2_seq", "log_ppl_abs_diff", "rollout_rs_seq_masked_fraction"):
        close(got.metrics[P + key], without.metrics[P + key], what=key)
        assert not math.isclose(got.metrics[P + key], want.metrics[P + key], rel_tol=1e-4), key
    for key in ("kl", "k3_kl", "chi2_token", "rollout_rs_masked_fraction"):  # token statistics agree
        close(got.metrics[P + key], want.metrics[P + key], what=key)
    close(got.loss, want.loss)


def _verl_objective_case(name):
    n = data().n
    w, _ = verl.compute_rollout_correction_weights(n["old"] - n["roll"], n["m"], "token", 2.0)
    importance = ImportanceWeights("token", high=2.0)
    if name == "gspo":
        config = CorrectionConfig(objective=Objective("gspo", clip_low=3e-4, clip_high=4e-4), importance=importance,
                                  reduction="seq-mean-token-mean", denominator="kept")
        want = verl.compute_policy_loss_gspo(n["old"], n["lp"], n["A"], n["m"], clip_ratio_low=3e-4,
                                             clip_ratio_high=4e-4, rollout_is_weights=w)[0]
    elif name == "sapo":
        config = CorrectionConfig(objective=Objective("sapo"), importance=importance, reduction="seq-mean-token-mean",
                                  denominator="kept")
        want = verl.compute_policy_loss_sapo(n["old"], n["lp"], n["A"], n["m"], rollout_is_weights=w)[0]
    elif name == "cispo":
        config = CorrectionConfig(objective=Objective("cispo", clip_low=1.0, clip_high=4.0), importance=importance,
                                  denominator="kept")
        want = verl.compute_policy_loss_cispo(n["old"], n["lp"], n["A"], n["m"], clip_ratio_low=1.0,
                                              clip_ratio_high=4.0, rollout_is_weights=w)[0]
    elif name == "kl_cov_default":
        config = CorrectionConfig(objective=Objective("kl_cov"), importance=importance, denominator="kept")
        want = verl.compute_policy_loss_kl_cov(n["old"], n["lp"], n["A"], n["m"], rollout_is_weights=w)[0]
    elif name == "kl_cov_0.13":
        config = CorrectionConfig(objective=Objective("kl_cov", kl_cov_ratio=0.13, kl_cov_coef=0.5),
                                  importance=importance, denominator="kept")
        want = verl.compute_policy_loss_kl_cov(n["old"], n["lp"], n["A"], n["m"], kl_cov_ratio=0.13, ppo_kl_coef=0.5,
                                               rollout_is_weights=w)[0]
    else:  # clip_cov with every candidate cut (deterministic: #candidates <= clip_num)
        kw = dict(clip_cov_ratio=0.6, clip_cov_lb=0.05, clip_cov_ub=5.0)
        config = CorrectionConfig(objective=Objective("clip_cov", clip_cov_ratio=0.6, clip_cov_low=0.05),
                                  importance=importance, denominator="kept")
        want, metrics = verl.compute_policy_loss_clip_cov(n["old"], n["lp"], n["A"], n["m"], rollout_is_weights=w,
                                                          **kw)
        ratio = np.exp(n["lp"] - n["old"])
        clipped = -n["A"] * np.clip(ratio, 0.8, 1.2) > -n["A"] * ratio
        cov = (n["A"] - verl.masked_mean(n["A"], n["m"])) * (n["lp"] - verl.masked_mean(n["lp"], n["m"]))
        candidates = ((cov > 0.05) & (cov < 5.0) & (n["m"] > 0) & ~clipped).sum()
        assert 0 < candidates <= int(0.6 * n["m"].sum()), "every candidate is cut: deterministic"
        assert metrics["actor/pg_clipfrac"] * n["m"].sum() == pytest.approx(candidates)
    return config, want


@pytest.mark.parametrize("name", ["gspo", "sapo", "cispo", "clip_cov", "kl_cov_default", "kl_cov_0.13"])
def test_verl_objectives(name):
    config, want = _verl_objective_case(name)
    close(run(config).loss, want, what=name)


@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                                  "seq-mean-token-mean"])
def test_verl_agg_loss_modes(mode):
    n = data().n
    loss = np.where(n["m"] > 0, n["lp"] * n["A"], 0.0)
    got = float(corrections.reduce_loss(np.float32(loss), n["m"], mode=mode))
    close(got, verl.agg_loss(loss, n["m"], mode), what=mode)


def test_verl_seq_mean_token_sum_norm_counts_rows_differently_with_an_empty_row():
    """Dr. GRPO norm: Tether divides by B * T (spec), verl by (non-empty rows) * T."""
    n = data_with_empty_row().n
    loss = np.where(n["m"] > 0, n["lp"] * n["A"], 0.0)
    got = float(corrections.reduce_loss(np.float32(loss), n["m"], mode="seq-mean-token-sum-norm"))
    want = verl.agg_loss(loss, n["m"], "seq-mean-token-sum-norm")
    close(got, loss.sum() / (B * T))
    close(want, loss.sum() / ((B - 1) * T))


@pytest.mark.parametrize("ours,theirs", [("k1", "kl"), ("k1", "k1"), ("k2", "mse"), ("k2", "k2"),
                                         ("low_var_kl", "low_var_kl"), ("low_var_kl", "k3")])
def test_verl_kl_penalty_estimators(ours, theirs):
    n = data().n
    valid = n["m"] > 0
    got = np.asarray(corrections.kl_penalty(np.float32(n["lp"]), np.float32(n["ref"]), ours), np.float64)
    close(got, verl.kl_penalty(n["lp"], n["ref"], theirs), where=valid, what=f"{ours} vs verl {theirs}")


def test_verl_k3_is_clamped_tether_k3_is_not():
    """verl's (and SkyRL's) "k3" is low_var_kl, clamped to [-10, 10]; Tether's "k3" is the plain estimator (slime's);
    use ``kl_estimator="low_var_kl"`` for verl's numbers."""
    n = data().n
    valid = n["m"] > 0
    ours = np.asarray(corrections.kl_penalty(np.float32(n["lp"]), np.float32(n["ref"]), "k3"), np.float64)
    theirs = verl.kl_penalty(n["lp"], n["ref"], "k3")
    big = valid & (ours > 10)
    assert big.any()
    close(theirs, 10.0, where=big)
    close(ours, slime.compute_approx_kl(n["lp"], n["ref"], "k3"), where=valid)
    close(skyrl.compute_approx_kl(n["lp"], n["ref"], kl_estimator_type="k3"), theirs, where=valid)


def test_verl_kl_loss_in_the_pipeline():
    """verl adds kl_coef * agg_loss(kl) to the policy loss; same token-mean denominator."""
    n = data().n
    config = corrections.preset("decoupled_token_is", kl_coef=0.1, kl_estimator="low_var_kl")
    got = run(config, ref_logprobs=data().j["ref"])
    want = verl_reference(n, **TOKEN_IS)
    kl = verl.agg_loss(verl.kl_penalty(n["lp"], n["ref"], "low_var_kl"), want.mask, "token-mean")
    close(got.loss, want.loss + 0.1 * kl)


def _rewards(seed=3, groups=3, size=4):
    rng = np.random.default_rng(seed)
    scores = np.float32(rng.integers(0, 3, groups * size) * 0.5 + rng.normal(0, 0.1, groups * size))
    token = np.zeros((groups * size, 5))
    token[:, 2] = scores  # reward on one token: the frameworks sum it
    return scores, token, np.ones_like(token), np.repeat(np.arange(groups), size)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_verl_and_skyrl_group_advantages(estimator):
    scores, token, mask, index = _rewards()
    if estimator == "grpo":
        got = corrections.grpo_advantages(scores, 4)
        wants = [verl.compute_grpo_outcome_advantage(token, mask, index)[0],
                 skyrl.compute_grpo_outcome_advantage(token, mask, index)[0]]
    elif estimator == "dr_grpo":
        got = corrections.dr_grpo_advantages(scores, 4)
        wants = [verl.compute_grpo_outcome_advantage(token, mask, index, norm_adv_by_std_in_grpo=False)[0],
                 skyrl.compute_grpo_outcome_advantage(token, mask, index, grpo_norm_by_std=False)[0]]
    else:
        got = corrections.rloo_advantages(scores, 4)
        wants = [verl.compute_rloo_outcome_advantage(token, mask, index)[0],
                 skyrl.compute_rloo_outcome_advantage(token, mask, index)[0]]
    for want in wants:
        close(np.asarray(got, np.float64), want[:, 0], atol=1e-5, what=estimator)


def test_grpo_over_the_scored_samples_is_verls_over_the_samples_left_after_a_filter():
    """verl groups by uid whatever is left in the batch: its advantages of the scored samples alone (groups of 4, 3
    and 2 here) are Tether's with ``scored``."""
    scores, token, mask, index = _rewards(groups=3, size=4)
    scored = np.array([1, 1, 1, 1, 1, 0, 1, 1, 0, 1, 0, 1], bool)
    got = corrections.grpo_advantages(np.where(scored, scores, np.nan), 4, scored=scored)
    want = verl.compute_grpo_outcome_advantage(token[scored], mask[scored], index[scored])[0][:, 0]
    close(np.asarray(got, np.float64)[scored], want, atol=1e-5)


def test_singleton_groups_differ_from_verl():
    """A group of one: Tether gives 0 (GRPO, RLOO; SkyRL's RLOO too); verl's GRPO gives s / (1 + eps) (mean 0,
    std 1) and verl's RLOO keeps the raw score. No Tether setting reproduces these verl quirks."""
    scores, token, mask, index = _rewards(groups=6, size=1)
    close(np.asarray(corrections.grpo_advantages(scores, 1), np.float64), 0.0)
    close(np.asarray(corrections.rloo_advantages(scores, 1), np.float64), 0.0)
    close(verl.compute_grpo_outcome_advantage(token, mask, index)[0][:, 0], scores / (1 + 1e-6))
    close(verl.compute_rloo_outcome_advantage(token, mask, index)[0][:, 0], scores)
    close(skyrl.compute_rloo_outcome_advantage(token, mask, index)[0][:, 0], 0.0)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_verl_and_skyrl_reinforce_pp_advantages(gamma):
    n = data().n
    rng = np.random.default_rng(5)
    rewards = np.float32(rng.normal(0, 1, (B, T)) * n["m"])
    got = np.asarray(corrections.reinforce_pp_advantages(rewards, n["m"], gamma=gamma), np.float64)
    valid = n["m"] > 0
    close(got, verl.compute_reinforce_plus_plus_outcome_advantage(rewards, n["m"], gamma)[0], where=valid,
          atol=1e-5)
    close(got, skyrl.compute_reinforce_plus_plus_outcome_advantage(rewards, n["m"], gamma)[0], where=valid,
          atol=1e-5)


# ============================================================================================ SkyRL

def skyrl_reference(n, opc, loss_type="regular", loss_fn=skyrl.ppo_policy_loss, reduction="token_mean", **alg):
    """SkyRL's numbers: the correction (weights, mask) and the total loss (advantages pre-divided by the ORIGINAL
    mask's count, then a plain masked sum)."""
    tis, metrics, mask = skyrl.compute_off_policy_correction(n["old"], n["roll"], n["m"], opc)
    adv = skyrl.apply_loss_reduction_to_advantages_minibatch(n["A"], n["m"], reduction)
    config = dict(policy_loss_type=loss_type, off_policy_correction=opc, **alg)
    loss, _ = loss_fn(n["lp"], n["old"], adv, config, loss_mask=n["m"], rollout_logprobs=n["roll"])
    weights = None if tis is None else np.broadcast_to(tis, n["m"].shape)
    return types.SimpleNamespace(weights=weights, mask=mask, loss=loss, metrics=metrics)


SKYRL_PRESETS = {
    "skyrl_token_tis": dict(tis_ratio_type="token"),
    "skyrl_sequence_tis": dict(tis_ratio_type="sequence"),
    "skyrl_token_mask": dict(token_mask_is_threshold_low=0.5, token_mask_is_threshold_high=2.0),
    "skyrl_outlier_mask": dict(outlier_token_is_threshold_low=1e-4, outlier_token_is_threshold_high=100.0),
    "skyrl_geometric_mask": dict(sequence_mask_metric="geometric"),
    "skyrl_product_mask": dict(sequence_mask_metric="product"),
}


def check_against_skyrl(config, opc, **kwargs):
    n = data().n
    got, want = run(config), skyrl_reference(n, opc, **kwargs)
    same_mask(got.mask, want.mask * n["m"])
    kept = want.mask.astype(bool) & (n["m"] > 0)
    if want.weights is not None:
        close(got.weights, want.weights, where=kept, what="TIS weights on kept tokens")
    close(got.loss, want.loss, what="total loss")
    return got, want


def test_every_skyrl_preset_is_listed():
    assert {k for k in corrections.PRESETS if k.startswith("skyrl_") and k not in (
        "skyrl_rollout_is", "skyrl_cispo")} == set(SKYRL_PRESETS)


@pytest.mark.parametrize("name", sorted(SKYRL_PRESETS))
def test_skyrl_preset_matches_skyrl_regular(name):
    """Tether's skyrl_* presets are SkyRL's default ``policy_loss_type="regular"``."""
    got, want = check_against_skyrl(corrections.preset(name), SKYRL_PRESETS[name], loss_type="regular")
    if "tis_ratio_type" not in SKYRL_PRESETS[name]:
        assert 0 < want.mask.sum() < data().n["m"].sum()


def test_skyrl_dual_clip_is_objective_dual_clip():
    """SkyRL's ``policy_loss_type="dual_clip"`` (``clip_ratio_c`` 3.0): the preset with ``dual_clip=3.0``."""
    check_against_skyrl(corrections.preset("skyrl_token_tis", objective={"dual_clip": 3.0}),
                        dict(tis_ratio_type="token"), loss_type="dual_clip")
    dual = skyrl_reference(data().n, dict(tis_ratio_type="token"), loss_type="dual_clip").loss
    assert not math.isclose(run(corrections.preset("skyrl_token_tis")).loss, dual, rel_tol=1e-4)


SKYRL_COMBINED = (
    CorrectionConfig(objective=Objective(dual_clip=3.0), importance=ImportanceWeights("sequence", high=5.0),
                     rejection=(RejectionRule("seq_mean_k1", 0.99, 1.01), RejectionRule("token_k1", 0.7, 1.4),
                                RejectionRule("outlier", 1e-4, 100.0))),
    dict(tis_ratio_type="sequence", sequence_mask_metric="geometric", token_mask_is_threshold_low=0.7,
         token_mask_is_threshold_high=1.4, outlier_token_is_threshold_low=1e-4,
         outlier_token_is_threshold_high=100.0),
)


def test_skyrl_order_outlier_token_mask_sequence_tis_then_geometric():
    """SkyRL's order (the rules are listed out of order on purpose): outlier, token mask, sequence TIS over the
    survivors, geometric mask over the survivors."""
    got, want = check_against_skyrl(*SKYRL_COMBINED, loss_type="dual_clip")
    n = data().n
    assert 0 < (want.mask * n["m"]).sum() < n["m"].sum()
    # the geometric mask sees the survivors of the token mask
    without_token_mask = skyrl_reference(n, dict(SKYRL_COMBINED[1], token_mask_is_threshold_low=None),
                                         loss_type="dual_clip")
    assert not np.array_equal(want.mask * n["m"], without_token_mask.mask * n["m"])


@pytest.mark.parametrize("objective", ["sapo", "gspo", "cispo"])
def test_skyrl_objectives_with_token_tis(objective):
    loss_fn = {"sapo": skyrl.sapo_policy_loss, "gspo": skyrl.gspo_policy_loss,
               "cispo": skyrl.compute_policy_loss_cispo}[objective]
    obj = {"sapo": Objective("sapo"), "gspo": Objective("gspo", clip_low=3e-4, clip_high=4e-4),
           "cispo": Objective("cispo", clip_low=1.0, clip_high=4.0)}[objective]
    alg = dict(eps_clip_low=3e-4, eps_clip_high=4e-4) if objective == "gspo" else {}
    config = CorrectionConfig(objective=obj, importance=ImportanceWeights("token", high=2.0),
                              rejection=(RejectionRule("token_k1", 0.5, 2.0),))
    opc = dict(tis_ratio_type="token", token_mask_is_threshold_low=0.5, token_mask_is_threshold_high=2.0)
    check_against_skyrl(config, opc, loss_fn=loss_fn, **alg)


def test_skyrl_preset_cispo_and_rollout_is():
    check_against_skyrl(corrections.preset("skyrl_cispo"), {}, loss_fn=skyrl.compute_policy_loss_cispo)
    check_against_skyrl(corrections.preset("skyrl_rollout_is"), {}, loss_fn=skyrl.rollout_is_policy_loss)


def test_skyrl_sequence_mean_reduction():
    config = corrections.preset("skyrl_geometric_mask", reduction="seq-mean-token-mean")
    check_against_skyrl(config, dict(sequence_mask_metric="geometric"), loss_type="dual_clip",
                        reduction="sequence_mean")


def test_skyrl_kl_cov_penalty_escapes_the_token_mean():
    """SkyRL's kl_cov_frac 0.2 is a fraction of valid tokens (Tether ``kl_cov_ratio``). SkyRL's token mean comes from
    advantages pre-divided by the token count N, which does not reach the ``coef * |lp - old|`` penalty: that term
    is SUMMED. Tether averages it (verl's numbers); SkyRL's are Tether's with ``kl_cov_coef = N * coef``."""
    n = data().n
    count = n["m"].sum()
    assert (count * 0.2) % 1 > 0.05  # int() and float32 floor agree
    config = CorrectionConfig(objective=Objective("kl_cov", kl_cov_ratio=0.2))
    want = skyrl_reference(n, {}, loss_fn=skyrl.compute_policy_loss_kl_cov).loss
    close(run(config.replace(objective=Objective("kl_cov", kl_cov_ratio=0.2, kl_cov_coef=float(count)))).loss, want)
    verl_loss = verl.compute_policy_loss_kl_cov(n["old"], n["lp"], n["A"], n["m"], kl_cov_ratio=0.2)[0]
    close(run(config).loss, verl_loss)
    assert not math.isclose(verl_loss, want, rel_tol=1e-3)


def test_skyrl_is_ratio_min_quirk():
    """SkyRL's ``is_ratio_min`` is the min over ALL positions of ratio * mask: 0 whenever there is padding (and its
    std runs over padding too). Tether's masked min is the true minimum ratio; the mean and max agree."""
    n = data().n
    _, metrics, _ = skyrl.compute_off_policy_correction(n["old"], n["roll"], n["m"], dict(tis_ratio_type="token"))
    got = run(CorrectionConfig(importance=ImportanceWeights("token", high=None))).metrics  # raw ratios as weights
    rho = np.exp(np.clip(n["old"] - n["roll"], -20, 20))
    valid = n["m"] > 0
    assert metrics["is_ratio_min"] == 0.0
    close(got[P + "rollout_is_min"], rho[valid].min())
    close(got[P + "rollout_is_mean"], metrics["is_ratio_mean"])
    close(got[P + "rollout_is_max"], metrics["is_ratio_max"])
    close(got[P + "rollout_is_std"], rho[valid].std())
    assert not math.isclose(metrics["is_ratio_std"], rho[valid].std(), rel_tol=1e-3)


# ============================================================================================ slime

def slime_per_token(n, pg_loss_type="ppo", eps_clip=0.2, eps_clip_high=None, eps_clip_c=None, tis=None,
                    tis_clip=2.0, tis_clip_low=0.0):
    """slime's per-token pg loss (compute_policy_loss / cispo / reinforce, then the TIS function)."""
    eps_clip_high = eps_clip if eps_clip_high is None else eps_clip_high
    ppo_kl = n["old"] - n["lp"]
    if pg_loss_type == "reinforce":
        pg = -n["A"] * n["lp"]
    elif pg_loss_type == "cispo":
        pg, _ = slime.compute_cispo_loss(ppo_kl, n["lp"], n["A"], eps_clip, eps_clip_high)
    else:
        pg, _ = slime.compute_policy_loss(ppo_kl, n["A"], eps_clip, eps_clip_high, eps_clip_c)
    if tis is slime.off_policy_is_function:
        pg, _, _ = tis(pg, n["lp"], n["roll"], n["m"], tis_clip, tis_clip_low)
    elif tis is not None:
        pg, _, _ = tis(pg, n["old"], n["roll"], n["m"], tis_clip, tis_clip_low)
    return pg


SLIME_CASES = {
    # name: (Tether config, slime policy_loss_function kwargs)
    "vanilla_tis": (corrections.preset("slime_tis", reduction="seq-mean-token-mean"),
                    dict(use_tis=True, tis_func=slime.vanilla_tis_function)),
    "icepop": (corrections.preset("slime_icepop", reduction="seq-mean-token-mean"),
               dict(use_tis=True, tis_func=slime.icepop_function, tis_clip=5.0, tis_clip_low=0.5)),
    # PR #2084 (8e0d556e): clamp(exp(sg(lp) - roll), tis_clip_low, tis_clip) on the normal PPO loss
    "off_policy_is": (CorrectionConfig(importance=ImportanceWeights("token", high=2.0, numerator="current"),
                                       reduction="seq-mean-token-mean"),
                      dict(use_tis=True, tis_func=slime.off_policy_is_function)),
    "off_policy_is_cispo": (CorrectionConfig(objective=Objective("cispo", clip_low=1.0, clip_high=0.28),
                                             importance=ImportanceWeights("token", low=0.5, high=5.0,
                                                                          numerator="current"),
                                             reduction="seq-mean-token-mean"),
                            dict(pg_loss_type="cispo", eps_clip=1.0, eps_clip_high=0.28, use_tis=True,
                                 tis_func=slime.off_policy_is_function, tis_clip=5.0, tis_clip_low=0.5)),
    "ppo_dual_clip_high": (CorrectionConfig(objective=Objective(clip_high=0.28, dual_clip=3.0),
                                            reduction="seq-mean-token-mean"),
                           dict(eps_clip_high=0.28, eps_clip_c=3.0)),
    "cispo_tis": (CorrectionConfig(objective=Objective("cispo", clip_low=0.2, clip_high=0.28),
                                   importance=ImportanceWeights("token", high=2.0), reduction="seq-mean-token-mean"),
                  dict(pg_loss_type="cispo", eps_clip_high=0.28, use_tis=True, tis_func=slime.vanilla_tis_function)),
}


@pytest.mark.parametrize("name", sorted(SLIME_CASES))
def test_slime_policy_loss(name):
    """slime's reducer (sum over samples of per-sample means, ORIGINAL counts) is Tether's ``loss_numerator`` with
    ``reduction="seq-mean-token-mean"`` (denominator "original"); slime's loss after Megatron's division by the
    number of samples is Tether's ``loss`` (equal when no row is empty)."""
    config, kwargs = SLIME_CASES[name]
    n = data().n
    want, _ = slime.policy_loss_function(n["lp"], n["old"], n["A"], n["m"], n["roll"], **kwargs)
    got = run(config)
    close(got.numerator, want, what="sum of sample means")
    close(got.loss, want / B, what="mean over samples")
    per_token = slime_per_token(n, **{k: v for k, v in kwargs.items() if k not in ("use_tis", "tis_func")},
                                tis=kwargs.get("tis_func"))
    close(got.per_token, per_token, where=n["m"] > 0, what="per-token loss")


def test_slime_presets_default_to_token_mean_which_is_slime_per_token_loss():
    """The slime presets keep Tether's default ``token-mean``: slime's ``--calculate-per-token-loss`` (sum of
    per-token losses over the token count). slime's default per-sample mean needs
    ``reduction="seq-mean-token-mean"`` (test above)."""
    n = data().n
    got = run(corrections.preset("slime_tis"))
    pg = slime_per_token(n, tis=slime.vanilla_tis_function)
    per_token_sum = slime.get_sum_of_sample_mean(n["m"], calculate_per_token_loss=True)(pg)
    close(got.loss, per_token_sum / n["m"].sum())
    sample_mean, _ = slime.policy_loss_function(n["lp"], n["old"], n["A"], n["m"], n["roll"], use_tis=True)
    assert not math.isclose(got.loss, sample_mean / B, rel_tol=1e-3)


MIS_CASES = {
    # name: (compute_mis_weights kwargs, Tether config)
    "token_truncate": (dict(mis_level="token", mis_mode="truncate", mis_upper_bound=2.0),
                       CorrectionConfig(importance=ImportanceWeights("token", high=2.0))),
    "sequence_truncate": (dict(mis_level="sequence", mis_mode="truncate", mis_upper_bound=3.0),
                          CorrectionConfig(importance=ImportanceWeights("sequence", high=3.0))),
    "geometric_truncate": (dict(mis_level="geometric", mis_mode="truncate", mis_upper_bound=1.05),
                           CorrectionConfig(importance=ImportanceWeights("geometric", high=1.05))),
    "token_clip": (dict(mis_level="token", mis_mode="clip", mis_lower_bound=0.5, mis_upper_bound=2.0),
                   CorrectionConfig(importance=ImportanceWeights("token", low=0.5, high=2.0))),
    "geometric_clip": (dict(mis_level="geometric", mis_mode="clip", mis_lower_bound=0.99, mis_upper_bound=1.01),
                       CorrectionConfig(importance=ImportanceWeights("geometric", low=0.99, high=1.01))),
    # mis "mask" drops tokens / sequences from the loss mask: a Tether rejection rule plus uncapped weights.
    "token_mask": (dict(mis_level="token", mis_mode="mask", mis_lower_bound=0.5, mis_upper_bound=2.0),
                   CorrectionConfig(importance=ImportanceWeights("token", high=None),
                                    rejection=(RejectionRule("token_k1", 0.5, 2.0),))),
    "geometric_mask": (dict(mis_level="geometric", mis_mode="mask", mis_lower_bound=0.99, mis_upper_bound=1.01),
                       CorrectionConfig(importance=ImportanceWeights("geometric", high=None),
                                        rejection=(RejectionRule("seq_mean_k1", 0.99, 1.01),))),
    "sequence_mask": (dict(mis_level="sequence", mis_mode="mask", mis_lower_bound=0.5, mis_upper_bound=2.0),
                      CorrectionConfig(importance=ImportanceWeights("sequence", high=None),
                                       rejection=(RejectionRule("seq_sum_k1", 0.5, 2.0),))),
    # veto: low only, strict (any valid token with ratio < threshold drops the sequence)
    "token_truncate_veto": (dict(mis_level="token", mis_mode="truncate", mis_upper_bound=2.0,
                                 mis_veto_threshold=1e-4),
                            CorrectionConfig(importance=ImportanceWeights("token", high=2.0),
                                             rejection=(RejectionRule("outlier", low=1e-4),))),
}


@pytest.mark.parametrize("name", sorted(MIS_CASES))
def test_slime_mis_weights_and_masks(name):
    kwargs, config = MIS_CASES[name]
    n = data().n
    weights, mask = slime.compute_mis_weights(n["old"], n["roll"], n["m"], **kwargs)
    got = run(config)
    same_mask(got.mask, mask)
    close(got.weights, weights, where=mask > 0, what="weights")
    if "mask" in name or "veto" in name:
        assert 0 < mask.sum() < n["m"].sum()


def mixed_sign_advantages(n):
    """Per-token advantages whose sign differs within sequences; row means of both signs."""
    rng = np.random.default_rng(11)
    adv = rng.normal(0.0, 1.0, (B, T)) + np.where(np.arange(B) % 2 == 0, -0.4, 0.4)[:, None]
    return np.float32(adv * n["m"])


def test_slime_opsm_current_per_token_bug_vs_pr1917():
    """slime's compute_opsm_mask (current) takes the PER-TOKEN advantage sign with the sequence KL, so a sequence
    with mixed-sign advantages is only partly masked; Tether decides per sequence (PR #1917) and equals that port.
    slime's numbers have no Tether setting (a bug)."""
    n = data().n
    adv = mixed_sign_advantages(n)
    a64 = np.float64(adv)
    current, _ = slime.compute_opsm_mask(a64, n["lp"], n["old"], n["m"], 1e-4)
    fixed, _ = slime.compute_opsm_mask_pr1917(a64, n["lp"], n["old"], n["m"], 1e-4)
    config = corrections.preset("slime_opsm", reduction="seq-mean-token-mean")
    got = run(config, advantages=adv)
    valid = n["m"] > 0
    same_mask(got.mask, fixed * n["m"])
    partial = [b for b in range(B) if 0 < ((1 - current[b]) * n["m"][b]).sum() < n["m"][b].sum()]
    assert partial, "slime masks a sequence only partly"
    assert not np.array_equal((current * n["m"]).astype(bool), got.mask.astype(bool))
    # loss: slime's reducer with each mask
    pg, _ = slime.compute_policy_loss(n["old"] - n["lp"], a64, 0.2, 0.2)
    reducer = slime.get_sum_of_sample_mean(n["m"])
    close(got.numerator, reducer(pg * fixed))
    assert not math.isclose(got.numerator, reducer(pg * current), rel_tol=1e-3)
    want_slime, _ = slime.policy_loss_function(n["lp"], n["old"], a64, n["m"], use_opsm=True)
    close(want_slime, reducer(pg * current))
    close(got.per_token, pg * fixed, where=valid)


# ============================================================================================ AReaL

def test_areal_decoupled_ppo_preset():
    """AReaL's behav_imp_weight_cap is a MASK on the weight (w <= cap keeps it, else 0); loss over the original
    count."""
    n = data().n
    want, stat = areal.ppo_actor_loss_fn(n["lp"], n["old"], n["roll"], n["A"], 0.2, n["m"], behav_imp_weight_cap=5.0)
    got = run(corrections.preset("areal_decoupled_ppo"))
    valid = n["m"] > 0
    assert (valid & ~stat["behave_mask"]).any(), "the cap masks some weights on this batch"
    close(got.weights, stat["behave_imp_weight"], where=valid)
    close(got.per_token, stat["loss"], where=valid)
    close(got.loss, want)
    same_mask(got.mask, n["m"])


def test_areal_dual_clip_and_intermediate_modes():
    n = data().n
    valid = n["m"] > 0
    want, _ = areal.ppo_actor_loss_fn(n["lp"], n["old"], n["roll"], n["A"], 0.2, n["m"], c_clip=3.0,
                                      behav_imp_weight_cap=5.0)
    close(run(corrections.preset("areal_decoupled_ppo", objective={"dual_clip": 3.0})).loss, want)
    for mode, importance in (("token_truncate", ImportanceWeights("token", high=5.0)),
                             ("token_mask", ImportanceWeights("token", high=5.0, overflow="mask")),
                             ("sequence_truncate", ImportanceWeights("geometric", high=1.05)),
                             ("sequence_mask", ImportanceWeights("geometric", high=1.05, overflow="mask"))):
        cap = 1.05 if mode.startswith("sequence") else 5.0
        want, stat = areal.ppo_actor_loss_fn_mode(n["lp"], n["old"], n["roll"], n["A"], 0.2, n["m"],
                                                  behave_imp_weight_cap=cap, behave_imp_weight_mode=mode)
        got = run(CorrectionConfig(importance=importance))
        close(got.weights, stat["behave_imp_weight"], where=valid, what=mode)
        close(got.loss, want, what=mode)


# ====================================================== migration-page mappings (docs/from-other-frameworks.md)

def verl_token_veto(n, mask, threshold):
    """Older verl's ``rollout_token_veto_threshold`` (rollout_corr_helper, "Step 4: apply token veto"; the port in
    tests/support/reference_ports/verl.py is of the newer helper, which has no veto): ``log_ratio = old - roll``; a
    row with any valid token where ``log_ratio < log(threshold)`` has its whole modified response mask zeroed; the
    IS weights are left as they are."""
    catastrophic = (n["old"] - n["roll"] < math.log(threshold)) & (n["m"] > 0)
    return mask * (~catastrophic.any(-1, keepdims=True))


@pytest.mark.parametrize("ours,theirs", [
    (dict(rollout_is="token", rollout_is_threshold=2.0), dict(rollout_is="token", thr=2.0)),
    (dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0"),
     dict(rollout_is="token", thr=2.0, rs="token_k1", rs_thr="0.5_2.0")),
], ids=["token_tis", "token_tis_token_k1"])
def test_verl_token_veto_is_an_appended_outlier_rule(ours, theirs):
    """docs: ``rollout_token_veto_threshold: 1e-4`` == ``RejectionRule("outlier", low=1e-4)`` appended to the
    ``from_verl`` config. verl's final mask is its rejection mask times the veto mask; its PPO loss (dual clip 3,
    token-mean over the final mask) then uses that mask."""
    n = data().n
    config = corrections.from_verl(**ours)
    config = config.replace(rejection=config.rejection + (RejectionRule("outlier", low=1e-4),))
    w, mask, _ = verl.compute_rollout_correction_and_rejection_mask(
        n["old"], n["roll"], n["m"], theirs.get("rollout_is"), theirs.get("thr", 2.0), False, theirs.get("rs"),
        theirs.get("rs_thr"))
    vetoed = verl_token_veto(n, mask, 1e-4)
    # the helper is slime's calculate_veto_mask (mis.py kept verl's veto), row by row
    slime_veto = np.stack([slime.calculate_veto_mask(n["old"][b] - n["roll"][b], n["m"][b], 1e-4)
                           for b in range(B)])
    np.testing.assert_array_equal(vetoed, mask * slime_veto)
    dropped = mask.any(-1) & ~vetoed.any(-1)
    assert dropped.tolist() == [b == 6 for b in range(B)], "the veto drops row 6 (ratio 4.5e-5), and only it"

    def loss_fn(mm, agg):
        return verl.compute_policy_loss_vanilla(n["old"], n["lp"], n["A"], mm, agg, clip_ratio_c=3.0,
                                                rollout_is_weights=w)[0]

    got = run(config)
    same_mask(got.mask, vetoed)
    kept = vetoed.astype(bool)
    close(got.weights, w, where=kept, what="IS weights on kept tokens")
    close(got.per_token, per_token_of(loss_fn, vetoed), where=n["m"] > 0, what="per-token loss")
    close(got.loss, loss_fn(vetoed, "token-mean"), what="token-mean loss over the vetoed mask")
    without = run(corrections.from_verl(**ours))  # the appended rule is what drops row 6
    assert without.mask[6].any() and not got.mask[6].any()


class _Ordered:
    """An ``rng`` for the SkyRL clip-cov port whose permutation puts the given candidates first: the port then cuts
    exactly those (the candidates are enumerated in np.argwhere order, as the port does)."""

    def __init__(self, candidates, first):
        self.order = np.array(sorted(range(len(candidates)), key=lambda i: not first[tuple(candidates[i])]))

    def permutation(self, k):
        assert k == len(self.order)
        return self.order


SKYRL_CLIP_COV_WINDOW = (0.1, 2.0)  # Tether's (clip_cov_low, clip_cov_high); SkyRL's is this divided by N


def _skyrl_clip_cov_candidates(n, lb, ub):
    """SkyRL's clip-cov candidates: unclipped valid tokens whose covariance of the N-divided advantages lies in
    (lb, ub) (the port's selection, before the random pick)."""
    m = n["m"]
    adv = skyrl.apply_loss_reduction_to_advantages_minibatch(n["A"], m, "token_mean")
    ratio = np.exp(n["lp"] - n["old"])
    clipped = -adv * np.clip(ratio, 0.8, 1.2) > -adv * ratio
    cov = (adv - skyrl.masked_mean(adv, m)) * (n["lp"] - skyrl.masked_mean(n["lp"], m))
    return (m > 0) & ~clipped & (cov > lb) & (cov < ub)


@pytest.mark.parametrize("clip_ratio", [0.5, 0.2], ids=["every_candidate_cut", "random_pick"])
def test_skyrl_clip_cov_window_is_tethers_divided_by_n(clip_ratio):
    """docs: SkyRL's ``clip_cov: {clip_ratio, clip_cov_lb, clip_cov_ub}`` is ``Objective("clip_cov",
    clip_cov_ratio=clip_ratio, clip_cov_low=N * lb, clip_cov_high=N * ub)`` (N: valid tokens). Both cut
    ``min(max(int(ratio * N), 1), #candidates)`` candidates at random: same count, Tether's cut tokens are SkyRL's
    candidates, and SkyRL's loss with those same tokens cut (a permutation that lists them first) is Tether's."""
    n = data().n
    count = n["m"].sum()
    low, high = SKYRL_CLIP_COV_WINDOW
    lb, ub = low / count, high / count
    candidates = _skyrl_clip_cov_candidates(n, lb, ub)
    clip_num = max(int(clip_ratio * count), 1)
    alg = dict(clip_cov=dict(clip_ratio=clip_ratio, clip_cov_lb=lb, clip_cov_ub=ub))
    adv = skyrl.apply_loss_reduction_to_advantages_minibatch(n["A"], n["m"], "token_mean")

    def skyrl_loss(rng):
        return skyrl.compute_policy_loss_clip_cov(n["lp"], n["old"], adv, alg, loss_mask=n["m"], rng=rng)

    cut_count = min(clip_num, int(candidates.sum()))
    for seed in range(3):
        _, metrics = skyrl_loss(np.random.default_rng(seed))
        close(metrics["clip_ratio"] * count, cut_count, what="SkyRL cuts min(clip_num, #candidates)")
    if clip_ratio == 0.5:
        assert 0 < candidates.sum() <= clip_num, "every candidate is cut: deterministic"
    else:
        assert clip_num < candidates.sum(), "fewer cuts than candidates: the pick is random"

    got = run(CorrectionConfig(objective=Objective("clip_cov", clip_cov_ratio=clip_ratio, clip_cov_low=low,
                                                   clip_cov_high=high)))
    cut = (n["m"] > 0) & (got.per_token == 0)
    assert cut.sum() == cut_count
    close(got.metrics["actor/pg_clipfrac"], cut_count / count, what="Tether's cut fraction")
    assert not (cut & ~candidates).any(), "Tether cuts only SkyRL's candidates"
    if clip_ratio == 0.5:
        np.testing.assert_array_equal(cut, candidates)
        close(got.loss, skyrl_loss(None)[0], what="loss, every candidate cut")
    want, _ = skyrl_loss(_Ordered(np.argwhere(candidates), cut))
    close(got.loss, want, what="loss with the same tokens cut")
    # the division by N matters: SkyRL's window taken as Tether's own selects other tokens
    assert not np.array_equal(_skyrl_clip_cov_candidates(n, low, high), candidates)


@pytest.mark.parametrize("frac,coef", [(0.2, 1.0), (0.1, 0.5), (0.35, 2.0)])
def test_skyrl_kl_cov_coef_is_tethers_divided_by_n(frac, coef):
    """docs: SkyRL's ``kl_cov: {kl_cov_frac, ppo_kl_coef}`` is ``Objective("kl_cov", kl_cov_ratio=kl_cov_frac,
    kl_cov_coef=N * ppo_kl_coef)``. The choice is the top-k covariance (deterministic in both): compare the loss."""
    n = data().n
    count = n["m"].sum()
    assert (count * frac) % 1 > 0.05  # int() and float32 floor agree
    adv = skyrl.apply_loss_reduction_to_advantages_minibatch(n["A"], n["m"], "token_mean")
    want, _ = skyrl.compute_policy_loss_kl_cov(n["lp"], n["old"], adv, dict(kl_cov=dict(kl_cov_frac=frac,
                                                                                        ppo_kl_coef=coef)),
                                               loss_mask=n["m"])
    got = run(CorrectionConfig(objective=Objective("kl_cov", kl_cov_ratio=frac, kl_cov_coef=count * coef)))
    close(got.loss, want)
    close(got.metrics["actor/pg_clipfrac"], int(count * frac) / count, what="penalised fraction")
    plain = run(CorrectionConfig(objective=Objective("kl_cov", kl_cov_ratio=frac, kl_cov_coef=coef)))
    assert not math.isclose(plain.loss, want, rel_tol=1e-3)


# slime ``tis_batch_normalize`` (docs: ``importance.batch_normalize=True``) is not tested here: the slime port
# (tests/support/reference_ports/slime.py, compute_mis_weights) has no batch-normalisation option.

def _areal_rows():
    tok, geo = ImportanceWeights("token", high=None), ImportanceWeights("geometric", high=None)
    e = math.exp
    rows = {
        # name: (AReaL rejection_sampling kwargs, Tether config as the docs row writes it)
        "ratio/token/mask": (dict(metric="ratio", level="token", action="mask", lower=0.5, upper=2.0),
                             CorrectionConfig(importance=tok, rejection=(RejectionRule("token_k1", 0.5, 2.0),))),
        "ratio/token/mask=overflow_mask": (
            dict(metric="ratio", level="token", action="mask", lower=0.5, upper=2.0),
            CorrectionConfig(importance=ImportanceWeights("token", low=0.5, high=2.0, overflow="mask"))),
        "ratio/token/mask/no_lower=overflow_mask": (
            dict(metric="ratio", level="token", action="mask", upper=2.0),
            CorrectionConfig(importance=ImportanceWeights("token", low=0.0, high=2.0, overflow="mask"))),
        "ratio/token/clamp": (dict(metric="ratio", level="token", action="clamp", lower=0.5, upper=2.0),
                              CorrectionConfig(importance=ImportanceWeights("token", low=0.5, high=2.0))),
        "kl_k1/token/clamp/no_lower": (dict(metric="kl_k1", level="token", action="clamp", upper=1.5),
                                       CorrectionConfig(importance=ImportanceWeights("token", low=0.0, high=1.5))),
        "kl_k2/token/clamp": (dict(metric="kl_k2", level="token", action="clamp", lower=0.7, upper=1.5),
                              CorrectionConfig(importance=ImportanceWeights("token", low=0.7, high=1.5))),
        "ratio/sequence/mean/mask": (
            dict(metric="ratio", level="sequence", agg="mean", action="mask", lower=0.99, upper=1.01),
            CorrectionConfig(importance=geo, rejection=(RejectionRule("seq_mean_k1", 0.99, 1.01),))),
        "ratio/sequence/sum/mask": (
            dict(metric="ratio", level="sequence", agg="sum", action="mask", lower=0.5, upper=2.0),
            CorrectionConfig(importance=geo, rejection=(RejectionRule("seq_sum_k1", 0.5, 2.0),))),
        "ratio/sequence/max/mask": (
            dict(metric="ratio", level="sequence", agg="max", action="mask", upper=2.0),
            CorrectionConfig(importance=geo, rejection=(RejectionRule("outlier", high=2.0),))),
        "ratio/sequence/mean/clamp": (
            dict(metric="ratio", level="sequence", agg="mean", action="clamp", lower=0.99, upper=1.01),
            CorrectionConfig(importance=ImportanceWeights("geometric", low=0.99, high=1.01))),
        "ratio/sequence/mean/clamp/no_lower": (
            dict(metric="ratio", level="sequence", agg="mean", action="clamp", upper=1.01),
            CorrectionConfig(importance=ImportanceWeights("geometric", low=0.0, high=1.01))),
        "kl_k1/token/mask": (dict(metric="kl_k1", level="token", action="mask", lower=-0.5, upper=0.5),
                             CorrectionConfig(importance=tok,
                                              rejection=(RejectionRule("token_k1", e(-0.5), e(0.5)),))),
        "kl_k1/sequence/mean/mask": (
            dict(metric="kl_k1", level="sequence", agg="mean", action="mask", lower=-0.01, upper=0.01),
            CorrectionConfig(importance=tok, rejection=(RejectionRule("seq_mean_k1", e(-0.01), e(0.01)),))),
        "kl_k1/sequence/sum/mask": (
            dict(metric="kl_k1", level="sequence", agg="sum", action="mask", lower=-0.7, upper=0.7),
            CorrectionConfig(importance=tok, rejection=(RejectionRule("seq_sum_k1", e(-0.7), e(0.7)),))),
        "kl_k1/sequence/max/mask": (
            dict(metric="kl_k1", level="sequence", agg="max", action="mask", upper=0.7),
            CorrectionConfig(importance=tok, rejection=(RejectionRule("outlier", high=e(0.7)),))),
        "kl_k2/token/mask": (dict(metric="kl_k2", level="token", action="mask", upper=0.03),
                             CorrectionConfig(importance=tok, rejection=(RejectionRule("token_k2", high=0.03),))),
        "kl_k2/sequence/sum/mask": (
            dict(metric="kl_k2", level="sequence", agg="sum", action="mask", upper=0.5),
            CorrectionConfig(importance=tok, rejection=(RejectionRule("seq_sum_k2", high=0.5),))),
        "kl_k2/sequence/mean/mask": (
            dict(metric="kl_k2", level="sequence", agg="mean", action="mask", upper=0.01),
            CorrectionConfig(importance=tok, rejection=(RejectionRule("seq_mean_k2", high=0.01),))),
        "kl_k2/sequence/max/mask": (
            dict(metric="kl_k2", level="sequence", agg="max", action="mask", upper=0.2),
            CorrectionConfig(importance=tok, rejection=(RejectionRule("seq_max_k2", high=0.2),))),
    }
    return rows


AREAL_RS_ROWS = _areal_rows()


def _nudged(kwargs, sign):
    """The same AReaL bounds moved by a small relative step (outward for sign=+1)."""
    out = dict(kwargs)
    for key, direction in (("lower", -1), ("upper", 1)):
        if out.get(key) is not None:
            out[key] = out[key] + sign * direction * 1e-4 * max(abs(out[key]), 1e-2)
    return out


@pytest.mark.parametrize("name", sorted(AREAL_RS_ROWS))
def test_areal_rejection_sampling_rows(name):
    """Each ``rejection_sampling`` row of the AReaL table: AReaL's (prox, old) are Tether's (proximal, rollout);
    loss (original count), weights and, for rejection configs, the final mask equal AReaL's
    ``ppo_actor_loss_fn`` with ``apply_rejection_sampling``."""
    kwargs, config = AREAL_RS_ROWS[name]
    n = data().n
    valid = n["m"] > 0
    mask, bw, _ = areal.apply_rejection_sampling(n["old"], n["roll"], n["m"], **kwargs)
    for sign in (1, -1):  # every statistic sits clearly on one side of the bounds (float32 and float64 agree)
        nudged, _, _ = areal.apply_rejection_sampling(n["old"], n["roll"], n["m"], **_nudged(kwargs, sign))
        np.testing.assert_array_equal(nudged, mask)
    want, stat = areal.ppo_actor_loss_fn_rs(n["lp"], n["old"], n["roll"], n["A"], 0.2, n["m"],
                                            rejection_sampling=kwargs)
    close(stat["behave_imp_weight"], bw)
    got = run(config)
    if kwargs["action"] == "mask":
        assert 0 < mask.sum() < valid.sum(), "the row rejects some tokens on this batch"
    else:
        raw = np.exp((n["old"] - n["roll"]) if kwargs["level"] == "token" else
                     np.broadcast_to(((n["old"] - n["roll"]) * n["m"]).sum(-1, keepdims=True)
                                     / n["m"].sum(-1, keepdims=True), valid.shape))
        assert (valid & ~np.isclose(bw, raw)).any(), "the clamp changes some weights on this batch"
        np.testing.assert_array_equal(mask, valid)
    if config.rejection:
        same_mask(got.mask, mask)
        close(got.weights, bw, where=valid, what="weights (0 at the tokens AReaL rejects)")
    else:  # no rule: AReaL's rejected tokens are Tether's zero weights (overflow="mask") in the same loss
        same_mask(got.mask, valid)
        close(got.weights, bw, where=valid, what="weights (0 where AReaL rejects)")
    close(got.per_token, stat["loss"], where=mask, what="per-token loss on kept tokens")
    close(got.loss, want, what="loss over the original count")
