"""Batch diagnostics of the train/inference mismatch, importance weights, rejection and staleness.

Each diagnostic is split into a per-sequence pass (``*_row_stats``: sums, counts, extrema and centred moments
of ONE sequence, vmapped over the batch) and a batch combination (``*_from_rows``) on [B] arrays. The pipeline
runs the per-sequence passes inside its own per-sequence pass, so every [B, T] array is read once; the public
``*_metrics`` functions compose the two for standalone use. The per-sequence passes take float32 values that
are already 0 at padding (the pipeline's cleaning, or ``zero_padding`` in the public functions), so a sum of a
quantity that is 0 at padding needs no mask.

All statistics use the ORIGINAL response mask. Per-sequence statistics skip empty rows (no valid token) and are
0 when every row is empty. Keys follow verl's ``rollout_corr/`` names. Every value is a float32 scalar, finite
even for an all-rejected or all-padding batch.
"""

import jax
import jax.numpy as jnp

from corrections._masked import (
    clamp_log_ratio, masked_count, masked_max, masked_min, masked_sum, safe_exp, zero_padding,
)

PREFIX = "rollout_corr/"


def _ratio(numerator, denominator):
    """``numerator / denominator``, 0 where the denominator is 0."""
    return jnp.where(denominator > 0, numerator / jnp.where(denominator > 0, denominator, 1.0), 0.0)


def _pooled_moments(count, mean, m2):
    """Chan's parallel combination of per-row (count, mean, sum of squared deviations) -> (total, mean, m2)."""
    total = jnp.sum(count)
    pooled_mean = _ratio(jnp.sum(count * mean), total)
    return total, pooled_mean, jnp.sum(m2) + jnp.sum(count * (mean - pooled_mean) ** 2)


def _correlation(comoment, m2_x, m2_y, count, min_variance=1e-10):
    """Pearson correlation from pooled moments; 0 when either side is constant (variance below float32 noise)."""
    constant = (m2_x <= min_variance * count) | (m2_y <= min_variance * count)
    return jnp.where(constant, 0.0, _ratio(comoment, jnp.sqrt(m2_x * m2_y)))


def _row_moments(x, mask):
    """(count, mean, sum of squared deviations) of one sequence's valid values; ``x`` is 0 at padding."""
    count = masked_count(mask)
    mean = _ratio(jnp.sum(x), count)
    return count, mean, masked_sum((x - mean) ** 2, mask)


def mismatch_row_stats(old_logprobs, rollout_logprobs, mask) -> dict:
    """Per-sequence partial statistics of ``mismatch_metrics`` for ONE sequence ([T] arrays, 0 at padding)."""
    old, roll, valid = old_logprobs, rollout_logprobs, jnp.asarray(mask).astype(bool)
    lr = clamp_log_ratio(old - roll)  # like roll - old and |old - roll|: 0 at padding, summed unmasked
    count, mean_old, m2_old = _row_moments(old, valid)
    _, mean_roll, m2_roll = _row_moments(roll, valid)
    abs_diff = jnp.abs(old - roll)
    return {
        "count": count,
        "sum_kl": jnp.sum(roll - old),
        "sum_k3": jnp.sum(jnp.expm1(lr) - lr),
        "sum_rho2": masked_sum(jnp.exp(2.0 * lr), valid),
        "seq_log_ratio": clamp_log_ratio(jnp.sum(lr)),
        "mean_old": mean_old,
        "mean_roll": mean_roll,
        "m2_old": m2_old,
        "m2_roll": m2_roll,
        "comoment": masked_sum((old - mean_old) * (roll - mean_roll), valid),
        "sum_abs_diff": jnp.sum(abs_diff),
        "max_abs_diff": jnp.max(abs_diff, initial=0.0),  # >= 0, and 0 at padding and for an empty sequence
    }


def mismatch_from_rows(stats: dict) -> dict:
    """Combines [B] ``mismatch_row_stats`` into the batch metrics (see ``mismatch_metrics``)."""
    count = stats["count"]
    rows = count > 0
    tokens = jnp.sum(count)
    mt, mr = stats["mean_old"], stats["mean_roll"]
    diff = mr - mt
    _, pooled_old, m2_old = _pooled_moments(count, mt, stats["m2_old"])
    _, pooled_roll, m2_roll = _pooled_moments(count, mr, stats["m2_roll"])
    comoment = jnp.sum(stats["comoment"]) + jnp.sum(count * (mt - pooled_old) * (mr - pooled_roll))
    row_mean = lambda x: _ratio(masked_sum(x, rows), jnp.sum(rows))  # noqa: E731
    metrics = {
        "kl": _ratio(jnp.sum(stats["sum_kl"]), tokens),
        "k3_kl": _ratio(jnp.sum(stats["sum_k3"]), tokens),
        "training_ppl": row_mean(safe_exp(-mt)),
        "training_log_ppl": row_mean(-mt),
        "rollout_ppl": row_mean(safe_exp(-mr)),
        "rollout_log_ppl": row_mean(-mr),
        "log_ppl_diff": row_mean(diff),
        "log_ppl_abs_diff": row_mean(jnp.abs(diff)),
        "log_ppl_diff_max": masked_max(diff, rows),
        "log_ppl_diff_min": masked_min(diff, rows),
        "ppl_ratio": row_mean(safe_exp(diff)),
        "chi2_token": jnp.where(tokens > 0, _ratio(jnp.sum(stats["sum_rho2"]), tokens) - 1.0, 0.0),
        "chi2_seq": jnp.where(jnp.any(rows), row_mean(jnp.exp(2.0 * stats["seq_log_ratio"])) - 1.0, 0.0),
        "logprob_abs_diff_mean": _ratio(jnp.sum(stats["sum_abs_diff"]), tokens),
        "logprob_abs_diff_max": masked_max(stats["max_abs_diff"], rows),
        "logprob_pearson_corr": _correlation(comoment, m2_old, m2_roll, tokens),
    }
    return {PREFIX + k: v.astype(jnp.float32) for k, v in metrics.items()}


def mismatch_metrics(old_logprobs, rollout_logprobs, mask) -> dict:
    """Train/inference mismatch between ``old`` (trainer) and ``roll`` (server) logprobs on [B, T].

    ``kl = masked_mean(roll - old)``; ``k3_kl = masked_mean(exp(lr) - lr - 1)`` with ``lr = clamp(old - roll)``
    (verl does not clamp there and can emit inf); per-row mean logprobs ``mt_b = masked_mean_b(old)``,
    ``mr_b = masked_mean_b(roll)`` give ``training_ppl = mean_b exp(-mt_b)`` (exponent clamped to 20), ``training_log_ppl = mean_b(-mt_b)``,
    the rollout ones likewise, ``log_ppl_diff = mean_b(mr_b - mt_b)`` (verl's sign: training log-ppl minus
    rollout log-ppl), its abs mean, max and min, ``ppl_ratio = mean_b exp(mr_b - mt_b)``;
    ``chi2_token = masked_mean(exp(lr)^2) - 1``, ``chi2_seq = mean_b exp(2*clamp(sum_b lr)) - 1``; logprob abs
    difference (mean, max) and the Pearson correlation of the two logprobs over valid tokens.

    >>> import numpy as np
    >>> m = mismatch_metrics(np.log([[0.5, 0.5]]), np.log([[0.5, 0.5]]), np.ones((1, 2)))
    >>> float(m["rollout_corr/kl"]), float(m["rollout_corr/chi2_token"]), float(m["rollout_corr/training_ppl"])
    (0.0, 0.0, 2.0)
    """
    old, roll = zero_padding(old_logprobs, mask), zero_padding(rollout_logprobs, mask)
    return mismatch_from_rows(jax.vmap(mismatch_row_stats)(old, roll, mask))


def weight_row_stats(weights, raw_ratios, mask, cap: float, bounds: tuple | None = None) -> dict:
    """Per-sequence partial statistics of ``weight_metrics`` for ONE sequence (``weights`` 0 at padding);
    with ``bounds = (low, high)`` (``high`` may be None) also the valid tokens whose raw ratio lies outside them."""
    valid = jnp.asarray(mask).astype(bool)
    count, mean, m2 = _row_moments(weights, valid)
    extra = {}
    if bounds is not None:
        low, high = bounds
        outside = (raw_ratios < low) | (raw_ratios > (jnp.inf if high is None else high))
        extra["out_of_bounds"] = masked_count(valid & outside)
    return extra | {
        "count": count,
        "mean": mean,
        "m2": m2,
        "sum_squares": jnp.sum(weights**2),
        "max": masked_max(weights, valid),
        "min": masked_min(weights, valid),
        "above_cap": masked_count(valid & (raw_ratios > cap)),
        "below_inverse_cap": masked_count(valid & (raw_ratios < 1.0 / cap)),
    }


def rescale_weight_row_stats(stats: dict, scale) -> dict:
    """``weight_row_stats`` of the same weights divided by ``scale`` (batch normalisation), which each row also
    records; the raw-ratio counts stay as they are."""
    return dict(stats, mean=stats["mean"] / scale, m2=stats["m2"] / scale**2,
                sum_squares=stats["sum_squares"] / scale**2, max=stats["max"] / scale, min=stats["min"] / scale,
                scale=jnp.broadcast_to(scale, stats["count"].shape))


def weight_from_rows(stats: dict) -> dict:
    """Combines [B] ``weight_row_stats`` into the batch metrics (see ``weight_metrics``)."""
    count = stats["count"]
    rows = count > 0
    total, mean, m2 = _pooled_moments(count, stats["mean"], stats["m2"])
    mean_square = _ratio(jnp.sum(stats["sum_squares"]), total)
    metrics = {
        "rollout_is_mean": mean,
        "rollout_is_std": jnp.sqrt(_ratio(m2, total)),
        "rollout_is_max": masked_max(stats["max"], rows),
        "rollout_is_min": masked_min(stats["min"], rows),
        "rollout_is_ratio_fraction_high": _ratio(jnp.sum(stats["above_cap"]), total),
        "rollout_is_ratio_fraction_low": _ratio(jnp.sum(stats["below_inverse_cap"]), total),
        "rollout_is_eff_sample_size": jnp.where(mean > 0, _ratio(mean * mean, mean_square), 0.0),
    }
    if "out_of_bounds" in stats:  # verl's metric for "lo_up" (IcePop) thresholds
        metrics["rollout_is_oob_ratio"] = _ratio(jnp.sum(stats["out_of_bounds"]), total)
    if "scale" in stats:  # the divisor of batch normalisation (the mean over rows, should micro-batches differ)
        metrics["rollout_is_batch_norm_factor"] = jnp.mean(stats["scale"])
    return {PREFIX + k: v for k, v in metrics.items()}


def weight_metrics(weights, raw_ratios, mask, cap: float) -> dict:
    """Importance-weight statistics over valid tokens: mean, std, max, min of the final weights, the fraction
    of raw ratios above ``cap`` and below ``1/cap``, and the effective sample size (see
    ``effective_sample_size``).

    >>> import numpy as np
    >>> m = weight_metrics(np.array([[1.0, 2.0, 0.0]]), np.array([[1.0, 3.0, 0.0]]), np.array([[1, 1, 0]]), 2.0)
    >>> [round(float(m[PREFIX + k]), 4) for k in ("rollout_is_mean", "rollout_is_std",
    ...                                           "rollout_is_ratio_fraction_high", "rollout_is_eff_sample_size")]
    [1.5, 0.5, 0.5, 0.9]
    """
    weights, raw_ratios = zero_padding(weights, mask), zero_padding(raw_ratios, mask)
    return weight_from_rows(jax.vmap(weight_row_stats, in_axes=(0, 0, 0, None))(weights, raw_ratios, mask, cap))


def effective_sample_size(weights, mask) -> jax.Array:
    """``1 / masked_mean(n^2)`` with ``n = w / masked_mean(w)``, i.e. ``mean(w)^2 / mean(w^2)``: the fraction of
    the batch the weights are worth. 0 when every weight is 0 (verl raises ZeroDivisionError there, PR #7559).

    >>> import numpy as np
    >>> float(effective_sample_size(np.array([[1.0, 1.0]]), np.ones((1, 2))))
    1.0
    >>> float(effective_sample_size(np.zeros((1, 2)), np.ones((1, 2))))
    0.0
    """
    weights = jnp.asarray(weights, jnp.float32)
    return weight_metrics(weights, weights, mask, 1.0)[PREFIX + "rollout_is_eff_sample_size"]


def rejection_row_stats(keep, mask) -> dict:
    """For ONE sequence: valid tokens a rule rejected, and whether it touched the sequence."""
    valid = jnp.asarray(mask).astype(bool)
    rejected = masked_count(valid & ~jnp.asarray(keep).astype(bool))
    return {"count": masked_count(valid), "rejected": rejected, "touched": (rejected > 0).astype(jnp.float32)}


def rejection_from_rows(name: str, stats: dict) -> dict:
    """Combines [B] ``rejection_row_stats`` into ``{name}_masked_fraction`` and ``{name}_seq_masked_fraction``."""
    rows = (stats["count"] > 0).astype(jnp.float32)
    return {
        f"{PREFIX}{name}_masked_fraction": _ratio(jnp.sum(stats["rejected"]), jnp.sum(stats["count"])),
        f"{PREFIX}{name}_seq_masked_fraction": _ratio(jnp.sum(stats["touched"] * rows), jnp.sum(rows)),
    }


def rejection_metrics(name: str, keep, mask) -> dict:
    """For one rule: the fraction of valid tokens it rejects, and of non-empty sequences it touches.

    >>> import numpy as np
    >>> m = rejection_metrics("geo", np.array([[1, 1, 0], [0, 0, 0]]), np.array([[1, 1, 0], [1, 1, 1]]))
    >>> {k: round(float(v), 4) for k, v in m.items()}
    {'rollout_corr/geo_masked_fraction': 0.6, 'rollout_corr/geo_seq_masked_fraction': 0.5}
    """
    return rejection_from_rows(name, jax.vmap(rejection_row_stats)(keep, mask))


def staleness_metrics(policy_lag, mask) -> dict:
    """Policy-version lag (learner version - token version) over valid tokens: mean and max.

    >>> import numpy as np
    >>> {k: float(v) for k, v in staleness_metrics(np.array([[0, 2], [1, 9]]), np.array([[1, 1], [1, 0]])).items()}
    {'rollout_corr/staleness_mean': 1.0, 'rollout_corr/staleness_max': 2.0}
    """
    return staleness_from_rows(jax.vmap(staleness_row_stats)(zero_padding(policy_lag, mask), mask))


def staleness_row_stats(policy_lag, mask) -> dict:
    """For ONE sequence (``policy_lag`` float32, 0 at padding): valid tokens, their summed lag and the largest."""
    valid = jnp.asarray(mask).astype(bool)
    return {"count": masked_count(valid), "sum": jnp.sum(policy_lag), "max": masked_max(policy_lag, valid)}


def staleness_from_rows(stats: dict) -> dict:
    """Combines [B] ``staleness_row_stats`` into ``staleness_mean`` and ``staleness_max``."""
    return {
        PREFIX + "staleness_mean": _ratio(jnp.sum(stats["sum"]), jnp.sum(stats["count"])),
        PREFIX + "staleness_max": masked_max(stats["max"], stats["count"] > 0),
    }
