"""NumPy float64 port of verl's rollout-correction and PPO-loss code.

Re-checked line by line against verl-project/verl @ 1dda039b9 (verl/trainer/ppo/rollout_corr_helper.py,
verl/trainer/ppo/core_algos.py, verl/utils/torch_functional.py): at that commit ``rollout_rs`` has no
``binary_kl`` option (removed here) and ``compute_rollout_rejection_mask`` takes only the log-ratio; the rest below
matches it.

Sources first read (via the code index):
- verl-project/verl  verl/trainer/ppo/rollout_corr_helper.py  @ 20c30bf8b70e37fae4b38f5ccf170f20e349395d
- verl-project/verl  verl/trainer/ppo/core_algos.py           @ 018f23b5f83a13340421349e40ec42530739b23a
- verl-project/verl  verl/utils/torch_functional.py           @ 0db13434d04637f539356a9c43209387ed3894a4
- verl-project/verl  verl/trainer/config/algorithm.py         @ 0482624a78385c53903e54321fd3070412804e4e
- call order (correction before compute_advantage): verl ray_trainer fit loop (index excerpt, several forks).

Conventions: every array is float64 [B, T]; ``response_mask`` is 0/1 float. Torch computes in float32 (and
``binary_kl`` upcasts to float32); this port stays in float64. Quirks are reproduced on purpose:
- ``masked_mean`` divides by ``mask.sum() + 1e-8`` (not max(., 1)).
- k1 rejection bounds are inverted: ``k1 = -log(rho)`` is checked against ``[log(lo), log(up)]``, so a
  ``"lo_up"`` threshold keeps ``1/up <= rho <= 1/lo``.
- ``compute_offpolicy_metrics`` does not clamp ``k3_kl`` (may be inf) and asserts a non-empty mask.
- ESS is ``1.0 / float(...)`` on a Python float: an all-zero weight batch raises ZeroDivisionError.
- IS metrics raise ValueError on an all-zero mask.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

SAFETY_BOUND = 20.0

SUPPORTED_ROLLOUT_RS_OPTIONS: set[str] = {
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
}
TOKEN_LEVEL_ROLLOUT_RS_OPTIONS: set[str] = {"token_k1", "token_k2", "token_k3"}


# ----------------------------------------------------------------------------- torch_functional helpers
def masked_sum(values, mask, axis=None):
    """Port of verl.utils.torch_functional.masked_sum (NaN outside the mask is zeroed first)."""
    values = np.asarray(values, dtype=np.float64)
    mask = np.asarray(mask, dtype=np.float64)
    valid = np.where(mask.astype(bool), values, 0.0)
    return (valid * mask).sum(axis=axis)


def masked_mean(values, mask, axis=None):
    """Port of verl.utils.torch_functional.masked_mean: sum / (mask.sum() + 1e-8)."""
    mask = np.asarray(mask, dtype=np.float64)
    return masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def masked_var(values, mask, unbiased=True):
    """Port of verl.utils.torch_functional.masked_var (raises on mask sum 0 or 1 when unbiased)."""
    mask = np.asarray(mask, dtype=np.float64)
    mean = masked_mean(values, mask)
    variance = masked_mean((np.asarray(values, dtype=np.float64) - mean) ** 2, mask)
    if unbiased:
        mask_sum = mask.sum()
        if mask_sum == 0:
            raise ValueError("At least one element in the mask has to be 1.")
        if mask_sum == 1:
            raise ValueError("The sum of the mask is one, which can cause a division by zero.")
        variance = variance * (mask_sum / (mask_sum - 1))
    return variance


def masked_whiten(values, mask, shift_mean=True):
    """Port of verl.utils.torch_functional.masked_whiten: (x - mean) * rsqrt(var + 1e-8)."""
    values = np.asarray(values, dtype=np.float64)
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) / np.sqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def _std_unbiased(x):
    x = np.asarray(x, dtype=np.float64)
    return float(np.std(x, ddof=1)) if x.size > 1 else float("nan")


# ----------------------------------------------------------------------------- threshold parsing
def _parse_rollout_is_threshold(threshold_spec):
    """Port of rollout_corr_helper._parse_rollout_is_threshold. Returns (upper, lower or None)."""
    if isinstance(threshold_spec, bool):
        raise TypeError("rollout_is_threshold must be specified as a float or a string threshold specification, "
                        "not a boolean.")
    if isinstance(threshold_spec, (int, float)):
        upper, lower = float(threshold_spec), None
    elif isinstance(threshold_spec, str):
        spec = threshold_spec.strip()
        if not spec:
            raise ValueError("rollout_is_threshold must not be an empty string.")
        if "_" in spec:
            lower_str, upper_str = spec.split("_", 1)
            try:
                lower, upper = float(lower_str), float(upper_str)
            except ValueError as exc:
                raise ValueError(f"Invalid rollout_is_threshold '{threshold_spec}'.") from exc
        else:
            try:
                upper = float(spec)
            except ValueError as exc:
                raise ValueError(f"Invalid rollout_is_threshold '{threshold_spec}'.") from exc
            lower = None
    else:
        raise TypeError("rollout_is_threshold must be a float or a string threshold specification.")
    if upper <= 0:
        raise ValueError(f"rollout_is_threshold upper bound must be positive, got {upper}.")
    if lower is not None:
        if lower <= 0:
            raise ValueError(f"rollout_is_threshold lower bound must be positive, got {lower}.")
        if lower > upper:
            raise ValueError("rollout_is_threshold lower bound must be <= upper bound.")
    return upper, lower


def _parse_rollout_rs_thresholds(options, threshold_spec):
    """Port of rollout_corr_helper._parse_rollout_rs_thresholds -> {option: {"lower", "upper"}}."""
    if threshold_spec is None:
        raise ValueError("rollout_rs_threshold must be provided for rejection sampling.")
    if isinstance(threshold_spec, (int, float)):
        raw_specs = [str(threshold_spec)]
    elif isinstance(threshold_spec, str):
        raw_specs = [part.strip() for part in threshold_spec.split(",") if part.strip()]
    else:
        raise TypeError("rollout_rs_threshold must be a string or numeric value specifying per-option thresholds.")
    if not raw_specs:
        raise ValueError("rollout_rs_threshold must contain at least one threshold value.")
    if len(raw_specs) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold expects either one threshold shared by all options or exactly "
                         f"{len(options)} thresholds to match the provided rollout_rs options.")
    if len(raw_specs) == 1 and len(options) > 1:
        raw_specs = raw_specs * len(options)
    thresholds = {}
    for option, spec in zip(options, raw_specs):
        if option.endswith("k1"):
            if "_" in spec:
                lower_str, upper_str = spec.split("_", 1)
            else:
                upper_str = spec
                lower_str = str(1.0 / float(upper_str))
            try:
                lower, upper = float(lower_str), float(upper_str)
            except ValueError as exc:
                raise ValueError(f"Invalid numeric threshold '{spec}' for option '{option}'.") from exc
            if lower <= 0 or upper <= 0:
                raise ValueError(f"Thresholds for option '{option}' must be positive, got {spec}.")
            thresholds[option] = {"lower": lower, "upper": upper}
        else:
            if "_" in spec:
                raise ValueError(f"rollout_rs_threshold for option '{option}' must provide a single upper bound "
                                 f"without '_'. Received '{spec}'.")
            try:
                upper = float(spec)
            except ValueError as exc:
                raise ValueError(f"Invalid numeric threshold '{spec}' for option '{option}'.") from exc
            if upper <= 0:
                raise ValueError(f"Threshold for option '{option}' must be positive, got {spec}.")
            thresholds[option] = {"lower": None, "upper": upper}
    return thresholds


def _normalize_rs_options(rollout_rs):
    """Option parsing done inline in compute_rollout_rejection_mask: split on ',', strip, dedupe (order kept)."""
    if rollout_rs is None or not isinstance(rollout_rs, str):
        raise ValueError("rollout_rs must be a non-empty string (comma separated for multiple options).")
    option_modes = [opt.strip() for opt in rollout_rs.split(",") if opt.strip()]
    if not option_modes:
        raise ValueError("rollout_rs must contain at least one valid option.")
    normalized, seen = [], set()
    for opt in option_modes:
        if opt not in SUPPORTED_ROLLOUT_RS_OPTIONS:
            raise ValueError(f"Invalid rollout_rs option: {opt}. Must be one of "
                             f"{sorted(SUPPORTED_ROLLOUT_RS_OPTIONS)}.")
        if opt not in seen:
            normalized.append(opt)
            seen.add(opt)
    return normalized


# ----------------------------------------------------------------------------- rejection sampling
def compute_rs_metrics(option_name, rs_statistic, response_mask, seq_valid_mask, *, level, per_sequence_values,
                       rollout_rs_threshold, rollout_rs_threshold_lower, apply_lower_threshold):
    """Port of rollout_corr_helper.compute_rs_metrics (per-option keys ``rollout_rs_{option}_*``)."""
    response_mask = np.asarray(response_mask, dtype=np.float64)
    if not response_mask.astype(bool).any():
        raise ValueError("response_mask must contain at least one valid token (1).")
    m, p = {}, f"rollout_rs_{option_name}"
    mb = response_mask.astype(bool)
    seq_values = per_sequence_values if per_sequence_values is not None else \
        masked_mean(rs_statistic, response_mask, axis=-1)
    seq_values_valid = np.asarray(seq_values)[seq_valid_mask]
    m[f"{p}_mean"] = float(masked_mean(rs_statistic, response_mask))
    if level == "sequence" and seq_values_valid.size > 0:
        m[f"{p}_max"], m[f"{p}_min"] = float(seq_values_valid.max()), float(seq_values_valid.min())
        hi = float((seq_values_valid > rollout_rs_threshold).mean())
        lo = float((seq_values_valid < rollout_rs_threshold_lower).mean()) if apply_lower_threshold else 0.0
    else:
        m[f"{p}_max"] = float(np.where(mb, rs_statistic, -np.inf).max())
        m[f"{p}_min"] = float(np.where(mb, rs_statistic, np.inf).min())
        hi = float(masked_mean((rs_statistic > rollout_rs_threshold).astype(np.float64), response_mask))
        lo = float(masked_mean((rs_statistic < rollout_rs_threshold_lower).astype(np.float64), response_mask)) \
            if apply_lower_threshold else 0.0
    m[f"{p}_fraction_high"], m[f"{p}_fraction_low"] = hi, lo
    if response_mask.sum() > 1:
        clamp_min = rollout_rs_threshold_lower if apply_lower_threshold else 0.0
        s = np.clip(rs_statistic, clamp_min, rollout_rs_threshold)
        var = masked_mean(s ** 2, response_mask) - masked_mean(s, response_mask) ** 2
        m[f"{p}_std"] = float(np.sqrt(max(var, 0.0)))
    else:
        m[f"{p}_std"] = 0.0
    if seq_values_valid.size > 0:
        m[f"{p}_seq_mean"] = float(seq_values_valid.mean())
        m[f"{p}_seq_std"] = _std_unbiased(seq_values_valid) if seq_values_valid.size > 1 else 0.0
        m[f"{p}_seq_max"], m[f"{p}_seq_min"] = float(seq_values_valid.max()), float(seq_values_valid.min())
        m[f"{p}_seq_max_deviation"] = float(np.abs(seq_values_valid - 0.0).max())
        m[f"{p}_seq_fraction_high"] = float((seq_values_valid > rollout_rs_threshold).mean())
        if apply_lower_threshold:
            m[f"{p}_seq_fraction_low"] = float((seq_values_valid < rollout_rs_threshold_lower).mean())
    else:
        for k in ("seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation", "seq_fraction_high",
                  "seq_fraction_low"):
            m[f"{p}_{k}"] = 0.0
    return m


def compute_rollout_rejection_mask(log_ratio, response_mask, rollout_rs="token_k1", rollout_rs_threshold=None):
    """Port of rollout_corr_helper.compute_rollout_rejection_mask -> (modified_response_mask, metrics).

    log_ratio = old - rollout. Options AND together; k1 keeps log(lo) <= -log_ratio <= log(up) (inverted).
    """
    if rollout_rs is None or not isinstance(rollout_rs, str):
        raise ValueError("rollout_rs must be a non-empty string (comma separated for multiple options).")
    if rollout_rs_threshold is None:
        raise ValueError("rollout_rs_threshold must be provided for rejection sampling.")
    log_ratio = np.asarray(log_ratio, dtype=np.float64)
    response_mask = np.asarray(response_mask, dtype=np.float64)
    if log_ratio.shape[0] == 0:
        return response_mask, {}
    options = _normalize_rs_options(rollout_rs)
    specs = _parse_rollout_rs_thresholds(options, rollout_rs_threshold)
    lr = np.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    tok = {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": np.exp(lr) - 1.0 - lr}
    mb = response_mask.astype(bool)
    seq_valid = response_mask.sum(axis=-1) > 0
    combined = np.ones_like(response_mask)
    metrics: dict[str, float] = {}

    def seq_max(v):
        mx = np.where(mb, v, -np.inf).max(axis=-1)
        return np.where(mx == -np.inf, 0.0, mx)

    for opt in options:
        up, lo = specs[opt]["upper"], specs[opt]["lower"]
        is_k1 = opt.endswith("k1")
        lo_log = math.log(lo) if is_k1 else None
        up_log = math.log(up) if is_k1 else None
        level = "token" if opt in TOKEN_LEVEL_ROLLOUT_RS_OPTIONS else "sequence"
        seq_stat = None
        if opt.startswith("token_"):
            stat = tok[opt[-2:]]
            keep = (stat >= lo_log) & (stat <= up_log) if is_k1 else stat <= up
        else:
            k = opt[-2:]
            if opt.startswith("seq_sum"):
                seq_stat = masked_sum(tok[k], response_mask, axis=-1)
            elif opt.startswith("seq_mean"):
                seq_stat = masked_mean(tok[k], response_mask, axis=-1)
            else:
                seq_stat = seq_max(tok[k])
            seq_keep = (seq_stat >= lo_log) & (seq_stat <= up_log) if is_k1 else seq_stat <= up
            keep = np.broadcast_to(seq_keep[:, None], response_mask.shape)
            stat = np.broadcast_to(seq_stat[:, None], response_mask.shape)
        keep_f = keep.astype(np.float64)
        combined = combined * keep_f
        seq_keep_all = (~((~keep) & mb)).all(axis=-1)
        metrics.update(compute_rs_metrics(
            opt, stat, response_mask, seq_valid, level=level, per_sequence_values=seq_stat,
            rollout_rs_threshold=up_log if is_k1 else up,
            rollout_rs_threshold_lower=lo_log if is_k1 else 0.0, apply_lower_threshold=is_k1))
        sv = seq_valid.astype(np.float64)
        seq_frac = float(((1.0 - seq_keep_all) * sv).sum() / sv.sum()) if sv.sum() > 0 else 0.0
        metrics[f"rollout_rs_{opt}_masked_fraction"] = float(masked_mean(1 - keep_f, response_mask))
        metrics[f"rollout_rs_{opt}_seq_masked_fraction"] = seq_frac
    metrics["rollout_rs_masked_fraction"] = float(masked_mean(1 - combined, response_mask))
    final_keep = (combined > 0.5) & mb
    metrics["rollout_rs_seq_masked_fraction"] = float((~final_keep & mb).any(axis=-1).mean())
    return response_mask * combined, metrics


# ----------------------------------------------------------------------------- importance weights
def compute_is_metrics(rollout_is_weights, raw_rollout_is_weights, log_ratio_for_metrics, response_mask, rollout_is,
                       rollout_is_threshold, rollout_is_threshold_lower=None):
    """Port of rollout_corr_helper.compute_is_metrics (keys ``rollout_is_*``)."""
    w, raw = np.asarray(rollout_is_weights), np.asarray(raw_rollout_is_weights)
    response_mask = np.asarray(response_mask, dtype=np.float64)
    mb = response_mask.astype(bool)
    if not mb.any():
        raise ValueError("response_mask must contain at least one valid token (1).")
    m = {}
    lower = 1.0 / rollout_is_threshold if rollout_is_threshold_lower is None else rollout_is_threshold_lower
    if rollout_is == "sequence":
        lrm = np.asarray(log_ratio_for_metrics)
        m["rollout_is_max"] = float(np.exp(min(lrm.max(), SAFETY_BOUND)))
        m["rollout_is_min"] = float(np.exp(lrm.min()))
        m["rollout_is_mean"] = float(masked_mean(w, response_mask))
        m["rollout_is_ratio_fraction_high"] = float((lrm > math.log(rollout_is_threshold)).mean())
        m["rollout_is_ratio_fraction_low"] = float((lrm < math.log(lower)).mean())
    else:
        m["rollout_is_mean"] = float(masked_mean(w, response_mask))
        m["rollout_is_ratio_fraction_high"] = float(masked_mean((raw > rollout_is_threshold) * 1.0, response_mask))
        m["rollout_is_ratio_fraction_low"] = float(masked_mean((raw < lower) * 1.0, response_mask))
        m["rollout_is_max"] = float(np.where(mb, w, -np.inf).max())
        m["rollout_is_min"] = float(np.where(mb, w, np.inf).min())
    wc = np.clip(w, 0.0, rollout_is_threshold)
    if response_mask.sum() > 1:
        var = masked_mean(wc ** 2, response_mask) - masked_mean(wc, response_mask) ** 2
        m["rollout_is_std"] = float(np.sqrt(max(var, 0.0)))
    else:
        m["rollout_is_std"] = 0.0
    norm = wc / (masked_mean(wc, response_mask) + 1e-8)
    m["rollout_is_eff_sample_size"] = 1.0 / float(masked_mean(norm ** 2, response_mask))  # ZeroDivisionError if 0
    if w.ndim > 1:
        s = masked_mean(w, response_mask, axis=-1)
        m["rollout_is_seq_mean"] = float(s.mean())
        m["rollout_is_seq_std"] = _std_unbiased(s) if s.size > 1 else 0.0
        m["rollout_is_seq_max"], m["rollout_is_seq_min"] = float(s.max()), float(s.min())
        m["rollout_is_seq_max_deviation"] = float(np.abs(s - 1.0).max())
        raw_s = masked_mean(raw, response_mask, axis=-1)
        m["rollout_is_seq_fraction_high"] = float((raw_s > rollout_is_threshold).mean())
        m["rollout_is_seq_fraction_low"] = float((raw_s < lower).mean())
    return m


def compute_rollout_correction_weights(log_ratio, response_mask, rollout_is="token", rollout_is_threshold=2.0,
                                       rollout_is_batch_normalize=False):
    """Port of rollout_corr_helper.compute_rollout_correction_weights -> (weights, metrics).

    Float threshold = TIS (clamp max); "lo_up" string = IcePop (zero outside [lo, up], inclusive).
    """
    if rollout_is not in {"token", "sequence"}:
        raise ValueError(f"Invalid rollout_is: {rollout_is}. Must be one of {{'token', 'sequence'}}.")
    upper, lower = _parse_rollout_is_threshold(rollout_is_threshold)
    log_ratio = np.asarray(log_ratio, dtype=np.float64)
    response_mask = np.asarray(response_mask, dtype=np.float64)
    if rollout_is == "token":
        lrm = log_ratio
        raw = np.exp(np.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    else:
        lrm = masked_sum(log_ratio, response_mask, axis=-1)[:, None]
        raw = np.broadcast_to(np.exp(np.clip(lrm, -SAFETY_BOUND, SAFETY_BOUND)), log_ratio.shape)
    raw = raw * response_mask
    if lower is None:
        w = np.minimum(raw, upper)
    else:
        w = np.where((raw >= lower) & (raw <= upper), raw, 0.0)
    metrics = compute_is_metrics(w, raw, lrm, response_mask, rollout_is, upper, lower)
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = float(masked_mean(((raw < lower) | (raw > upper)) * 1.0, response_mask))
    if rollout_is_batch_normalize:
        if rollout_is == "token":
            mean = masked_mean(w, response_mask)
        else:
            seq_w = masked_mean(w, response_mask, axis=-1)
            seq_m = (response_mask.sum(axis=-1) > 0).astype(np.float64)
            mean = (seq_w * seq_m).sum() / max(seq_m.sum(), 1e-8)
        if mean > 1e-8:
            w = w / mean
            metrics["rollout_is_batch_norm_factor"] = float(mean)
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return w, metrics


def compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask):
    """Port of rollout_corr_helper.compute_offpolicy_metrics (keys without the rollout_corr/ prefix)."""
    old = np.asarray(old_log_prob, dtype=np.float64)
    response_mask = np.asarray(response_mask, dtype=np.float64)
    assert response_mask.astype(bool).any(), "Expected at least one valid token in response_mask"
    m = {}
    mt = masked_mean(old, response_mask, axis=-1)
    m["training_ppl"] = float(np.exp(-mt).mean())
    m["training_log_ppl"] = float((-mt).mean())
    if rollout_log_prob is not None:
        roll = np.asarray(rollout_log_prob, dtype=np.float64)
        m["kl"] = float(masked_mean(roll - old, response_mask))
        lr = old - roll
        with np.errstate(over="ignore"):
            m["k3_kl"] = float(masked_mean(np.exp(lr) - lr - 1, response_mask))  # unclamped: may be inf
        mr = masked_mean(roll, response_mask, axis=-1)
        m["rollout_ppl"] = float(np.exp(-mr).mean())
        m["rollout_log_ppl"] = float((-mr).mean())
        d = mr - mt
        m["log_ppl_diff"] = float(d.mean())
        m["log_ppl_abs_diff"] = float(np.abs(d).mean())
        m["log_ppl_diff_max"], m["log_ppl_diff_min"] = float(d.max()), float(d.min())
        m["ppl_ratio"] = float(np.exp(d).mean())
        rho = np.exp(np.clip(lr, -SAFETY_BOUND, SAFETY_BOUND))
        m["chi2_token"] = float(masked_mean(rho ** 2, response_mask) - 1.0)
        s = np.clip(masked_sum(lr, response_mask, axis=-1), -SAFETY_BOUND, SAFETY_BOUND)
        m["chi2_seq"] = float(np.exp(2.0 * s).mean() - 1.0)
    return m


def compute_rollout_correction_and_rejection_mask(old_log_prob, rollout_log_prob, response_mask, rollout_is=None,
                                                  rollout_is_threshold=2.0, rollout_is_batch_normalize=False,
                                                  rollout_rs=None, rollout_rs_threshold=None):
    """Port of rollout_corr_helper.compute_rollout_correction_and_rejection_mask.

    Returns (is_weights or None, modified_response_mask, metrics with "rollout_corr/" prefix).
    IS weights are computed on the ORIGINAL mask and are not multiplied by the rejection mask.
    """
    old = np.asarray(old_log_prob, dtype=np.float64)
    roll = np.asarray(rollout_log_prob, dtype=np.float64)
    response_mask = np.asarray(response_mask, dtype=np.float64)
    if not response_mask.astype(bool).any():
        raise ValueError("response_mask must contain at least one valid token (1).")
    log_ratio = old - roll
    metrics: dict[str, Any] = {}
    weights = None
    if rollout_is is not None and rollout_is_threshold is not None:
        weights, im = compute_rollout_correction_weights(log_ratio, response_mask, rollout_is, rollout_is_threshold,
                                                         rollout_is_batch_normalize)
        metrics.update(im)
    modified = response_mask.copy()
    if rollout_rs is not None:
        if rollout_rs_threshold is None:
            raise ValueError("rollout_rs_threshold must be explicitly provided when rollout_rs is enabled. "
                             "Set rollout_rs_threshold to the desired threshold value.")
        modified, rm = compute_rollout_rejection_mask(log_ratio, response_mask, rollout_rs, rollout_rs_threshold)
        metrics.update(rm)
    metrics.update(compute_offpolicy_metrics(old, roll, response_mask))
    return weights, modified, {f"rollout_corr/{k}": v for k, v in metrics.items()}


def compute_rollout_corr_metrics_from_logprobs(log_prob, rollout_log_prob, response_mask):
    """Port of rollout_corr_helper.compute_rollout_corr_metrics_from_logprobs (current policy vs rollout)."""
    return {f"rollout_corr/{k}": v for k, v in compute_offpolicy_metrics(log_prob, rollout_log_prob,
                                                                         response_mask).items()}


# ----------------------------------------------------------------------------- core_algos: reduction
def agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
             loss_scale_factor=None):
    """Port of core_algos.agg_loss (single-rank defaults: denominators from the given loss_mask)."""
    loss_mat = np.asarray(loss_mat, dtype=np.float64)
    loss_mask = np.asarray(loss_mask, dtype=np.float64)
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
            batch_num_tokens = loss_mask.sum()
        return masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size  # 0/0 -> nan when mask empty
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, loss_mask) * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = (loss_mat * loss_mask).sum(axis=-1)
        seq_mask = (loss_mask.sum(axis=-1) > 0).astype(np.float64)
        if global_batch_size is None:
            if dp_size > 1:
                raise ValueError("global_batch_size is required when dp_size > 1")
            global_batch_size = seq_mask.sum()
        loss = masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return loss
    if loss_agg_mode == "seq-mean-token-mean":
        cnt = loss_mask.sum(axis=-1)
        seq_losses = (loss_mat * loss_mask).sum(axis=-1) / (cnt + 1e-8)
        seq_mask = (cnt > 0).astype(np.float64)
        if global_batch_size is None:
            if dp_size > 1:
                raise ValueError("global_batch_size is required when dp_size > 1")
            global_batch_size = seq_mask.sum()
        return masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
    raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")


# ----------------------------------------------------------------------------- core_algos: policy losses
def compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0,
                                rollout_is_weights=None, global_batch_info=None):
    """Port of core_algos.compute_policy_loss_vanilla (PPO clip + dual clip, IS weights after clipping)."""
    assert clip_ratio_c > 1.0
    lo = clip_ratio if clip_ratio_low is None else clip_ratio_low
    hi = clip_ratio if clip_ratio_high is None else clip_ratio_high
    A = np.asarray(advantages, dtype=np.float64)
    nkl = np.clip(np.asarray(log_prob) - np.asarray(old_log_prob), -20.0, 20.0)
    ratio = np.exp(nkl)
    ppo_kl = masked_mean(-nkl, response_mask)
    l1 = -A * ratio
    l2 = -A * np.clip(ratio, 1 - lo, 1 + hi)
    c1 = np.maximum(l1, l2)
    clipfrac = masked_mean((l2 > l1) * 1.0, response_mask)
    l3 = -A * clip_ratio_c
    c2 = np.minimum(l3, c1)
    clipfrac_lower = masked_mean((c1 > l3) * (A < 0) * 1.0, response_mask)
    pg = np.where(A < 0, c2, c1)
    if rollout_is_weights is not None:
        pg = pg * rollout_is_weights
    loss = agg_loss(pg, response_mask, loss_agg_mode, **(global_batch_info or {}))
    return loss, {"actor/pg_clipfrac": float(clipfrac), "actor/ppo_kl": float(ppo_kl),
                  "actor/pg_clipfrac_lower": float(clipfrac_lower)}


def compute_policy_loss_gspo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean",
                             clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, rollout_is_weights=None,
                             global_batch_info=None):
    """Port of core_algos.compute_policy_loss_gspo (GSPO-token; reduction forced to seq-mean-token-mean).

    Value of s_t = exp(min(mean_seq(lp - old), 10)) (no lower clamp); sequence mean divides by clamp(len, 1).
    """
    lo = clip_ratio if clip_ratio_low is None else clip_ratio_low
    hi = clip_ratio if clip_ratio_high is None else clip_ratio_high
    A = np.asarray(advantages, dtype=np.float64)
    m = np.asarray(response_mask, dtype=np.float64)
    nkl = np.asarray(log_prob) - np.asarray(old_log_prob)
    seq = (nkl * m).sum(-1) / np.maximum(m.sum(-1), 1)
    log_s = np.minimum(np.zeros_like(nkl) + seq[:, None], 10.0)  # lp - sg(lp) == 0 in value
    s = np.exp(log_s)
    l1, l2 = -A * s, -A * np.clip(s, 1 - lo, 1 + hi)
    pg = np.maximum(l1, l2)
    if rollout_is_weights is not None:
        pg = pg * rollout_is_weights
    loss = agg_loss(pg, m, "seq-mean-token-mean", **(global_batch_info or {}))
    return loss, {"actor/pg_clipfrac": float(masked_mean((l2 > l1) * 1.0, m)),
                  "actor/ppo_kl": float(masked_mean(-nkl, m)), "actor/pg_clipfrac_lower": 0.0}


def compute_policy_loss_sapo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean",
                             tau_pos=1.0, tau_neg=1.05, rollout_is_weights=None, global_batch_info=None):
    """Port of core_algos.compute_policy_loss_sapo (reduction forced to seq-mean-token-mean)."""
    A = np.asarray(advantages, dtype=np.float64)
    nkl = np.clip(np.asarray(log_prob) - np.asarray(old_log_prob), -20.0, 20.0)
    ratio = np.exp(nkl)
    tau = np.where(A > 0, tau_pos, tau_neg)
    gates = 1.0 / (1.0 + np.exp(-tau * (ratio - 1.0))) * (4.0 / tau)
    pg = -gates * A
    if rollout_is_weights is not None:
        pg = pg * rollout_is_weights
    loss = agg_loss(pg, response_mask, "seq-mean-token-mean", **(global_batch_info or {}))
    return loss, {"actor/pg_clipfrac": 0.0, "actor/ppo_kl": float(masked_mean(-nkl, response_mask)),
                  "actor/pg_clipfrac_lower": 0.0}


def compute_policy_loss_cispo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                              clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, rollout_is_weights=None,
                              global_batch_info=None):
    """Port of core_algos.compute_policy_loss_cispo: -sg(clip(r, 1-lo, 1+hi)) * A * log_prob."""
    lo = clip_ratio if clip_ratio_low is None else clip_ratio_low
    hi = clip_ratio if clip_ratio_high is None else clip_ratio_high
    A = np.asarray(advantages, dtype=np.float64)
    lp = np.asarray(log_prob, dtype=np.float64)
    nkl = np.clip(lp - np.asarray(old_log_prob), -20.0, 20.0)
    ratio = np.exp(nkl)
    cr = np.clip(ratio, 1 - lo, 1 + hi)
    pg = -cr * A * lp
    clipfrac = masked_mean((ratio != cr) * 1.0, response_mask)
    if rollout_is_weights is not None:
        pg = pg * rollout_is_weights
    loss = agg_loss(pg, response_mask, loss_agg_mode, **(global_batch_info or {}))
    return loss, {"actor/pg_clipfrac": float(clipfrac), "actor/ppo_kl": float(masked_mean(-nkl, response_mask)),
                  "actor/pg_clipfrac_lower": 0.0}


def compute_policy_loss_clip_cov(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                 clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_cov_ratio=0.0002,
                                 clip_cov_lb=1.0, clip_cov_ub=5.0, rollout_is_weights=None, global_batch_info=None,
                                 rng=None):
    """Port of core_algos.compute_policy_loss_clip_cov (ratio unclamped; random pick of candidates via permutation).

    Deterministic only when #candidates <= clip_num = max(int(clip_cov_ratio * n_valid), 1).
    """
    lo = clip_ratio if clip_ratio_low is None else clip_ratio_low
    hi = clip_ratio if clip_ratio_high is None else clip_ratio_high
    A = np.asarray(advantages, dtype=np.float64)
    lp = np.asarray(log_prob, dtype=np.float64)
    m = np.asarray(response_mask, dtype=np.float64)
    nkl = lp - np.asarray(old_log_prob)
    ratio = np.exp(nkl)
    l1, l2 = -A * ratio, -A * np.clip(ratio, 1 - lo, 1 + hi)
    cov = (A - masked_mean(A, m)) * (lp - masked_mean(lp, m))
    cov = np.where((m == 0) | ((l2 > l1) & (m > 0)), -np.inf, cov)
    clip_num = max(int(clip_cov_ratio * m.sum()), 1)
    idx = np.argwhere((cov < clip_cov_ub) & (cov > clip_cov_lb) & (m > 0))
    corr = np.ones_like(A)
    if len(idx) > 0:
        perm = (rng or np.random.default_rng(0)).permutation(len(idx))
        idx = idx[perm[:min(clip_num, len(idx))]]
        corr[idx[:, 0], idx[:, 1]] = 0
    pg = np.maximum(l1, l2) * corr
    if rollout_is_weights is not None:
        pg = pg * rollout_is_weights
    loss = agg_loss(pg, m, loss_agg_mode, **(global_batch_info or {}))
    return loss, {"actor/pg_clipfrac": float(masked_mean((corr == 0) * 1.0, m)),
                  "actor/ppo_kl": float(masked_mean(-nkl, m))}


def compute_policy_loss_kl_cov(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                               kl_cov_ratio=0.0002, ppo_kl_coef=1.0, rollout_is_weights=None, global_batch_info=None):
    """Port of core_algos.compute_policy_loss_kl_cov: top-k (k = max(1, int(n*ratio))) tokens by covariance get
    -A*r + coef*|lp-old|, the rest -A*r (no clipping, ratio unclamped). Ties: stable descending order."""
    A = np.asarray(advantages, dtype=np.float64)
    lp = np.asarray(log_prob, dtype=np.float64)
    m = np.asarray(response_mask, dtype=np.float64)
    nkl = lp - np.asarray(old_log_prob)
    ratio = np.exp(nkl)
    pg = -A * ratio
    pg_kl = -A * ratio + ppo_kl_coef * np.abs(nkl)
    valid_idx = np.flatnonzero((m > 0).reshape(-1))
    adv_v, lp_v = A.reshape(-1)[valid_idx], lp.reshape(-1)[valid_idx]
    if min(kl_cov_ratio, len(adv_v)) != 0:  # verl quirk: k = min(ratio, len) only tested for != 0
        cov = (adv_v - adv_v.mean()) * (lp_v - lp_v.mean())
        n = max(1, int(len(cov) * kl_cov_ratio))
        top = valid_idx[np.argsort(-cov, kind="stable")[:n]]
        flat = pg.reshape(-1)
        flat[top] = pg_kl.reshape(-1)[top]
        pg = flat.reshape(A.shape)
    if rollout_is_weights is not None:
        pg = pg * rollout_is_weights
    loss = agg_loss(pg, m, loss_agg_mode, **(global_batch_info or {}))
    return loss, {"actor/ppo_kl": float(masked_mean(np.abs(nkl), m))}


def compute_policy_loss_reinforce(rollout_log_prob, log_prob, advantages, response_mask,
                                  loss_agg_mode="seq-mean-token-sum", rollout_is_weights=None, global_batch_info=None):
    """Port of core_algos.compute_policy_loss_reinforce: -A * log_prob * w (default seq-mean-token-sum). Re-checked
    for issue 30 against verl/trainer/ppo/core_algos.py:2033-2060 at b178a3cd: ``actor/ppo_kl`` is unclamped."""
    A = np.asarray(advantages, dtype=np.float64)
    lp = np.asarray(log_prob, dtype=np.float64)
    pg = -A * lp * rollout_is_weights if rollout_is_weights is not None else -A * lp
    loss = agg_loss(pg, response_mask, loss_agg_mode, **(global_batch_info or {}))
    return loss, {"actor/ppo_kl": float(masked_mean(-(lp - np.asarray(rollout_log_prob)), response_mask))}


def compute_policy_loss_bypass_mode(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                    loss_type="ppo_clip", rollout_is=None, rollout_is_threshold=2.0,
                                    rollout_is_batch_normalize=False, rollout_rs=None, rollout_rs_threshold=None,
                                    **ppo_kwargs):
    """Port of core_algos.compute_policy_loss_bypass_mode (old_log_prob IS the rollout logprob).

    Weights/rejection use log_prob (detached current policy) vs rollout; ppo_clip ignores the IS weights.
    """
    w, mask, rm = compute_rollout_correction_and_rejection_mask(
        log_prob, old_log_prob, response_mask, rollout_is, rollout_is_threshold, rollout_is_batch_normalize,
        rollout_rs, rollout_rs_threshold)
    if loss_type == "reinforce":
        loss, pm = compute_policy_loss_reinforce(old_log_prob, log_prob, advantages, mask, loss_agg_mode,
                                                 rollout_is_weights=w,
                                                 global_batch_info=ppo_kwargs.get("global_batch_info"))
    elif loss_type == "ppo_clip":
        loss, pm = compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, mask, loss_agg_mode,
                                               rollout_is_weights=None, **ppo_kwargs)
    else:
        raise ValueError(f"Invalid loss_type: {loss_type}. Must be 'reinforce' or 'ppo_clip'.")
    pm.update(rm)
    return loss, pm


# ----------------------------------------------------------------------------- core_algos: KL + advantages
def kl_penalty_forward(logprob, ref_logprob, kl_penalty):
    """Port of core_algos.kl_penalty_forward (k1/kl, abs, k2/mse, k3/low_var_kl clamped). Re-checked for issue 30
    against verl/trainer/ppo/core_algos.py:1867-1897 at b178a3cd: only k3/low_var_kl clamps."""
    lp, ref = np.asarray(logprob, dtype=np.float64), np.asarray(ref_logprob, dtype=np.float64)
    if kl_penalty in ("kl", "k1"):
        return lp - ref
    if kl_penalty == "abs":
        return np.abs(lp - ref)
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (lp - ref) ** 2
    if kl_penalty in ("low_var_kl", "k3"):
        kl = np.clip(ref - lp, -20, 20)
        return np.clip(np.exp(kl) - kl - 1, -10, 10)
    raise NotImplementedError


def kl_penalty(logprob, ref_logprob, kl_penalty):
    """Port of core_algos.kl_penalty. The '+' suffix (straight-through k2 gradient) has the forward value."""
    base = kl_penalty[:-1] if kl_penalty.endswith("+") else kl_penalty
    return kl_penalty_forward(logprob, ref_logprob, base)


def compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                   norm_adv_by_std_in_grpo=True):
    """Port of core_algos.compute_grpo_outcome_advantage (unbiased std; singleton group -> mean 0, std 1)."""
    scores = np.asarray(token_level_rewards, dtype=np.float64).sum(-1)
    out = scores.copy()
    groups: dict[Any, list[int]] = {}
    for i, g in enumerate(index):
        groups.setdefault(g, []).append(i)
    for g, ids in groups.items():
        s = scores[ids]
        mean, std = (0.0, 1.0) if len(ids) == 1 else (s.mean(), np.std(s, ddof=1))
        out[ids] = (s - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else s - mean
    adv = out[:, None] * np.asarray(response_mask, dtype=np.float64)
    return adv, adv


def compute_rloo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6):
    """Port of core_algos.compute_rloo_outcome_advantage (singleton group keeps the raw score)."""
    scores = np.asarray(token_level_rewards, dtype=np.float64).sum(-1)
    out = scores.copy()
    groups: dict[Any, list[int]] = {}
    for i, g in enumerate(index):
        groups.setdefault(g, []).append(i)
    for g, ids in groups.items():
        n = len(ids)
        if n > 1:
            mean = scores[ids].mean()
            out[ids] = scores[ids] * n / (n - 1) - mean * n / (n - 1)
    adv = out[:, None] * np.asarray(response_mask, dtype=np.float64)
    return adv, adv


def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards, response_mask, gamma=1.0):
    """Port of core_algos.compute_reinforce_plus_plus_outcome_advantage (discounted return, masked whiten)."""
    r = np.asarray(token_level_rewards, dtype=np.float64)
    m = np.asarray(response_mask, dtype=np.float64)
    returns = np.zeros_like(r)
    running = np.zeros(r.shape[0])
    for t in reversed(range(r.shape[1])):
        running = r[:, t] + gamma * running
        returns[:, t] = running
        running = running * m[:, t]
    return masked_whiten(returns, m) * m, returns
