"""Truncated importance weights for ONE sequence ([T] arrays); ``jax.vmap`` them over the batch.

``log_ratio`` is ``old - roll`` (decoupled) or ``stop_gradient(lp) - roll`` (bypass, slime's off-policy IS).
Weights are always stop-gradient and 0 at padded positions.
"""

import jax
import jax.numpy as jnp

from corrections._masked import clamp_log_ratio, masked_mean, masked_sum, safe_exp


def bound_weights(ratio: jax.Array, low: float, high: float | None, overflow: str) -> jax.Array:
    """Applies ``[low, high]`` to ratios: ``"truncate"`` clips, ``"mask"`` zeroes what falls outside (inclusive)."""
    high = jnp.inf if high is None else high
    if overflow == "truncate":
        return jnp.clip(ratio, low, high)
    return jnp.where((ratio >= low) & (ratio <= high), ratio, 0.0)


def _finish(weights: jax.Array, mask: jax.Array) -> jax.Array:
    return jax.lax.stop_gradient(jnp.where(mask.astype(bool), weights, 0.0))


def unbounded_ratios(log_ratio: jax.Array, mask: jax.Array, level: str = "token",
                     clamp_each_token: bool = False) -> jax.Array:
    """The ratio before any bound, for ONE sequence ([T]; vmap it over a batch), on every position:
    ``exp(clamp(lr))`` per token, or the sequence's ``exp(clamp(sum_t m*lr))`` (``sequence``) or
    ``exp(clamp(masked_mean(lr)))`` (``geometric``; with ``clamp_each_token``, the fw cookbook's
    ``exp(masked_mean(clamp(lr)))``) broadcast.

    >>> import numpy as np
    >>> unbounded_ratios(np.log([2.0, 2.0, 9.0]), np.array([1, 1, 0]), "sequence").tolist()
    [4.0, 4.0, 4.0]
    >>> [round(float(unbounded_ratios(np.array([30.0, 0.0]), np.ones(2), "geometric", c)[0]), 1) for c in (0, 1)]
    [3269017.5, 22026.5]
    """
    log_ratio = jnp.asarray(log_ratio, jnp.float32)
    if level == "token":
        return safe_exp(log_ratio)
    if clamp_each_token:
        log_ratio = clamp_log_ratio(log_ratio)
    reduce = masked_sum if level == "sequence" else masked_mean
    return jnp.broadcast_to(safe_exp(reduce(log_ratio, mask)), log_ratio.shape)


def token_tis_weights(log_ratio: jax.Array, mask: jax.Array, high: float | None = 2.0, low: float = 0.0,
                      overflow: str = "truncate") -> jax.Array:
    """Per-token truncated IS: ``clip(exp(clamp(lr)), low, high)`` (verl/SkyRL token TIS, slime vanilla_tis).

    >>> import numpy as np
    >>> token_tis_weights(np.log(np.array([0.5, 3.0, 1.0])), np.array([1, 1, 0])).tolist()
    [0.5, 2.0, 0.0]
    """
    return _finish(bound_weights(unbounded_ratios(log_ratio, mask, "token"), low, high, overflow), mask)


def sequence_tis_weights(log_ratio: jax.Array, mask: jax.Array, high: float | None = 5.0, low: float = 0.0,
                         overflow: str = "truncate") -> jax.Array:
    """Sequence TIS: ``clip(exp(clamp(sum_t m*lr)), low, high)`` broadcast to every valid token.

    >>> import numpy as np
    >>> sequence_tis_weights(np.log(np.array([2.0, 2.0, 9.0])), np.array([1, 1, 0])).tolist()
    [4.0, 4.0, 0.0]
    """
    return _finish(bound_weights(unbounded_ratios(log_ratio, mask, "sequence"), low, high, overflow), mask)


def geometric_sequence_weights(log_ratio: jax.Array, mask: jax.Array, high: float | None = None, low: float = 0.0,
                               overflow: str = "truncate") -> jax.Array:
    """Geometric-mean sequence weight ``exp(clamp(masked_mean(lr)))`` (slime mis.py, AReaL), optionally bounded.

    >>> import numpy as np
    >>> geometric_sequence_weights(np.log(np.array([2.0, 8.0, 1.0])), np.array([1, 1, 0])).round(5).tolist()
    [4.0, 4.0, 0.0]
    """
    return _finish(bound_weights(unbounded_ratios(log_ratio, mask, "geometric"), low, high, overflow), mask)


def icepop_weights(log_ratio: jax.Array, mask: jax.Array, low: float = 0.5, high: float = 5.0) -> jax.Array:
    """IcePop: the ratio where ``low <= rho <= high`` (inclusive), else 0; the loss mask is unchanged.

    >>> import numpy as np
    >>> icepop_weights(np.log(np.array([0.4, 1.5, 6.0])), np.array([1, 1, 1])).round(5).tolist()
    [0.0, 1.5, 0.0]
    """
    return token_tis_weights(log_ratio, mask, high=high, low=low, overflow="mask")


def off_policy_is_weights(logprobs: jax.Array, rollout_logprobs: jax.Array, mask: jax.Array, low: float = 0.0,
                          high: float = 2.0) -> jax.Array:
    """slime's off-policy IS (PR #2084): ``clip(exp(sg(lp) - roll), low, high)``, one weight for mismatch and
    staleness; with a REINFORCE base ``-w*A*lp`` this is CISPO.

    >>> import numpy as np
    >>> off_policy_is_weights(np.log([0.5, 0.5]), np.log([0.25, 0.5]), np.array([1, 1])).tolist()
    [2.0, 1.0]
    """
    log_ratio = jax.lax.stop_gradient(jnp.asarray(logprobs, jnp.float32)) - jnp.asarray(rollout_logprobs, jnp.float32)
    return token_tis_weights(log_ratio, mask, high=high, low=low)


SEQUENCE_WEIGHTS = {
    "token": token_tis_weights,
    "sequence": sequence_tis_weights,
    "geometric": geometric_sequence_weights,
}


def batch_mean_weight(row_means: jax.Array, row_counts: jax.Array, level: str = "token") -> jax.Array:
    """The batch mean weight from per-row masked means and valid counts ([B] arrays): the token mean for token
    weights, the mean over non-empty rows of the row means for sequence-level weights."""
    row_counts = jnp.asarray(row_counts, jnp.float32)
    if level == "token":
        return masked_sum(row_means * row_counts, row_counts > 0) / jnp.maximum(jnp.sum(row_counts), 1.0)
    return masked_mean(row_means, row_counts > 0)


def batch_normalize_weights(weights: jax.Array, mask: jax.Array, level: str = "token") -> jax.Array:
    """Divides [B, T] weights by their batch mean (verl ``rollout_is_batch_normalize``, slime mis.py).

    The mean is the masked token mean for token weights, and the mean over non-empty rows of per-row masked
    means for sequence-level weights. Skipped (weights returned as they are) if that mean is <= 1e-8.

    >>> import numpy as np
    >>> batch_normalize_weights(np.array([[1.0, 3.0], [2.0, 0.0]]), np.array([[1, 1], [1, 0]])).tolist()
    [[0.5, 1.5], [1.0, 0.0]]
    """
    weights = jnp.asarray(weights, jnp.float32)
    mean = batch_mean_weight(masked_mean(weights, mask, axis=-1), jnp.sum(jnp.asarray(mask, jnp.float32), -1), level)
    return jax.lax.stop_gradient(weights / normalizer(mean))


def normalizer(mean: jax.Array) -> jax.Array:
    """The divisor of batch normalisation: the mean, or 1 where the mean is <= 1e-8 (normalisation skipped)."""
    return jnp.where(mean > 1e-8, mean, 1.0)
