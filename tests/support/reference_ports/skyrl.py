"""NumPy float64 port of SkyRL's off-policy correction and PPO-loss code.

Re-checked line by line against NovaSky-AI/SkyRL @ a9564572 (skyrl/backends/skyrl_train/utils/
off_policy_correction_utils.py and ppo_utils.py): the functions below match it; ``compute_policy_loss_cispo`` gained
``cispo/ratio_max`` / ``cispo/ratio_min`` (over the loss mask) there.

Sources first read (via the code index):
- zhudotexe/SkyRL (fork of NovaSky-AI/SkyRL main)
  skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py @ 3ee2adc70ce8b8eeb21c1ebed2239e3d84f1f49d
  (the version with ``off_policy_correction_enabled`` and ``token_mask_is_threshold_low/high``, matching the
  current upstream config names; ported as the default functions below)
- NovaSky-AI/SkyRL same path @ e9bca5e78f42b8da9dd05cf24a41253d5ef86674 (older: outlier mask always applied,
  ``token_mask_eps_low/high`` used as ABSOLUTE ratio bounds) -> ``compute_token_mask_eps_absolute``,
  ``compute_off_policy_correction_e9bca5e``
- NovaSky-AI/SkyRL skyrl-train/skyrl_train/utils/off_policy_correction_utils.py @ bda5c313a4b28a3599b25d757ca739395611b0bd
  (oldest: token mask keeps ``1-eps_low <= r <= 1+eps_high``) -> ``compute_token_mask_eps_relative``
- NovaSky-AI/SkyRL skyrl/backends/skyrl_train/utils/ppo_utils.py @ 03d74caf596391a62a53528ca9d23a51baffae3c
- NovaSky-AI/SkyRL skyrl/backends/skyrl_train/utils/torch_utils.py @ 14143cc7f8b0daa81efbdfd172cbaf5bcb732a4c
- config defaults: SkyRL config dataclasses (index excerpts; repo/commit not returned for those ids).

Config dicts replace DictConfig; missing keys take DEFAULT_* below. ``safe_exp_delta`` casts to float32 in
SkyRL; this port stays in float64. Reduction: ``reduce_loss`` is a plain SUM; the mean comes from advantages
pre-scaled by ``apply_loss_reduction_to_advantages_minibatch`` with the ORIGINAL loss mask (so rejected tokens
still count in the denominator). clip_cov / kl_cov do NOT apply off-policy correction.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

DEFAULT_OFF_POLICY_CORRECTION = dict(
    tis_ratio_type=None, token_tis_ratio_clip_high=2.0, sequence_tis_ratio_clip_high=5.0,
    sequence_mask_metric=None, geo_mask_high=1.01, geo_mask_low=0.99, product_mask_high=2.0, product_mask_low=0.5,
    outlier_token_is_threshold_low=None, outlier_token_is_threshold_high=None,
    token_mask_is_threshold_low=None, token_mask_is_threshold_high=None,
)
DEFAULT_ALGORITHM = dict(
    policy_loss_type="regular", loss_reduction="token_mean", eps_clip_low=0.2, eps_clip_high=0.2, clip_ratio_c=3.0,
    clip_cov=dict(clip_ratio=0.0002, clip_cov_lb=1.0, clip_cov_ub=5.0),
    kl_cov=dict(kl_cov_frac=0.2, ppo_kl_coef=1.0),
    # newest config: low 1.0 / high 4.0 (clamp [0, 5]); older configs had 0.0 / 5.0 (clamp [1, 6]).
    cispo=dict(cispo_eps_clip_low=1.0, cispo_eps_clip_high=4.0, cispo_anchor="old"),
    sapo=dict(tau_pos=1.0, tau_neg=1.05),
)


def _opc(cfg):
    out = dict(DEFAULT_OFF_POLICY_CORRECTION)
    out.update(cfg or {})
    return out


def _alg(cfg):
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in DEFAULT_ALGORITHM.items()}
    for k, v in (cfg or {}).items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k].update(v)
        else:
            out[k] = v
    out["off_policy_correction"] = _opc(out.get("off_policy_correction"))
    return out


# ----------------------------------------------------------------------------- torch_utils
def masked_mean(tensor, mask, dim=None):
    """Port of torch_utils.masked_mean: sum(t*mask) / clamp(mask.sum(), min=1)."""
    tensor = np.asarray(tensor, dtype=np.float64)
    if mask is None:
        return tensor.mean(axis=dim)
    mask = np.asarray(mask, dtype=np.float64)
    return (tensor * mask).sum(axis=dim) / np.maximum(mask.sum(axis=dim), 1.0)


def safe_exp_delta(delta, clip=20.0):
    """Port of torch_utils.safe_exp_delta: exp(clamp(delta, -clip, clip)) (float32 in SkyRL)."""
    return np.exp(np.clip(np.asarray(delta, dtype=np.float64), -clip, clip))


def masked_var(values, mask, unbiased=True):
    """Port of ppo_utils.masked_var (uses SkyRL's clamp(1) masked_mean)."""
    mask = np.asarray(mask, dtype=np.float64)
    mean = masked_mean(values, mask)
    variance = masked_mean((np.asarray(values) - mean) ** 2, mask)
    if unbiased:
        s = mask.sum()
        if s == 0:
            raise ValueError("At least one element in the mask has to be 1.")
        if s == 1:
            raise ValueError("The sum of the mask is one, which can cause a division by zero.")
        variance = variance * s / (s - 1)
    return variance


def masked_whiten(values, mask, shift_mean=True):
    """Port of ppo_utils.masked_whiten."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    w = (np.asarray(values) - mean) / np.sqrt(var + 1e-8)
    return w if shift_mean else w + mean


# ----------------------------------------------------------------------------- off-policy correction
def off_policy_correction_enabled(off_policy_correction):
    """Port of off_policy_correction_utils.off_policy_correction_enabled (token mask needs BOTH bounds)."""
    c = _opc(off_policy_correction)
    return (c["tis_ratio_type"] is not None or c["sequence_mask_metric"] is not None
            or c["outlier_token_is_threshold_low"] is not None or c["outlier_token_is_threshold_high"] is not None
            or (c["token_mask_is_threshold_low"] is not None and c["token_mask_is_threshold_high"] is not None))


def compute_tis_ratio(old_log_probs, rollout_logprobs, loss_mask, tis_ratio_type, off_policy_correction):
    """Port of off_policy_correction_utils.compute_tis_ratio -> (ratio [B,T] or [B,1], metrics)."""
    c = _opc(off_policy_correction)
    lr = np.asarray(old_log_probs) - np.asarray(rollout_logprobs)
    loss_mask = np.asarray(loss_mask, dtype=np.float64)
    tok = safe_exp_delta(lr)
    if tis_ratio_type == "token":
        cap = c["token_tis_ratio_clip_high"]
        capped = (tok > cap) & (loss_mask > 0)
        frac = capped.sum() / max((loss_mask > 0).sum(), 1)
        return np.minimum(tok, cap), {"tis_token_clip_high_ratio": float(frac)}
    if tis_ratio_type == "sequence":
        seq = safe_exp_delta((lr * loss_mask).sum(-1, keepdims=True))
        cap = c["sequence_tis_ratio_clip_high"]
        return np.minimum(seq, cap), {"tis_seq_clip_high_ratio": float((seq > cap).sum() / seq.shape[0])}
    raise ValueError(f"Unknown tis_ratio_type: {tis_ratio_type}")


def compute_outlier_token_mask(old_log_probs, rollout_logprobs, loss_mask, off_policy_correction):
    """Port of off_policy_correction_utils.compute_outlier_token_mask -> ([B,1] keep, metrics). Strict bounds."""
    c = _opc(off_policy_correction)
    loss_mask = np.asarray(loss_mask, dtype=np.float64)
    r = safe_exp_delta(np.asarray(old_log_probs) - np.asarray(rollout_logprobs))
    lo, hi = c["outlier_token_is_threshold_low"], c["outlier_token_is_threshold_high"]
    over = (r > hi) & (loss_mask > 0) if hi is not None else np.zeros(r.shape, bool)
    under = (r < lo) & (loss_mask > 0) if lo is not None else np.zeros(r.shape, bool)
    ok = ((~over & ~under) | (loss_mask == 0)).all(-1, keepdims=True)
    n = float(ok.shape[0])
    return ok.astype(np.float64), {"outlier_seq_masked_ratio": float((~ok[:, 0]).sum() / n),
                                   "outlier_seq_over_high_ratio": float(over.any(-1).sum() / n),
                                   "outlier_seq_under_low_ratio": float(under.any(-1).sum() / n)}


def compute_token_mask(old_log_probs, rollout_logprobs, loss_mask, off_policy_correction):
    """Port of off_policy_correction_utils.compute_token_mask (current): keep lo <= r <= hi (inclusive)."""
    c = _opc(off_policy_correction)
    loss_mask = np.asarray(loss_mask, dtype=np.float64)
    r = safe_exp_delta(np.asarray(old_log_probs) - np.asarray(rollout_logprobs))
    inb = (r >= c["token_mask_is_threshold_low"]) & (r <= c["token_mask_is_threshold_high"])
    tm = (inb | (loss_mask == 0)).astype(np.float64)
    frac = ((~inb) & (loss_mask > 0)).sum() / max((loss_mask > 0).sum(), 1)
    return tm, {"token_mask_ratio": float(frac)}


def compute_token_mask_eps_absolute(old_log_probs, rollout_logprobs, loss_mask, token_mask_eps_low,
                                    token_mask_eps_high):
    """Port of compute_token_mask @ NovaSky e9bca5e7 (``token_mask_eps_*`` used as absolute bounds) ->
    (updated_loss_mask, metrics)."""
    metrics: dict[str, float] = {}
    loss_mask = np.asarray(loss_mask, dtype=np.float64)
    if token_mask_eps_low is None and token_mask_eps_high is None:
        return loss_mask, metrics
    r = safe_exp_delta(np.asarray(old_log_probs) - np.asarray(rollout_logprobs))
    valid = loss_mask > 0
    total = max(valid.sum(), 1)
    keep = np.ones(r.shape, bool)
    if token_mask_eps_low is not None:
        under = (r < token_mask_eps_low) & valid
        keep &= ~under
        metrics["token_mask_under_low_ratio"] = float(under.sum() / total)
    if token_mask_eps_high is not None:
        over = (r > token_mask_eps_high) & valid
        keep &= ~over
        metrics["token_mask_over_high_ratio"] = float(over.sum() / total)
    metrics["token_mask_masked_ratio"] = float((valid & ~keep).sum() / total)
    return loss_mask * keep, metrics


def compute_token_mask_eps_relative(old_log_probs, rollout_logprobs, loss_mask, token_mask_eps_low,
                                    token_mask_eps_high):
    """Port of compute_token_mask @ skyrl-train bda5c313: keep 1-eps_low <= r <= 1+eps_high."""
    loss_mask = np.asarray(loss_mask, dtype=np.float64)
    r = safe_exp_delta(np.asarray(old_log_probs) - np.asarray(rollout_logprobs))
    inb = (r >= 1 - token_mask_eps_low) & (r <= 1 + token_mask_eps_high)
    frac = ((~inb) & (loss_mask > 0)).sum() / max((loss_mask > 0).sum(), 1)
    return (inb | (loss_mask == 0)).astype(np.float64), {"token_mask_ratio": float(frac)}


def compute_sequence_mask(old_log_probs, rollout_logprobs, loss_mask, sequence_mask_metric, off_policy_correction):
    """Port of off_policy_correction_utils.compute_sequence_mask -> ([B,1] keep, metrics). Inclusive bounds.

    A fully masked row has log-ratio sum 0 -> ratio 1, kept iff 1 is inside the bounds.
    """
    c = _opc(off_policy_correction)
    loss_mask = np.asarray(loss_mask, dtype=np.float64)
    lr = np.asarray(old_log_probs) - np.asarray(rollout_logprobs)
    s = (lr * loss_mask).sum(-1, keepdims=True)
    if sequence_mask_metric == "geometric":
        v = safe_exp_delta(s / np.maximum(loss_mask.sum(-1, keepdims=True), 1.0))
        hi, lo, p = c["geo_mask_high"], c["geo_mask_low"], "geo_sequence_mask"
    elif sequence_mask_metric == "product":
        v = safe_exp_delta(s)
        hi, lo, p = c["product_mask_high"], c["product_mask_low"], "product_sequence_mask"
    else:
        raise ValueError(f"Unknown sequence_mask_metric: {sequence_mask_metric}")
    over, under = v > hi, v < lo
    keep = ~over & ~under
    n = float(v.shape[0])
    return keep.astype(np.float64), {f"{p}_masked_ratio": float((~keep).sum() / n),
                                     f"{p}_over_high_ratio": float(over.sum() / n),
                                     f"{p}_under_low_ratio": float(under.sum() / n)}


def _is_ratio_metrics(old_log_probs, rollout_logprobs, loss_mask):
    r = safe_exp_delta(np.asarray(old_log_probs) - np.asarray(rollout_logprobs))
    rm = r * loss_mask
    # quirks: std over ALL positions (torch unbiased); min is 0 whenever there is padding.
    return {"is_ratio_mean": float(masked_mean(r, loss_mask)), "is_ratio_std": float(np.std(rm, ddof=1)),
            "is_ratio_max": float(rm.max()), "is_ratio_min": float(rm.min())}


def compute_off_policy_correction(old_log_probs, rollout_logprobs, loss_mask, off_policy_correction):
    """Port of off_policy_correction_utils.compute_off_policy_correction (current) -> (tis_ratio|None, metrics,
    loss_mask). Order: outlier mask -> token mask -> TIS over surviving mask -> sequence mask over surviving mask."""
    c = _opc(off_policy_correction)
    loss_mask = np.asarray(loss_mask, dtype=np.float64)
    if not off_policy_correction_enabled(c):
        return None, {}, loss_mask
    metrics = _is_ratio_metrics(old_log_probs, rollout_logprobs, loss_mask)
    if c["outlier_token_is_threshold_low"] is not None or c["outlier_token_is_threshold_high"] is not None:
        om, mm = compute_outlier_token_mask(old_log_probs, rollout_logprobs, loss_mask, c)
        loss_mask = loss_mask * om
        metrics.update(mm)
    if c["token_mask_is_threshold_low"] is not None and c["token_mask_is_threshold_high"] is not None:
        tm, mm = compute_token_mask(old_log_probs, rollout_logprobs, loss_mask, c)
        loss_mask = loss_mask * tm
        metrics.update(mm)
    tis = None
    if c["tis_ratio_type"] is not None:
        tis, mm = compute_tis_ratio(old_log_probs, rollout_logprobs, loss_mask, c["tis_ratio_type"], c)
        metrics.update(mm)
    if c["sequence_mask_metric"] is not None:
        sm, mm = compute_sequence_mask(old_log_probs, rollout_logprobs, loss_mask, c["sequence_mask_metric"], c)
        loss_mask = loss_mask * sm
        metrics.update(mm)
    return tis, metrics, loss_mask


def compute_off_policy_correction_e9bca5e(old_log_probs, rollout_logprobs, loss_mask, off_policy_correction):
    """Port of compute_off_policy_correction @ NovaSky e9bca5e7: no-op unless TIS or sequence mask is set;
    outlier mask always applied then (no-op when both thresholds None); token_mask_eps_* absolute bounds."""
    c = _opc(off_policy_correction)
    loss_mask = np.asarray(loss_mask, dtype=np.float64)
    if c["tis_ratio_type"] is None and c["sequence_mask_metric"] is None:
        return None, {}, loss_mask
    metrics = _is_ratio_metrics(old_log_probs, rollout_logprobs, loss_mask)
    om, mm = compute_outlier_token_mask(old_log_probs, rollout_logprobs, loss_mask, c)
    loss_mask = loss_mask * om
    metrics.update(mm)
    lo, hi = c.get("token_mask_eps_low"), c.get("token_mask_eps_high")
    if lo is not None or hi is not None:
        loss_mask, mm = compute_token_mask_eps_absolute(old_log_probs, rollout_logprobs, loss_mask, lo, hi)
        metrics.update(mm)
    tis = None
    if c["tis_ratio_type"] is not None:
        tis, mm = compute_tis_ratio(old_log_probs, rollout_logprobs, loss_mask, c["tis_ratio_type"], c)
        metrics.update(mm)
    if c["sequence_mask_metric"] is not None:
        sm, mm = compute_sequence_mask(old_log_probs, rollout_logprobs, loss_mask, c["sequence_mask_metric"], c)
        loss_mask = loss_mask * sm
        metrics.update(mm)
    return tis, metrics, loss_mask


def apply_off_policy_correction(loss, old_log_probs, rollout_logprobs, loss_mask, off_policy_correction):
    """Port of off_policy_correction_utils.apply_off_policy_correction -> (loss * tis, loss_mask, metrics)."""
    metrics: dict[str, float] = {}
    if rollout_logprobs is not None:
        tis, m, loss_mask = compute_off_policy_correction(old_log_probs, rollout_logprobs, loss_mask,
                                                          off_policy_correction)
        if tis is not None:
            loss = loss * tis
        metrics.update(m)
    return loss, loss_mask, metrics


# ----------------------------------------------------------------------------- reductions
def reduce_loss(loss, loss_mask):
    """Port of ppo_utils.reduce_loss: plain masked SUM."""
    return (loss * loss_mask).sum() if loss_mask is not None else np.sum(loss)


def apply_loss_reduction_to_advantages_minibatch(advantages, loss_mask, loss_reduction, micro_batch_size=None,
                                                 max_seq_len=None, prompt_boundaries=None):
    """Port of ppo_utils.apply_loss_reduction_to_advantages_minibatch (uses the pre-correction loss mask)."""
    A = np.asarray(advantages, dtype=np.float64)
    m = np.asarray(loss_mask, dtype=np.float64)
    B = A.shape[0]
    if loss_reduction == "token_mean":
        return A / max(m.sum(), 1)
    if loss_reduction == "token_mean_legacy":
        out = np.zeros_like(A)
        n = B // micro_batch_size
        for i in range(n):
            s = slice(i * micro_batch_size, (i + 1) * micro_batch_size)
            out[s] = A[s] / max(m[s].sum(), 1) / n
        return out
    if loss_reduction == "sequence_mean":
        return A / (B * np.maximum(m.sum(-1, keepdims=True), 1))
    if loss_reduction == "seq_mean_token_sum_norm":
        return A / (B * max_seq_len)
    if loss_reduction == "prompt_mean":
        if prompt_boundaries is None:
            raise ValueError("`prompt_mean` loss reduction requires `prompt_boundaries`")
        out = np.zeros_like(A)
        for s, e in prompt_boundaries:
            out[s:e] = A[s:e] / (len(prompt_boundaries) * max(m[s:e].sum(), 1))
        return out
    raise ValueError(f"Invalid loss reduction type: {loss_reduction}")


# ----------------------------------------------------------------------------- policy losses
def ppo_policy_loss(log_probs, old_log_probs, advantages, config, loss_mask=None, rollout_logprobs=None):
    """Port of ppo_utils.ppo_policy_loss (regular / dual_clip, then off-policy correction, then SUM)."""
    c = _alg(config)
    A = np.asarray(advantages, dtype=np.float64)
    ratio = safe_exp_delta(np.asarray(log_probs) - np.asarray(old_log_probs))
    s1, s2 = ratio * A, np.clip(ratio, 1 - c["eps_clip_low"], 1 + c["eps_clip_high"]) * A
    loss = -np.minimum(s1, s2)
    clip_ratio = float(masked_mean((-s2 > -s1) * 1.0, loss_mask))
    if c["policy_loss_type"] == "dual_clip":
        loss = np.where(A < 0, np.minimum(-A * c["clip_ratio_c"], loss), loss)
    metrics = {"clip_ratio": clip_ratio}
    loss, loss_mask, m = apply_off_policy_correction(loss, old_log_probs, rollout_logprobs, loss_mask,
                                                     c["off_policy_correction"])
    metrics.update(m)
    return reduce_loss(loss, loss_mask), metrics


def sapo_policy_loss(log_probs, old_log_probs, advantages, config, loss_mask=None, rollout_logprobs=None):
    """Port of ppo_utils.sapo_policy_loss: -(4/tau) sigmoid(tau (r-1)) A, tau = tau_pos if A>0 else tau_neg."""
    c = _alg(config)
    A = np.asarray(advantages, dtype=np.float64)
    ratio = np.exp(np.clip(np.asarray(log_probs) - np.asarray(old_log_probs), -20.0, 20.0))
    tau = np.where(A > 0, c["sapo"]["tau_pos"], c["sapo"]["tau_neg"])
    loss = -(1.0 / (1.0 + np.exp(-tau * (ratio - 1.0))) * (4.0 / tau)) * A
    loss, loss_mask, m = apply_off_policy_correction(loss, old_log_probs, rollout_logprobs, loss_mask,
                                                     c["off_policy_correction"])
    return reduce_loss(loss, loss_mask), {"clip_ratio": 0.0, **m}


def gspo_policy_loss(log_probs, old_log_probs, advantages, config, loss_mask=None, rollout_logprobs=None):
    """Port of ppo_utils.gspo_policy_loss: s = exp(min(masked_mean_seq(lp-old), 10)) (clamp(1) denominator)."""
    c = _alg(config)
    A = np.asarray(advantages, dtype=np.float64)
    lr = np.asarray(log_probs) - np.asarray(old_log_probs)
    seq = masked_mean(lr, loss_mask, dim=-1)[:, None]
    ratio = np.exp(np.minimum(np.zeros_like(lr) + seq, 10.0))
    s1, s2 = ratio * A, np.clip(ratio, 1 - c["eps_clip_low"], 1 + c["eps_clip_high"]) * A
    loss = -np.minimum(s1, s2)
    metrics = {"clip_ratio": float(masked_mean((-s2 > -s1) * 1.0, loss_mask))}
    loss, loss_mask, m = apply_off_policy_correction(loss, old_log_probs, rollout_logprobs, loss_mask,
                                                     c["off_policy_correction"])
    metrics.update(m)
    return reduce_loss(loss, loss_mask), metrics


def compute_policy_loss_cispo(log_probs, old_log_probs, advantages, config, loss_mask=None, rollout_logprobs=None):
    """Port of ppo_utils.compute_policy_loss_cispo: -A * sg(clamp(r, 1-lo, 1+hi)) * log_probs.

    r = pi/pi_old (anchor "old") or pi/pi_rollout (anchor "rollout"; TIS then forbidden). clip_ratio counts
    strict r < 1-lo or r > 1+hi.
    """
    c = _alg(config)
    cc = c["cispo"]
    if cc["cispo_anchor"] == "rollout":
        assert rollout_logprobs is not None
        if c["off_policy_correction"]["tis_ratio_type"] is not None:
            raise ValueError("cispo_anchor='rollout' is already rollout-anchored; TIS would double-count it.")
        beh = rollout_logprobs
    else:
        beh = old_log_probs
    lp = np.asarray(log_probs, dtype=np.float64)
    A = np.asarray(advantages, dtype=np.float64)
    ratio = safe_exp_delta(lp - np.asarray(beh))
    lo, hi = 1 - cc["cispo_eps_clip_low"], 1 + cc["cispo_eps_clip_high"]
    cr = np.clip(ratio, lo, hi)
    loss = -A * cr * lp
    metrics = {"clip_ratio": float(masked_mean(((ratio < lo) | (ratio > hi)) * 1.0, loss_mask)),
               "cispo/ratio_mean": float(masked_mean(ratio, loss_mask)),
               "cispo/ratio_clamped_mean": float(masked_mean(cr, loss_mask))}
    active = ratio[np.asarray(loss_mask).astype(bool)] if loss_mask is not None and np.any(loss_mask) else ratio
    metrics.update({"cispo/ratio_max": float(active.max()), "cispo/ratio_min": float(active.min())})
    loss, loss_mask, m = apply_off_policy_correction(loss, old_log_probs, rollout_logprobs, loss_mask,
                                                     c["off_policy_correction"])
    metrics.update(m)
    return reduce_loss(loss, loss_mask), metrics


def rollout_is_policy_loss(log_probs, old_log_probs, advantages, config, loss_mask=None, rollout_logprobs=None):
    """Port of ppo_utils.rollout_is_policy_loss: -(sg(r * 1[1-lo < r < 1+hi]) A log_probs), r = pi/pi_rollout
    (STRICT bounds, uses eps_clip_low/high)."""
    c = _alg(config)
    lp = np.asarray(log_probs, dtype=np.float64)
    A = np.asarray(advantages, dtype=np.float64)
    ratio = safe_exp_delta(lp - np.asarray(rollout_logprobs))
    inr = (ratio > 1 - c["eps_clip_low"]) & (ratio < 1 + c["eps_clip_high"])
    loss = -(np.where(inr, ratio, 0.0) * A * lp)
    metrics = {"clip_ratio": float(masked_mean((~inr) * 1.0, loss_mask))}
    loss, loss_mask, m = apply_off_policy_correction(loss, old_log_probs, rollout_logprobs, loss_mask,
                                                     c["off_policy_correction"])
    metrics.update(m)
    return reduce_loss(loss, loss_mask), metrics


def compute_policy_loss_clip_cov(log_probs, old_log_probs, advantages, config, loss_mask=None,
                                 rollout_logprobs=None, rng=None):
    """Port of ppo_utils.compute_policy_loss_clip_cov. clip_cov.clip_ratio is a FRACTION of valid tokens
    (default 2e-4 -> max(int(2e-4*n), 1) tokens), chosen at random among candidates; no off-policy correction."""
    c = _alg(config)
    cc = c["clip_cov"]
    lp = np.asarray(log_probs, dtype=np.float64)
    A = np.asarray(advantages, dtype=np.float64)
    m = np.asarray(loss_mask, dtype=np.float64)
    ratio = np.exp(lp - np.asarray(old_log_probs))
    l1, l2 = -A * ratio, -A * np.clip(ratio, 1 - c["eps_clip_low"], 1 + c["eps_clip_high"])
    cov = (A - masked_mean(A, m)) * (lp - masked_mean(lp, m))
    cov = np.where((m == 0) | ((l2 > l1) & (m > 0)), -np.inf, cov)
    clip_num = max(int(cc["clip_ratio"] * m.sum()), 1)
    idx = np.argwhere((cov < cc["clip_cov_ub"]) & (cov > cc["clip_cov_lb"]) & (m > 0))
    corr = np.ones_like(A)
    if len(idx) > 0:
        idx = idx[(rng or np.random.default_rng(0)).permutation(len(idx))[:min(clip_num, len(idx))]]
        corr[idx[:, 0], idx[:, 1]] = 0
    return reduce_loss(np.maximum(l1, l2) * corr, m), {"clip_ratio": float(masked_mean((corr == 0) * 1.0, m))}


def compute_policy_loss_kl_cov(log_probs, old_log_probs, advantages, config, loss_mask=None, rollout_logprobs=None):
    """Port of ppo_utils.compute_policy_loss_kl_cov. kl_cov_frac is a FRACTION (0.2 = 20% of valid tokens,
    k = max(1, int(n*frac))); those top-cov tokens get -A r + coef |lp-old|; no off-policy correction."""
    c = _alg(config)
    kc = c["kl_cov"]
    lp = np.asarray(log_probs, dtype=np.float64)
    A = np.asarray(advantages, dtype=np.float64)
    m = np.asarray(loss_mask, dtype=np.float64)
    nkl = lp - np.asarray(old_log_probs)
    ratio = np.exp(nkl)
    pg = (-A * ratio).reshape(-1).copy()
    pg_kl = (-A * ratio + kc["ppo_kl_coef"] * np.abs(nkl)).reshape(-1)
    vidx = np.flatnonzero((m > 0).reshape(-1))
    av, lv = A.reshape(-1)[vidx], lp.reshape(-1)[vidx]
    if len(av) > 0:
        cov = (av - av.mean()) * (lv - lv.mean())
        k = max(1, int(len(cov) * kc["kl_cov_frac"]))
        top = vidx[np.argsort(-cov, kind="stable")[:min(k, len(cov))]]
        pg[top] = pg_kl[top]
    return reduce_loss(pg.reshape(A.shape), m), {"clip_ratio": 0.0}


def cross_entropy_loss(log_probs, old_log_probs, advantages, config, loss_mask=None, rollout_logprobs=None):
    """Port of ppo_utils.cross_entropy_loss: sum(-log_probs * mask)."""
    return reduce_loss(-np.asarray(log_probs, dtype=np.float64), loss_mask), {"clip_ratio": 0.0}


def importance_sampling_loss(log_probs, old_log_probs, advantages, config, loss_mask=None, rollout_logprobs=None):
    """Port of ppo_utils.importance_sampling_loss: sum(-exp(lp-old) A mask) (unclamped exp)."""
    r = np.exp(np.asarray(log_probs) - np.asarray(old_log_probs))
    el = -(r * np.asarray(advantages))
    if loss_mask is not None:
        return (el * loss_mask).sum(), {"importance_ratio": float((r * loss_mask).sum() / np.sum(loss_mask))}
    return el.sum(), {"importance_ratio": float(r.mean())}


# ----------------------------------------------------------------------------- KL + advantages
def compute_approx_kl(log_probs, log_probs_base, loss_mask=None, kl_estimator_type="k3"):
    """Port of ppo_utils.compute_approx_kl (k3 clamped: log ratio to [-20,20], result to [-10,10])."""
    lp, base = np.asarray(log_probs, dtype=np.float64), np.asarray(log_probs_base, dtype=np.float64)
    if kl_estimator_type == "k1":
        kld = lp - base
    elif kl_estimator_type == "abs":
        kld = np.abs(lp - base)
    elif kl_estimator_type == "k2":
        kld = 0.5 * (lp - base) ** 2
    elif kl_estimator_type == "k3":
        kl = np.clip(base - lp, -20, 20)
        kld = np.clip(np.exp(kl) - kl - 1, -10, 10)
    else:
        raise ValueError(f"Invalid KL estimator type: {kl_estimator_type}")
    if loss_mask is not None:
        kld = np.where(np.asarray(loss_mask).astype(bool), kld * loss_mask, 0.0)
    return kld


def _groups(index):
    g: dict[Any, list[int]] = {}
    for i, k in enumerate(index):
        g.setdefault(k, []).append(i)
    return g


def compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6, grpo_norm_by_std=True):
    """Port of ppo_utils.compute_grpo_outcome_advantage (unbiased std; singleton: mean 0, std 1)."""
    scores = np.asarray(token_level_rewards, dtype=np.float64).sum(-1)
    out = scores.copy()
    for ids in _groups(index).values():
        s = scores[ids]
        mean, std = (0.0, 1.0) if len(ids) == 1 else (s.mean(), np.std(s, ddof=1))
        out[ids] = (s - mean) / (std + epsilon) if grpo_norm_by_std else s - mean
    adv = out[:, None] * np.asarray(response_mask, dtype=np.float64)
    return adv, adv


def compute_rloo_outcome_advantage(token_level_rewards, response_mask, index):
    """Port of ppo_utils.compute_rloo_outcome_advantage ((s - mean) * n/(n-1); singleton group -> 0)."""
    scores = np.asarray(token_level_rewards, dtype=np.float64).sum(-1)
    out = np.zeros_like(scores)
    for ids in _groups(index).values():
        n = len(ids)
        if n > 1:
            out[ids] = (scores[ids] - scores[ids].mean()) * (n / (n - 1))
    adv = out[:, None] * np.asarray(response_mask, dtype=np.float64)
    return adv, adv


def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards, response_mask, gamma=1.0):
    """Port of ppo_utils.compute_reinforce_plus_plus_outcome_advantage (uses SkyRL's clamp(1) masked_whiten)."""
    r = np.asarray(token_level_rewards, dtype=np.float64)
    m = np.asarray(response_mask, dtype=np.float64)
    returns = np.zeros_like(r)
    running = np.zeros(r.shape[0])
    for t in reversed(range(r.shape[1])):
        running = r[:, t] + gamma * running
        returns[:, t] = running
        running = running * m[:, t]
    return masked_whiten(returns, m) * m, returns
