"""Batch diagnostics of the train/inference mismatch, importance weights, rejection and staleness.

Each diagnostic is split into a per-sequence pass (``*_row_stats``: sums, counts, extrema and centred moments
of ONE sequence, vmapped over the batch) and a batch combination (``*_from_rows``) on [B] arrays. The per-sequence
passes are statistics in the sense of ``_fused_reductions``: generators that yield the [T] arrays they reduce, so
that the pipeline reduces those of every diagnostic (and its own) together, one variadic reduction per round, inside
its own per-sequence pass; every [B, T] array is read once. The public ``*_metrics`` functions compose the two for
standalone use. The per-sequence passes take float32 values that
are already 0 at padding (the pipeline's cleaning, or ``zero_padding`` in the public functions), so a sum of a
quantity that is 0 at padding needs no mask.

All statistics use the ORIGINAL response mask. Per-sequence statistics skip empty rows (no valid token) and are
0 when every row is empty. Keys follow verl's ``rollout_corr/`` names. Every value is a float32 scalar, finite
even for an all-rejected or all-padding batch.
"""

import jax
import jax.numpy as jnp

from corrections._fused_reductions import Reductions, Statistic, vmap_statistic
from corrections._masked import (
    METRIC_LOGPROB_FLOOR,
    clamp_log_ratio,
    masked_max,
    masked_min,
    masked_sum,
    safe_exp,
    zero_padding,
)

PREFIX = "rollout_corr/"

Metrics = dict[str, jax.Array]
"""Named arrays: a batch's metrics (scalars), or the per-row statistics they are combined from ([B] each)."""


def _ratio(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
    """``numerator / denominator``, 0 where the denominator is 0."""
    return jnp.where(denominator > 0, numerator / jnp.where(denominator > 0, denominator, 1.0), 0.0)


def _pooled_moments(count: jax.Array, mean: jax.Array, m2: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Chan's parallel combination of per-row (count, mean, sum of squared deviations) -> (total, mean, m2)."""
    total = jnp.sum(count)
    pooled_mean = _ratio(jnp.sum(count * mean), total)
    return total, pooled_mean, jnp.sum(m2) + jnp.sum(count * (mean - pooled_mean) ** 2)


def _correlation(comoment: jax.Array, m2_x: jax.Array, m2_y: jax.Array, count: jax.Array,
                 min_variance: float = 1e-10) -> jax.Array:
    """Pearson correlation from pooled moments; 0 when either side is constant (variance below float32 noise)."""
    constant = (m2_x <= min_variance * count) | (m2_y <= min_variance * count)
    return jnp.where(constant, 0.0, _ratio(comoment, jnp.sqrt(m2_x * m2_y)))


def _valid_extremum(reduced: jax.Array, count: jax.Array) -> jax.Array:
    """A masked maximum or minimum from the reduction of ``where(valid, x, -+inf)``: 0 for an empty sequence."""
    return jnp.where(count > 0, reduced, 0.0)


def _square_deviations(x: jax.Array, mean: jax.Array, valid: jax.Array) -> jax.Array:
    return jnp.where(valid, (x - mean) ** 2, 0.0)


def mismatch_row_stats(old_logprobs: jax.Array, rollout_logprobs: jax.Array | None, mask: jax.Array) -> Statistic:
    """Per-sequence partial statistics of ``mismatch_metrics`` for ONE sequence ([T] arrays, 0 at padding).
    Without rollout logprobs (None) only the training-policy ones (verl's ``compute_offpolicy_metrics``)."""
    old = jnp.maximum(old_logprobs, METRIC_LOGPROB_FLOOR)
    roll = None if rollout_logprobs is None else jnp.maximum(rollout_logprobs, METRIC_LOGPROB_FLOOR)
    valid = jnp.asarray(mask).astype(bool)
    sums = {"count": valid.astype(jnp.float32), "old": old}
    if roll is None:
        first = yield Reductions(sums=sums)
        return {"count": first.sums["count"], "mean_old": _ratio(first.sums["old"], first.sums["count"])}
    lr = clamp_log_ratio(old - roll)  # like roll - old and |old - roll|: 0 at padding, summed unmasked
    rho = safe_exp(lr)
    abs_diff = jnp.abs(old - roll)
    first = yield Reductions(
        sums=dict(sums, roll=roll, rho=jnp.where(valid, rho, 0.0), kl=roll - old, k3=jnp.expm1(lr) - lr,
                  rho2=jnp.where(valid, jnp.exp(2.0 * lr), 0.0), log_ratio=lr, abs_diff=abs_diff),
        maxima={"abs_diff": abs_diff, "rho": jnp.where(valid, rho, -jnp.inf)},
        minima={"rho": jnp.where(valid, rho, jnp.inf)})
    count = first.sums["count"]
    mean_old, mean_roll, mean_rho = (_ratio(first.sums[name], count) for name in ("old", "roll", "rho"))
    second = yield Reductions(sums={
        "m2_old": _square_deviations(old, mean_old, valid),
        "m2_roll": _square_deviations(roll, mean_roll, valid),
        "m2_rho": _square_deviations(rho, mean_rho, valid),
        "comoment": jnp.where(valid, (old - mean_old) * (roll - mean_roll), 0.0),
    })
    return {
        "count": count,
        "sum_kl": first.sums["kl"],
        "sum_k3": first.sums["k3"],
        "sum_rho2": first.sums["rho2"],
        "seq_log_ratio": clamp_log_ratio(first.sums["log_ratio"]),
        "mean_old": mean_old,
        "mean_roll": mean_roll,
        "m2_old": second.sums["m2_old"],
        "m2_roll": second.sums["m2_roll"],
        "comoment": second.sums["comoment"],
        "sum_abs_diff": first.sums["abs_diff"],
        "max_abs_diff": jnp.maximum(first.maxima["abs_diff"], 0.0),  # 0 at padding and for an empty sequence
        "mean_rho": mean_rho,
        "m2_rho": second.sums["m2_rho"],
        "max_rho": _valid_extremum(first.maxima["rho"], count),
        "min_rho": _valid_extremum(first.minima["rho"], count),
    }


def mismatch_from_rows(stats: Metrics) -> Metrics:
    """Combines [B] ``mismatch_row_stats`` into the batch metrics (see ``mismatch_metrics``)."""
    count = stats["count"]
    rows = count > 0
    tokens = jnp.sum(count)
    mt = stats["mean_old"]

    def row_mean(x: jax.Array) -> jax.Array:
        return _ratio(masked_sum(x, rows), jnp.sum(rows))

    metrics = {"training_ppl": row_mean(safe_exp(-mt)), "training_log_ppl": row_mean(-mt)}
    if "mean_roll" not in stats:
        return {PREFIX + k: v.astype(jnp.float32) for k, v in metrics.items()}
    mr = stats["mean_roll"]
    diff = mr - mt
    _, pooled_old, m2_old = _pooled_moments(count, mt, stats["m2_old"])
    _, pooled_roll, m2_roll = _pooled_moments(count, mr, stats["m2_roll"])
    _, mean_rho, m2_rho = _pooled_moments(count, stats["mean_rho"], stats["m2_rho"])
    comoment = jnp.sum(stats["comoment"]) + jnp.sum(count * (mt - pooled_old) * (mr - pooled_roll))
    metrics.update({
        "kl": _ratio(jnp.sum(stats["sum_kl"]), tokens),
        "k3_kl": _ratio(jnp.sum(stats["sum_k3"]), tokens),
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
        "token_ratio_mean": mean_rho,
        "token_ratio_std": jnp.sqrt(_ratio(m2_rho, tokens)),
        "token_ratio_max": masked_max(stats["max_rho"], rows),
        "token_ratio_min": masked_min(stats["min_rho"], rows),
    })
    return {PREFIX + k: v.astype(jnp.float32) for k, v in metrics.items()}


def mismatch_metrics(old_logprobs: jax.Array, rollout_logprobs: jax.Array | None, mask: jax.Array) -> Metrics:
    """Train/inference mismatch between ``old`` (trainer) and ``roll`` (server) logprobs on [B, T].

    ``kl = masked_mean(roll - old)``; ``k3_kl = masked_mean(exp(lr) - lr - 1)`` with ``lr = clamp(old - roll)``
    (verl does not clamp there and can emit inf); per-row mean logprobs ``mt_b = masked_mean_b(old)``,
    ``mr_b = masked_mean_b(roll)`` give ``training_ppl = mean_b exp(-mt_b)`` (exponent clamped to 20),
    ``training_log_ppl = mean_b(-mt_b)``,
    the rollout ones likewise, ``log_ppl_diff = mean_b(mr_b - mt_b)`` (verl's sign: training log-ppl minus
    rollout log-ppl), its abs mean, max and min, ``ppl_ratio = mean_b exp(mr_b - mt_b)``;
    ``chi2_token = masked_mean(exp(lr)^2) - 1``, ``chi2_seq = mean_b exp(2*clamp(sum_b lr)) - 1``; logprob abs
    difference (mean, max), the Pearson correlation of the two logprobs over valid tokens, and the statistics of
    the per-token unbounded ratio ``exp(lr)`` over valid tokens, ``token_ratio_{mean,std,max,min}`` (population
    std; SkyRL's ``is_ratio_*`` without its padding quirks). ``rollout_logprobs=None`` gives only
    ``training_ppl`` and ``training_log_ppl`` (verl without rollout logprobs). Logprobs below
    ``METRIC_LOGPROB_FLOOR`` (-1e4) count as -1e4, so every metric stays finite for any finite input.

    >>> import numpy as np
    >>> m = mismatch_metrics(np.log([[0.5, 0.5]]), np.log([[0.5, 0.5]]), np.ones((1, 2)))
    >>> float(m["rollout_corr/kl"]), float(m["rollout_corr/chi2_token"]), float(m["rollout_corr/training_ppl"])
    (0.0, 0.0, 2.0)
    """
    old = zero_padding(old_logprobs, mask)
    if rollout_logprobs is None:
        return mismatch_from_rows(vmap_statistic(lambda o, m: mismatch_row_stats(o, None, m))(old, mask))
    return mismatch_from_rows(vmap_statistic(mismatch_row_stats)(old, zero_padding(rollout_logprobs, mask), mask))


def weight_row_stats(weights: jax.Array, raw_ratios: jax.Array, mask: jax.Array, cap: float, low: float | None = None,
                     bounds: tuple[float, float | None] | None = None, applied: jax.Array | None = None,
                     weighted: bool = True) -> Statistic:
    """Per-sequence partial statistics of ``weight_metrics`` for ONE sequence: ``weights`` are the bounded ratios
    of every valid token (0 at padding), ``raw_ratios`` the unbounded ones; ``low`` (> 0) is the lower bound the
    low fractions use (else ``1 / cap``); with ``bounds = (low, high)`` (``high`` may be None) also the valid
    tokens whose raw ratio lies outside them; ``applied`` the weights the loss uses, for batch normalisation;
    ``weighted=False``: no importance weights are configured (``weights`` are 1), so no token counts as clipped."""
    valid = jnp.asarray(mask).astype(bool)
    lower = low if low else 1.0 / cap
    sums = {"count": valid.astype(jnp.float32), "weights": weights, "raw": jnp.where(valid, raw_ratios, 0.0),
            "squares": weights**2, "above_cap": (valid & (raw_ratios > cap)).astype(jnp.float32),
            "below_low": (valid & (raw_ratios < lower)).astype(jnp.float32),
            "clipped": (valid & (weights != raw_ratios) & weighted).astype(jnp.float32)}
    if bounds is not None:
        bound_low, bound_high = bounds
        outside = (raw_ratios < bound_low) | (raw_ratios > (jnp.inf if bound_high is None else bound_high))
        sums["out_of_bounds"] = (valid & outside).astype(jnp.float32)
    if applied is not None:
        sums["applied"] = jnp.where(valid, applied, 0.0)
    first = yield Reductions(sums=sums,
                             maxima={"weights": jnp.where(valid, weights, -jnp.inf),
                                     "raw": jnp.where(valid, raw_ratios, -jnp.inf)},
                             minima={"weights": jnp.where(valid, weights, jnp.inf)})
    count = first.sums["count"]
    mean = _ratio(first.sums["weights"], count)
    second = yield Reductions(sums={"m2": _square_deviations(weights, mean, valid)})
    raw_mean = _ratio(first.sums["raw"], count)
    row_ratio = _valid_extremum(first.maxima["raw"], count)  # a sequence-level ratio: the same at every valid token
    extra: Metrics = {}
    if bounds is not None:
        extra["out_of_bounds"] = first.sums["out_of_bounds"]
    if applied is not None:
        extra["applied_mean"] = _ratio(first.sums["applied"], count)
    return extra | {
        "count": count,
        "mean": mean,
        "m2": second.sums["m2"],
        "sum_squares": first.sums["squares"],
        "max": _valid_extremum(first.maxima["weights"], count),
        "min": _valid_extremum(first.minima["weights"], count),
        "above_cap": first.sums["above_cap"],
        "below_low": first.sums["below_low"],
        "row_ratio": row_ratio,
        "row_above": (row_ratio > cap).astype(jnp.float32),
        "row_below": (row_ratio < lower).astype(jnp.float32),
        "raw_mean_above": (raw_mean > cap).astype(jnp.float32),
        "raw_mean_below": (raw_mean < lower).astype(jnp.float32),
        "clipped": first.sums["clipped"],
    }


def with_weight_scale(stats: Metrics, scale: jax.Array) -> Metrics:
    """``weight_row_stats`` that also record the divisor of batch normalisation (the metrics stay those of the
    weights before it, as verl reports them)."""
    return dict(stats, scale=jnp.broadcast_to(scale, stats["count"].shape))


def weight_from_rows(stats: Metrics, level: str = "token") -> Metrics:
    """Combines [B] ``weight_row_stats`` into the batch metrics (see ``weight_metrics``)."""
    count = stats["count"]
    rows = count > 0
    n_rows = jnp.sum(rows)
    total, mean, m2 = _pooled_moments(count, stats["mean"], stats["m2"])
    mean_square = _ratio(jnp.sum(stats["sum_squares"]), total)

    def row_fraction(x: jax.Array) -> jax.Array:
        return _ratio(masked_sum(x, rows), n_rows)

    if level == "token":
        high, low = _ratio(jnp.sum(stats["above_cap"]), total), _ratio(jnp.sum(stats["below_low"]), total)
        largest, smallest = masked_max(stats["max"], rows), masked_min(stats["min"], rows)
    else:  # verl's sequence level: rows, and the raw sequence ratios
        high, low = row_fraction(stats["row_above"]), row_fraction(stats["row_below"])
        largest, smallest = masked_max(stats["row_ratio"], rows), masked_min(stats["row_ratio"], rows)
    seq = stats["mean"]
    seq_mean = row_fraction(seq)
    seq_var = _ratio(masked_sum((seq - seq_mean) ** 2, rows), n_rows - 1.0)
    metrics = {
        "rollout_is_mean": mean,
        "rollout_is_std": jnp.sqrt(_ratio(m2, total)),
        "rollout_is_max": largest,
        "rollout_is_min": smallest,
        "rollout_is_ratio_fraction_high": high,
        "rollout_is_ratio_fraction_low": low,
        "rollout_is_eff_sample_size": jnp.where(mean > 0, _ratio(mean * mean, mean_square), 0.0),
        "rollout_is_seq_mean": seq_mean,
        "rollout_is_seq_std": jnp.sqrt(jnp.maximum(seq_var, 0.0)),
        "rollout_is_seq_max": masked_max(seq, rows),
        "rollout_is_seq_min": masked_min(seq, rows),
        "rollout_is_seq_max_deviation": masked_max(jnp.abs(seq - 1.0), rows),
        "rollout_is_seq_fraction_high": row_fraction(stats["raw_mean_above"]),
        "rollout_is_seq_fraction_low": row_fraction(stats["raw_mean_below"]),
        "tis_clipfrac": row_fraction(_ratio(stats["clipped"], count)),
    }
    if "out_of_bounds" in stats:  # verl's metric for "lo_up" (IcePop) thresholds
        metrics["rollout_is_oob_ratio"] = _ratio(jnp.sum(stats["out_of_bounds"]), total)
    if "scale" in stats:  # the divisor of batch normalisation (the mean over rows, should micro-batches differ)
        metrics["rollout_is_batch_norm_factor"] = jnp.mean(stats["scale"])
    return {PREFIX + k: v for k, v in metrics.items()}


def weight_metrics(weights: jax.Array, raw_ratios: jax.Array, mask: jax.Array, cap: float, low: float | None = None,
                   level: str = "token") -> Metrics:
    """Importance-weight statistics over valid tokens, verl's: mean, std, max, min of the (bounded) weights, the
    fraction of raw ratios above ``cap`` and below ``low`` (``1/cap`` without one), the effective sample size
    (see ``effective_sample_size``), the per-sequence ``rollout_is_seq_*`` (over non-empty rows: the row means
    of the weights; the fractions from the row means of the raw ratios), and slime's ``tis_clipfrac`` (mean over
    rows of the fraction of tokens whose weight differs from the raw ratio). At a sequence ``level`` (sequence or
    geometric) max, min and the fractions are those of the rows' raw ratios, as verl's.

    >>> import numpy as np
    >>> m = weight_metrics(np.array([[1.0, 2.0, 0.0]]), np.array([[1.0, 3.0, 0.0]]), np.array([[1, 1, 0]]), 2.0)
    >>> [round(float(m[PREFIX + k]), 4) for k in ("rollout_is_mean", "rollout_is_std",
    ...                                           "rollout_is_ratio_fraction_high", "rollout_is_eff_sample_size")]
    [1.5, 0.5, 0.5, 0.9]
    """
    weights, raw_ratios = zero_padding(weights, mask), zero_padding(raw_ratios, mask)
    row_stats = vmap_statistic(lambda w, r, m: weight_row_stats(w, r, m, cap, low))(weights, raw_ratios, mask)
    return weight_from_rows(row_stats, level)


def effective_sample_size(weights: jax.Array, mask: jax.Array) -> jax.Array:
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


def rejection_row_stats(keep: jax.Array, mask: jax.Array) -> Statistic:
    """For ONE sequence: valid tokens a rule rejected, and whether it touched the sequence."""
    valid = jnp.asarray(mask).astype(bool)
    reduced = yield Reductions(sums={"count": valid.astype(jnp.float32),
                                     "rejected": (valid & ~jnp.asarray(keep).astype(bool)).astype(jnp.float32)})
    rejected = reduced.sums["rejected"]
    return {"count": reduced.sums["count"], "rejected": rejected, "touched": (rejected > 0).astype(jnp.float32)}


def rejection_from_rows(name: str, stats: Metrics) -> Metrics:
    """Combines [B] ``rejection_row_stats`` into ``{name}_masked_fraction`` and ``{name}_seq_masked_fraction``."""
    rows = (stats["count"] > 0).astype(jnp.float32)
    return {
        f"{PREFIX}{name}_masked_fraction": _ratio(jnp.sum(stats["rejected"]), jnp.sum(stats["count"])),
        f"{PREFIX}{name}_seq_masked_fraction": _ratio(jnp.sum(stats["touched"] * rows), jnp.sum(rows)),
    }


def row_fraction_mean(stats: Metrics) -> jax.Array:
    """The mean over non-empty rows of each row's rejected fraction (slime's ``opsm_clipfrac``, a sum of
    per-sample means divided by the sample count) from [B] ``rejection_row_stats``."""
    rows = stats["count"] > 0
    return _ratio(masked_sum(_ratio(stats["rejected"], stats["count"]), rows), jnp.sum(rows))


def behave_row_stats(log_ratio: jax.Array, behave: jax.Array) -> Statistic:
    """For ONE sequence: AReaL's ``behave_approx_kl`` sums over its ``behave`` tokens (kept, weight > 0): the
    log-ratio ``lr`` and AReaL's k3 of it, ``exp(-lr) - 1 + lr`` (lr clamped to [-20, 20])."""
    lr = clamp_log_ratio(log_ratio)
    reduced = yield Reductions(sums={"count": behave.astype(jnp.float32), "sum": jnp.where(behave, lr, 0.0),
                                     "sum_k3": jnp.where(behave, jnp.expm1(-lr) + lr, 0.0)})
    return dict(reduced.sums)


def behave_from_rows(stats: Metrics) -> Metrics:
    """AReaL's ``behave_approx_kl`` (mean of ``prox - behave`` over its tokens) and its k3 form."""
    tokens = jnp.sum(stats["count"])
    return {PREFIX + "behave_approx_kl": _ratio(jnp.sum(stats["sum"]), tokens),
            PREFIX + "behave_approx_kl_k3": _ratio(jnp.sum(stats["sum_k3"]), tokens)}


def rule_statistic_row_stats(token_stat: jax.Array, seq_stat: jax.Array | None, mask: jax.Array, upper: float,
                             lower: float | None) -> Statistic:
    """For ONE sequence and one k-family rule on its own (verl's ``compute_rs_metrics``): ``token_stat`` [T] the
    per-token statistic, ``seq_stat`` the sequence's (None for a token rule), ``upper`` / ``lower`` the bounds the
    statistic must stay within (``lower`` None: no lower fraction, 0 is the clamp of the std)."""
    valid = jnp.asarray(mask).astype(bool)
    per_token = token_stat if seq_stat is None else jnp.broadcast_to(seq_stat, token_stat.shape)
    clamped = jnp.clip(per_token, 0.0 if lower is None else lower, upper)
    lower = -jnp.inf if lower is None else lower
    sums = {"count": valid.astype(jnp.float32), "sum": jnp.where(valid, per_token, 0.0),
            "clamped_sum": jnp.where(valid, clamped, 0.0), "clamped_square_sum": jnp.where(valid, clamped**2, 0.0)}
    maxima: Metrics = {}
    minima: Metrics = {}
    if seq_stat is None:
        sums.update(high=(valid & (token_stat > upper)).astype(jnp.float32),
                    low=(valid & (token_stat < lower)).astype(jnp.float32))
        maxima["stat"], minima["stat"] = jnp.where(valid, token_stat, -jnp.inf), jnp.where(valid, token_stat, jnp.inf)
    reduced = yield Reductions(sums=sums, maxima=maxima, minima=minima)
    count = reduced.sums["count"]
    if seq_stat is None:
        seq = _ratio(reduced.sums["sum"], count)
        high, low = reduced.sums["high"], reduced.sums["low"]
        largest = _valid_extremum(reduced.maxima["stat"], count)
        smallest = _valid_extremum(reduced.minima["stat"], count)
    else:
        seq = seq_stat
        high, low = (seq_stat > upper).astype(jnp.float32), (seq_stat < lower).astype(jnp.float32)
        largest = smallest = seq_stat
    return {"count": count, "sum": reduced.sums["sum"], "clamped_sum": reduced.sums["clamped_sum"],
            "clamped_square_sum": reduced.sums["clamped_square_sum"], "max": largest, "min": smallest,
            "high": high, "low": low, "seq": seq, "seq_high": (seq > upper).astype(jnp.float32),
            "seq_low": (seq < lower).astype(jnp.float32)}


def rule_statistic_from_rows(name: str, stats: Metrics, token_level: bool, has_lower: bool) -> Metrics:
    """Combines [B] ``rule_statistic_row_stats`` into verl's ``{name}_{mean,std,max,min,fraction_high,
    fraction_low}`` and ``{name}_seq_{mean,std,max,min,max_deviation,fraction_high[,fraction_low]}`` over valid
    tokens and non-empty rows (verl's std: population std of the statistic clamped to its bounds)."""
    count = stats["count"]
    rows = count > 0
    tokens, n_rows = jnp.sum(count), jnp.sum(rows)

    def row_mean(x: jax.Array) -> jax.Array:
        return _ratio(masked_sum(x, rows), n_rows)

    mean_clamped = _ratio(jnp.sum(stats["clamped_sum"]), tokens)
    variance = _ratio(jnp.sum(stats["clamped_square_sum"]), tokens) - mean_clamped**2
    seq = stats["seq"]
    seq_mean = row_mean(seq)
    if token_level:
        high, low = _ratio(jnp.sum(stats["high"]), tokens), _ratio(jnp.sum(stats["low"]), tokens)
    else:
        high, low = row_mean(stats["high"]), row_mean(stats["low"])
    metrics = {
        "mean": _ratio(jnp.sum(stats["sum"]), tokens),
        "std": jnp.where(tokens > 1, jnp.sqrt(jnp.maximum(variance, 0.0)), 0.0),
        "max": masked_max(stats["max"], rows),
        "min": masked_min(stats["min"], rows),
        "fraction_high": high,
        "fraction_low": low if has_lower else jnp.float32(0.0),
        "seq_mean": seq_mean,
        "seq_std": jnp.sqrt(jnp.maximum(_ratio(masked_sum((seq - seq_mean) ** 2, rows), n_rows - 1.0), 0.0)),
        "seq_max": masked_max(seq, rows),
        "seq_min": masked_min(seq, rows),
        "seq_max_deviation": masked_max(jnp.abs(seq), rows),
        "seq_fraction_high": row_mean(stats["seq_high"]),
    }
    if has_lower:
        metrics["seq_fraction_low"] = row_mean(stats["seq_low"])
    return {f"{PREFIX}{name}_{k}": v for k, v in metrics.items()}


def over_under_from_rows(name: str, stats: Metrics) -> Metrics:
    """SkyRL's ``{name}_over_high_ratio`` / ``{name}_under_low_ratio``: the fraction of non-empty rows whose
    statistic was above / below the rule's bounds (``stats``: [B] ``count``, ``over``, ``under``)."""
    rows = stats["count"] > 0
    n_rows = jnp.sum(rows)
    return {f"{PREFIX}{name}_over_high_ratio": _ratio(masked_sum(stats["over"], rows), n_rows),
            f"{PREFIX}{name}_under_low_ratio": _ratio(masked_sum(stats["under"], rows), n_rows)}


def rejection_metrics(name: str, keep: jax.Array, mask: jax.Array) -> Metrics:
    """For one rule: the fraction of valid tokens it rejects, and of non-empty sequences it touches.

    >>> import numpy as np
    >>> m = rejection_metrics("geo", np.array([[1, 1, 0], [0, 0, 0]]), np.array([[1, 1, 0], [1, 1, 1]]))
    >>> {k: round(float(v), 4) for k, v in m.items()}
    {'rollout_corr/geo_masked_fraction': 0.6, 'rollout_corr/geo_seq_masked_fraction': 0.5}
    """
    return rejection_from_rows(name, vmap_statistic(rejection_row_stats)(keep, mask))


def staleness_metrics(policy_lag: jax.Array, mask: jax.Array) -> Metrics:
    """Policy-version lag (learner version - token version) over valid tokens: mean and max.

    >>> import numpy as np
    >>> {k: float(v) for k, v in staleness_metrics(np.array([[0, 2], [1, 9]]), np.array([[1, 1], [1, 0]])).items()}
    {'rollout_corr/staleness_mean': 1.0, 'rollout_corr/staleness_max': 2.0}
    """
    return staleness_from_rows(vmap_statistic(staleness_row_stats)(zero_padding(policy_lag, mask), mask))


def staleness_row_stats(policy_lag: jax.Array, mask: jax.Array) -> Statistic:
    """For ONE sequence (``policy_lag`` float32, 0 at padding): valid tokens, their summed lag and the largest."""
    valid = jnp.asarray(mask).astype(bool)
    reduced = yield Reductions(sums={"count": valid.astype(jnp.float32), "sum": policy_lag},
                               maxima={"max": jnp.where(valid, policy_lag, -jnp.inf)})
    count = reduced.sums["count"]
    return {"count": count, "sum": reduced.sums["sum"], "max": _valid_extremum(reduced.maxima["max"], count)}


def staleness_from_rows(stats: Metrics) -> Metrics:
    """Combines [B] ``staleness_row_stats`` into ``staleness_mean`` and ``staleness_max``."""
    return {
        PREFIX + "staleness_mean": _ratio(jnp.sum(stats["sum"]), jnp.sum(stats["count"])),
        PREFIX + "staleness_max": masked_max(stats["max"], stats["count"] > 0),
    }
