"""NumPy float64 port of slime's PPO / TIS / IcePop / OPSM / MIS code.

Re-checked line by line against THUDM/slime @ 624b824a8 (slime/utils/ppo_utils.py, slime/backends/megatron_utils/
loss.py) and PR #2084 @ 8e0d556e (``off_policy_is_function``, slime/utils/ppo_utils.py): ``compute_opsm_mask``
(624b824a: the per-token decision NOT multiplied by the loss mask), ``compute_approx_kl`` (``importance_ratio``:
``use_unbiased_kl``), ``vanilla_tis_function`` / ``icepop_function`` / ``off_policy_is_function`` (all clamp or
mask to ``[tis_clip_low, tis_clip]``; metrics ``tis`` / ``tis_clipfrac`` / ``tis_abs``) and
``policy_loss_function`` are from those commits.

Sources first read (via the code index):
- THUDM/slime slime/utils/ppo_utils.py              @ 06787cf5798525d9af068135ade88dc795d75821
  (compute_approx_kl, compute_opsm_mask [current, per-token advantage * effective mask], compute_gspo_kl,
  compute_policy_loss)
- THUDM/slime slime/backends/megatron_utils/loss.py @ 00c2d6db0f23a4900be6e80a8eb81eebf9e1ebff
  (policy_loss_function order: pg_loss -> * opsm_mask -> tis_func; vanilla_tis/icepop via importance_weights)
- THUDM/slime examples/train_infer_mismatch_helper/mis.py @ 141e5efce1f087137c14fc95dd0bbaee13ff5910
- older compute_opsm_mask (no loss-mask product) and compute_cispo_loss: slime ppo_utils.py excerpts in the
  index (ids 61362527052, 66779895553; repo/commit not returned by the index)
- off_policy_is_function (slime PR #2084) / vanilla_tis_function / icepop_function standalone module: index id
  55717690691 (repo/path/commit not returned)
- get_sum_of_sample_mean (cp_size == 1 branch): slime cp_utils.py excerpts (ids 66713823494, 52532032594)
- OPSM fix: THUDM/slime PR #1917 (OPEN, not merged) -- ``compute_opsm_mask_pr1917`` is FROM THE PR DESCRIPTION,
  source diff not found.
- defaults: --tis-clip 2.0, --tis-clip-low 0, --opsm-delta 1e-4 (slime/utils/arguments.py excerpts).

slime works on lists of 1-D per-sample tensors concatenated along dim 0; this port uses [B, T] arrays with a
mask (padding rows must be masked out). slime does NOT clamp exp() in compute_policy_loss / TIS (overflow to
inf is faithful; numpy warnings are silenced).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

_ERR = dict(over="ignore", invalid="ignore")


def compute_approx_kl(log_probs, log_probs_base, kl_loss_type, importance_ratio=None):
    """Port of ppo_utils.compute_approx_kl (k1, k2, k3/low_var_kl = exp(-l)-1+l; clamp only low_var_kl, after the
    ``importance_ratio`` product: ``use_unbiased_kl`` passes exp(log_probs - old_log_probs), with gradient).
    Re-checked for issue 30 against slime/utils/ppo_utils.py:12-48 at 624b824a: k1 and k2 take the log-ratio
    unclamped."""
    lr = np.asarray(log_probs, dtype=np.float64) - np.asarray(log_probs_base, dtype=np.float64)
    if kl_loss_type == "k1":
        kl = lr
    elif kl_loss_type == "k2":
        kl = lr ** 2 / 2.0
    elif kl_loss_type in ("k3", "low_var_kl"):
        with np.errstate(**_ERR):
            kl = np.exp(-lr) - 1 + lr
    else:
        raise ValueError(f"Unknown kl_loss_type: {kl_loss_type}")
    if importance_ratio is not None:
        kl = importance_ratio * kl
    if kl_loss_type == "low_var_kl":
        kl = np.clip(kl, -10, 10)
    return kl


def compute_policy_loss(ppo_kl, advantages, eps_clip, eps_clip_high, eps_clip_c=None):
    """Port of ppo_utils.compute_policy_loss: ratio = exp(-ppo_kl) (no clamp) -> (per-token loss, clipfrac)."""
    A = np.asarray(advantages, dtype=np.float64)
    with np.errstate(**_ERR):
        ratio = np.exp(-np.asarray(ppo_kl, dtype=np.float64))
        l1, l2 = -ratio * A, -np.clip(ratio, 1 - eps_clip, 1 + eps_clip_high) * A
    c1 = np.maximum(l1, l2)
    clipfrac = (l2 > l1).astype(np.float64)
    if eps_clip_c is not None:
        assert eps_clip_c > 1.0
        pg = np.where(A < 0, np.minimum(-eps_clip_c * A, c1), c1)
    else:
        pg = c1
    return pg, clipfrac


def compute_cispo_loss(ppo_kl, log_probs, advantages, eps_clip, eps_clip_high):
    """Port of ppo_utils.compute_cispo_loss: -sg(clamp(exp(-ppo_kl), 1-eps, 1+eps_high)) * A * log_probs."""
    with np.errstate(**_ERR):
        ratio = np.exp(-np.asarray(ppo_kl, dtype=np.float64))
    rt = np.clip(ratio, 1.0 - eps_clip, 1.0 + eps_clip_high)
    return -rt * np.asarray(advantages) * np.asarray(log_probs), (rt != ratio).astype(np.float64)


def compute_gspo_kl(full_log_probs, full_old_log_probs, loss_masks):
    """Port of ppo_utils.compute_gspo_kl: per-seq mean(old - lp) over mask (clamp_min 1), broadcast per token."""
    m = np.asarray(loss_masks, dtype=np.float64)
    d = (np.asarray(full_old_log_probs) - np.asarray(full_log_probs)) * m
    kl = d.sum(-1) / np.maximum(m.sum(-1), 1)
    return np.broadcast_to(kl[:, None], m.shape).copy()


def compute_opsm_mask(advantages, full_log_probs, full_old_log_probs, loss_masks, opsm_delta=1e-4, sample_mask=None):
    """Port of ppo_utils.compute_opsm_mask @ 624b824a -> (opsm_mask [B,T], opsm_clipfrac): per sample,
    mask = (advantage < 0) & (seq_kl > delta) over every position of the sample (NOT multiplied by the loss
    mask); clipfrac += mask.sum() / clamp_min(loss_mask.sum(), 1). ``sample_mask`` marks the positions that
    exist in each sample ([B, T] rows of different lengths; default: the loss mask)."""
    m = np.asarray(loss_masks, dtype=np.float64)
    exists = m if sample_mask is None else np.asarray(sample_mask, dtype=np.float64)
    seq_kl = compute_gspo_kl(full_log_probs, full_old_log_probs, m)
    mask = ((np.asarray(advantages) < 0) & (seq_kl > opsm_delta)).astype(np.float64) * exists
    clipfrac = float((mask.sum(-1) / np.maximum(m.sum(-1), 1)).sum())
    return 1 - mask, clipfrac


def compute_opsm_mask_06787cf5(advantages, full_log_probs, full_old_log_probs, loss_masks, opsm_delta=1e-4):
    """Port of ppo_utils.compute_opsm_mask @ 06787cf5 -> (opsm_mask [B,T], opsm_clipfrac).

    BUG kept: the decision uses the PER-TOKEN advantage sign (advantage < 0) with the sequence KL, so a mixed-sign
    sequence is only partly masked. mask = (A<0 & seq_kl>delta) * loss_mask; clipfrac = sum_b masked_b/max(n_b,1).
    """
    m = np.asarray(loss_masks, dtype=np.float64)
    seq_kl = compute_gspo_kl(full_log_probs, full_old_log_probs, m)
    mask = ((np.asarray(advantages) < 0) & (seq_kl > opsm_delta)).astype(np.float64) * m
    clipfrac = float((mask.sum(-1) / np.maximum(m.sum(-1), 1)).sum())
    return 1 - mask, clipfrac


def compute_opsm_mask_legacy(advantages, full_log_probs, full_old_log_probs, loss_masks, opsm_delta=1e-4):
    """Port of the older ppo_utils.compute_opsm_mask (PR #999 era): same per-token bug and the mask is NOT
    multiplied by loss_mask (masked positions with A<0 also flagged); clipfrac += mask.sum()/clamp(n,1)."""
    m = np.asarray(loss_masks, dtype=np.float64)
    seq_kl = compute_gspo_kl(full_log_probs, full_old_log_probs, m)
    mask = ((np.asarray(advantages) < 0) & (seq_kl > opsm_delta)).astype(np.float64)
    clipfrac = float((mask.sum(-1) / np.maximum(m.sum(-1), 1)).sum())
    return 1 - mask, clipfrac


def compute_opsm_mask_pr1917(advantages, full_log_probs, full_old_log_probs, loss_masks, opsm_delta=1e-4):
    """From the spec (slime PR #1917 description; source diff not found): sequence decision
    mean_valid(A) < 0 and mean_valid(old - lp) > delta (masked deltas zeroed with where), broadcast to every token."""
    m = np.asarray(loss_masks, dtype=np.float64)
    mb = m.astype(bool)
    n = np.maximum(m.sum(-1), 1)
    seq_kl = np.where(mb, np.asarray(full_old_log_probs) - np.asarray(full_log_probs), 0.0).sum(-1) / n
    seq_adv = np.where(mb, np.asarray(advantages), 0.0).sum(-1) / n
    drop = ((seq_adv < 0) & (seq_kl > opsm_delta)).astype(np.float64)
    mask = drop[:, None] * m
    return 1 - np.broadcast_to(drop[:, None], m.shape), float((mask.sum(-1) / n).sum())


def importance_weights(ratio, mode="tis", low=0.0, high=2.0):
    """Port of the loss.py helper as used by vanilla_tis ('tis': clamp) and icepop ('mis': zero outside, inclusive).
    (Helper body not read; semantics taken from the standalone vanilla_tis_function / icepop_function.)"""
    r = np.asarray(ratio, dtype=np.float64)
    if mode == "tis":
        return np.clip(r, low, high)
    if mode == "mis":
        return np.where((r >= low) & (r <= high), r, 0.0)
    raise ValueError(mode)


def vanilla_tis_function(pg_loss, train_log_probs, rollout_log_probs, loss_masks, tis_clip=2.0, tis_clip_low=0.0):
    """Port of loss.vanilla_tis_function: pg_loss * clamp(exp(train - rollout), tis_clip_low, tis_clip).

    Returns (pg_loss, loss_masks unchanged, per-token metrics tis / tis_clipfrac / tis_abs)."""
    with np.errstate(**_ERR):
        tis = np.exp(np.asarray(train_log_probs) - np.asarray(rollout_log_probs))
    w = np.clip(tis, tis_clip_low, tis_clip)
    return pg_loss * w, loss_masks, {"tis": tis, "tis_clipfrac": (w != tis) * 1.0, "tis_abs": np.abs(tis - 1)}


def icepop_function(pg_loss, train_log_probs, rollout_log_probs, loss_masks, tis_clip=2.0, tis_clip_low=0.0):
    """Port of loss.icepop_function: weight = r if tis_clip_low <= r <= tis_clip else 0; mask unchanged."""
    with np.errstate(**_ERR):
        r = np.exp(np.asarray(train_log_probs) - np.asarray(rollout_log_probs))
    w = np.where((r >= tis_clip_low) & (r <= tis_clip), r, 0.0)
    return pg_loss * w, loss_masks, {"tis": r, "tis_clipfrac": (w != r) * 1.0, "tis_abs": np.abs(r - 1)}


def off_policy_is_function(pg_loss, cur_log_probs, rollout_log_probs, loss_masks, tis_clip=2.0, tis_clip_low=0.0):
    """Port of ppo_utils.off_policy_is_function @ 8e0d556e (slime PR #2084): the weight
    clamp(exp(sg(cur) - rollout), tis_clip_low, tis_clip) multiplies the NORMAL pg_loss (PPO, or CISPO); masks
    unchanged; metrics tis / tis_clipfrac / tis_abs like vanilla TIS."""
    with np.errstate(**_ERR):
        tis = np.exp(np.asarray(cur_log_probs) - np.asarray(rollout_log_probs))
    w = np.clip(tis, tis_clip_low, tis_clip)
    return pg_loss * w, loss_masks, {"tis": tis, "tis_clipfrac": (w != tis) * 1.0, "tis_abs": np.abs(tis - 1)}


def get_sum_of_sample_mean(loss_masks, calculate_per_token_loss=False, sample_denoms=None):
    """Port of cp_utils.get_sum_of_sample_mean (cp_size == 1): returns f(x) = sum_b sum_t x m / denom_b,
    denom_b = clamp_min(sample_denoms_b or m_b.sum(), 1); per-token mode: sum_b sum_t x m."""
    m = np.asarray(loss_masks, dtype=np.float64)
    den = m.sum(-1) if sample_denoms is None else np.asarray(sample_denoms, dtype=np.float64)

    def sum_of_sample_mean(x):
        return float(((np.asarray(x) * m).sum(-1) / np.maximum(den, 1)).sum())

    def sum_of_token(x):
        return float((np.asarray(x) * m).sum())

    return sum_of_token if calculate_per_token_loss else sum_of_sample_mean


def policy_loss_function(log_probs, old_log_probs, advantages, loss_masks, rollout_log_probs=None, *,
                         eps_clip=0.2, eps_clip_high=None, eps_clip_c=None, pg_loss_type="ppo",
                         advantage_estimator="grpo", use_opsm=False, opsm_delta=1e-4, use_tis=False,
                         tis_func=vanilla_tis_function, tis_clip=2.0, tis_clip_low=0.0, train_log_probs=None):
    """Port of the pg-loss part of loss.policy_loss_function (cp_size 1, no entropy/KL terms).

    Order: ppo_kl (gspo: sequence KL) -> pg_loss -> *opsm_mask -> tis_func -> reducer. With TIS the reducer's
    numerator uses the masks returned by tis_func but the denominators stay the ORIGINAL mask counts (newest slime
    passes per-ROLLOUT totals ``rollout_mask_sums``; this port uses per-sample original counts, pass
    ``sample_denoms`` to get_sum_of_sample_mean yourself for the per-rollout variant).
    Returns (pg_loss as sum of sample means [before megatron's global rescale], metrics).
    """
    eps_clip_high = eps_clip if eps_clip_high is None else eps_clip_high
    m = np.asarray(loss_masks, dtype=np.float64)
    lp, old = np.asarray(log_probs, dtype=np.float64), np.asarray(old_log_probs, dtype=np.float64)
    ppo_kl = compute_gspo_kl(lp, old, m) if advantage_estimator == "gspo" else old - lp
    if pg_loss_type == "reinforce":
        pg, clipfrac = -np.asarray(advantages) * lp, np.zeros_like(lp)
    elif pg_loss_type == "cispo":
        pg, clipfrac = compute_cispo_loss(ppo_kl, lp, advantages, eps_clip, eps_clip_high)
    else:
        pg, clipfrac = compute_policy_loss(ppo_kl, advantages, eps_clip, eps_clip_high, eps_clip_c)
    metrics: dict[str, Any] = {}
    if use_opsm:
        opsm, metrics["opsm_clipfrac"] = compute_opsm_mask(advantages, lp, old, m, opsm_delta)
        pg = pg * opsm
    reducer = get_sum_of_sample_mean(m)
    if use_tis:
        tl = train_log_probs if train_log_probs is not None else old
        numerator = lp if tis_func is off_policy_is_function else tl  # PR #2084 passes cur_log_probs
        pg, new_m, tm = tis_func(pg, numerator, rollout_log_probs, m, tis_clip, tis_clip_low)
        metrics.update({k: reducer(v) for k, v in tm.items()})
        pg_reducer = get_sum_of_sample_mean(new_m, sample_denoms=m.sum(-1))
    else:
        pg_reducer = reducer
    # after TIS the rebuilt reducer is also used for pg_clipfrac / ppo_kl (tis metrics use the original one)
    metrics.update(pg_clipfrac=pg_reducer(clipfrac), ppo_kl=pg_reducer(ppo_kl))
    return pg_reducer(pg), metrics


def unbiased_kl_loss(log_probs, old_log_probs, ref_log_probs, kl_loss_type, loss_masks, use_unbiased_kl=True):
    """The KL part of loss.policy_loss_function (cp_size 1): sum of sample means of compute_approx_kl, with
    importance_ratio = exp(log_probs - old_log_probs) when ``use_unbiased_kl``."""
    with np.errstate(**_ERR):
        ratio = np.exp(np.asarray(log_probs) - np.asarray(old_log_probs)) if use_unbiased_kl else None
    kl = compute_approx_kl(log_probs, ref_log_probs, kl_loss_type, importance_ratio=ratio)
    return get_sum_of_sample_mean(loss_masks)(kl)


# ----------------------------------------------------------------------------- examples/.../mis.py
def masked_sum(x, loss_mask, expand=False):
    """Port of mis.masked_sum on one 1-D sequence."""
    r = (np.asarray(x) * loss_mask).sum()
    return np.full(np.shape(x), r) if expand else r


def masked_mean(x, loss_mask, expand=False):
    """Port of mis.masked_mean on one 1-D sequence (clamp_min(n, 1))."""
    r = masked_sum(x, loss_mask) / max(np.sum(loss_mask), 1)
    return np.full(np.shape(x), r) if expand else r


def calculate_veto_mask(log_ratio, loss_mask, veto_threshold):
    """Port of mis.calculate_veto_mask (one sequence): veto if ANY valid token has log_ratio < log(threshold).
    Only a LOW veto (no upper veto)."""
    if veto_threshold is None:
        return np.ones_like(log_ratio)
    cat = (np.asarray(log_ratio) < np.log(veto_threshold)) & np.asarray(loss_mask).astype(bool)
    return np.full(np.shape(log_ratio), float(not cat.any()))


def truncate(weights, loss_mask, upper_bound):
    """Port of mis.truncate: clamp(0, upper) * loss_mask."""
    return np.clip(weights, 0, upper_bound) * loss_mask


def clip(weights, loss_mask, lower_bound, upper_bound):
    """Port of mis.clip: clamp(lower, upper) * loss_mask."""
    assert lower_bound < upper_bound
    return np.clip(weights, lower_bound, upper_bound) * loss_mask


def mask(weights, loss_mask, lower_bound, upper_bound):
    """Port of mis.mask -> (weights * loss_mask, loss_mask * [lower <= w <= upper])."""
    assert lower_bound < upper_bound
    inr = (weights >= lower_bound) & (weights <= upper_bound)
    return weights * loss_mask, loss_mask * inr


def compute_mis_weights(train_log_probs, rollout_log_probs, loss_masks, mis_level="token", mis_mode="truncate",
                        mis_upper_bound=2.0, mis_lower_bound=0.5, mis_veto_threshold=None):
    """Port of mis.compute_mis_weights over rows of [B, T] arrays -> (weights [B,T], modified_masks [B,T]).

    Levels: token | sequence (masked sum of log ratios) | geometric (masked mean); exp of clamp(+-20).
    Modes: truncate | mask | clip. Veto (low only) multiplies the mask. Defaults here are NOT from source (mis.py
    reads args.*); BUG kept: mis_lower_bound None returns the float 1/upper instead of weights.
    """
    if mis_lower_bound is None:
        return 1.0 / mis_upper_bound
    W, M = [], []
    for tr, ro, lm in zip(np.asarray(train_log_probs, dtype=np.float64), np.asarray(rollout_log_probs,
                                                                                     dtype=np.float64),
                          np.asarray(loss_masks, dtype=np.float64)):
        raw = tr - ro
        if mis_level == "token":
            lrm = raw
        elif mis_level == "sequence":
            lrm = masked_sum(raw, lm, expand=True)
        elif mis_level == "geometric":
            lrm = masked_mean(raw, lm, expand=True)
        else:
            raise ValueError(f"Invalid importance sampling level: {mis_level}")
        w = np.exp(np.clip(lrm, -20.0, 20.0))
        mm = lm.copy()
        if mis_mode == "truncate":
            w = truncate(w, lm, mis_upper_bound)
        elif mis_mode == "mask":
            w, mm = mask(w, lm, mis_lower_bound, mis_upper_bound)
        elif mis_mode == "clip":
            w = clip(w, lm, mis_lower_bound, mis_upper_bound)
        else:
            raise ValueError(f"Unsupported mis_mode: {mis_mode}")
        if mis_veto_threshold is not None:
            mm = mm * calculate_veto_mask(raw, lm, mis_veto_threshold)
        W.append(w)
        M.append(mm)
    return np.stack(W), np.stack(M)
