"""Batch diagnostics of the train/inference mismatch, importance weights, rejection and staleness.

All statistics use the ORIGINAL response mask. Per-sequence statistics skip empty rows (no valid token) and
are 0 when every row is empty. Keys follow verl's ``rollout_corr/`` names. Every value is a float32 scalar
device array, finite even for an all-rejected or all-padding batch.
"""

import jax.numpy as jnp

from corrections._masked import (
    clamp_log_ratio,
    masked_count,
    masked_max,
    masked_mean,
    masked_min,
    masked_sum,
    safe_exp,
)

PREFIX = "rollout_corr/"


def _rows(mask):
    return jnp.any(jnp.asarray(mask).astype(bool), axis=-1)


def mismatch_metrics(old_logprobs, rollout_logprobs, mask) -> dict:
    """Train/inference mismatch between ``old`` (trainer) and ``roll`` (server) logprobs on [B, T].

    ``kl = masked_mean(roll - old)``; ``k3_kl = masked_mean(exp(lr) - lr - 1)`` with ``lr = clamp(old - roll)``
    (verl does not clamp there and can emit inf); per-row mean logprobs ``mt_b = masked_mean_b(old)``,
    ``mr_b = masked_mean_b(roll)`` give ``training_ppl = mean_b exp(-mt_b)``, ``training_log_ppl = mean_b(-mt_b)``,
    the rollout ones likewise, ``log_ppl_diff = mean_b(mr_b - mt_b)`` (verl's sign: training log-ppl minus
    rollout log-ppl), its abs mean, max and min, ``ppl_ratio = mean_b exp(mr_b - mt_b)``;
    ``chi2_token = masked_mean(exp(lr)^2) - 1``, ``chi2_seq = mean_b exp(2*clamp(sum_b lr)) - 1``; logprob abs
    difference (mean, max) and the Pearson correlation of the two logprobs over valid tokens.

    >>> import numpy as np
    >>> m = mismatch_metrics(np.log([[0.5, 0.5]]), np.log([[0.5, 0.5]]), np.ones((1, 2)))
    >>> float(m["rollout_corr/kl"]), float(m["rollout_corr/chi2_token"]), float(m["rollout_corr/training_ppl"])
    (0.0, 0.0, 2.0)
    """
    old = jnp.asarray(old_logprobs, jnp.float32)
    roll = jnp.asarray(rollout_logprobs, jnp.float32)
    mask = jnp.asarray(mask)
    rows = _rows(mask)
    lr = clamp_log_ratio(jnp.where(mask.astype(bool), old - roll, 0.0))
    mt = masked_mean(old, mask, axis=-1)
    mr = masked_mean(roll, mask, axis=-1)
    diff = mr - mt
    abs_diff = jnp.abs(old - roll)
    old_centered = old - masked_mean(old, mask)
    roll_centered = roll - masked_mean(roll, mask)
    covariance = masked_mean(old_centered * roll_centered, mask)
    spread = jnp.sqrt(masked_mean(old_centered**2, mask) * masked_mean(roll_centered**2, mask))
    seq_lr = clamp_log_ratio(masked_sum(lr, mask, axis=-1))
    metrics = {
        "kl": masked_mean(roll - old, mask),
        "k3_kl": masked_mean(jnp.expm1(lr) - lr, mask),
        "training_ppl": masked_mean(jnp.exp(-mt), rows),
        "training_log_ppl": masked_mean(-mt, rows),
        "rollout_ppl": masked_mean(jnp.exp(-mr), rows),
        "rollout_log_ppl": masked_mean(-mr, rows),
        "log_ppl_diff": masked_mean(diff, rows),
        "log_ppl_abs_diff": masked_mean(jnp.abs(diff), rows),
        "log_ppl_diff_max": masked_max(diff, rows),
        "log_ppl_diff_min": masked_min(diff, rows),
        "ppl_ratio": masked_mean(safe_exp(diff), rows),
        "chi2_token": jnp.where(jnp.any(mask), masked_mean(jnp.exp(2.0 * lr), mask) - 1.0, 0.0),
        "chi2_seq": jnp.where(jnp.any(rows), masked_mean(jnp.exp(2.0 * seq_lr), rows) - 1.0, 0.0),
        "logprob_abs_diff_mean": masked_mean(abs_diff, mask),
        "logprob_abs_diff_max": masked_max(abs_diff, mask),
        "logprob_pearson_corr": jnp.where(spread > 0, covariance / jnp.where(spread > 0, spread, 1.0), 0.0),
    }
    return {PREFIX + k: v.astype(jnp.float32) for k, v in metrics.items()}


def effective_sample_size(weights, mask) -> jnp.ndarray:
    """``1 / masked_mean(n^2)`` with ``n = w / masked_mean(w)``: the fraction of the batch the weights are
    worth. 0 when every weight is 0 (verl raises ZeroDivisionError there, open PR #7559).

    >>> import numpy as np
    >>> float(effective_sample_size(np.array([[1.0, 1.0]]), np.ones((1, 2)))), float(effective_sample_size(np.zeros((1, 2)), np.ones((1, 2))))
    (1.0, 0.0)
    """
    weights = jnp.asarray(weights, jnp.float32)
    mean = masked_mean(weights, mask)
    normalized = weights / jnp.where(mean > 0, mean, 1.0)
    second_moment = masked_mean(normalized**2, mask)
    return jnp.where((mean > 0) & (second_moment > 0), 1.0 / jnp.where(second_moment > 0, second_moment, 1.0), 0.0)


def weight_metrics(weights, raw_ratios, mask, cap: float) -> dict:
    """Importance-weight statistics over valid tokens: mean, std, max, min of the final weights, the fraction
    of raw ratios above ``cap`` and below ``1/cap``, and the effective sample size."""
    weights = jnp.asarray(weights, jnp.float32)
    mean = masked_mean(weights, mask)
    metrics = {
        "rollout_is_mean": mean,
        "rollout_is_std": jnp.sqrt(jnp.maximum(masked_mean((weights - mean) ** 2, mask), 0.0)),
        "rollout_is_max": masked_max(weights, mask),
        "rollout_is_min": masked_min(weights, mask),
        "rollout_is_ratio_fraction_high": masked_mean((raw_ratios > cap).astype(jnp.float32), mask),
        "rollout_is_ratio_fraction_low": masked_mean((raw_ratios < 1.0 / cap).astype(jnp.float32), mask),
        "rollout_is_eff_sample_size": effective_sample_size(weights, mask),
    }
    return {PREFIX + k: v for k, v in metrics.items()}


def rejection_metrics(name: str, keep, mask) -> dict:
    """For one rule: the fraction of valid tokens it rejects, and of non-empty sequences it touches."""
    mask = jnp.asarray(mask).astype(bool)
    rejected = mask & ~jnp.asarray(keep).astype(bool)
    touched = jnp.any(rejected, axis=-1)
    return {
        f"{PREFIX}{name}_masked_fraction": masked_mean(rejected.astype(jnp.float32), mask),
        f"{PREFIX}{name}_seq_masked_fraction": masked_mean(touched.astype(jnp.float32), _rows(mask)),
    }


def staleness_metrics(policy_lag, mask) -> dict:
    """Policy-version lag (learner version - token version) over valid tokens: mean and max.

    >>> import numpy as np
    >>> {k: float(v) for k, v in staleness_metrics(np.array([[0, 2], [1, 9]]), np.array([[1, 1], [1, 0]])).items()}
    {'rollout_corr/staleness_mean': 1.0, 'rollout_corr/staleness_max': 2.0}
    """
    lag = jnp.asarray(policy_lag, jnp.float32)
    mask = jnp.asarray(mask)
    if lag.ndim == 1:
        lag = jnp.broadcast_to(lag[:, None], mask.shape)
    return {PREFIX + "staleness_mean": masked_mean(lag, mask), PREFIX + "staleness_max": masked_max(lag, mask)}


def count_metrics(mask, final_mask) -> dict:
    """Token counts before and after rejection, and a 0/1 warning when every valid token was rejected."""
    valid = masked_count(mask)
    kept = masked_count(final_mask)
    return {
        PREFIX + "valid_tokens": valid,
        PREFIX + "kept_tokens": kept,
        PREFIX + "all_rejected": ((valid > 0) & (kept == 0)).astype(jnp.float32),
    }
