"""Rejection masks for ONE sequence ([T] arrays); ``jax.vmap`` them over the batch.

Each function returns a boolean keep mask of shape [T]. A sequence-level rule computes its statistic from
that sequence's valid tokens only and broadcasts the decision to every token of the sequence, so a sequence
statistic is never compared with a per-token quantity (slime's OPSM bug, PR #1917).
"""

import jax
import jax.numpy as jnp

from corrections._masked import clamp_log_ratio, masked_max, masked_mean, masked_sum, safe_exp


def _in_bounds(value: jax.Array, low: float | None, high: float | None) -> jax.Array:
    keep = jnp.ones_like(value, dtype=bool)
    if low is not None:
        keep &= value >= low
    if high is not None:
        keep &= value <= high
    return keep


def token_mask(log_ratio: jax.Array, mask: jax.Array, low: float | None = None, high: float | None = None) -> jax.Array:
    """Keeps token t iff ``low <= rho_t <= hi`` (inclusive); ``rho = exp(clamp(lr))`` (SkyRL, AReaL, verl token_k1).

    >>> import numpy as np
    >>> token_mask(np.log([0.5, 1.0, 3.0]), np.array([1, 1, 1]), low=0.5, high=2.0).tolist()
    [True, True, False]
    """
    return _in_bounds(safe_exp(jnp.asarray(log_ratio)), low, high)


def outlier_sequence_mask(log_ratio: jax.Array, mask: jax.Array, low: float | None = None,
                          high: float | None = None) -> jax.Array:
    """Veto: drops the sequence if any valid token has ``rho > high`` or ``rho < low`` (strict).

    >>> import numpy as np
    >>> outlier_sequence_mask(np.log([1.0, 200.0, 1.0]), np.array([1, 1, 1]), 1e-4, 100.0).tolist()
    [False, False, False]
    >>> outlier_sequence_mask(np.log([1.0, 200.0, 1.0]), np.array([1, 0, 1]), 1e-4, 100.0).tolist()
    [True, True, True]
    """
    rho = safe_exp(jnp.asarray(log_ratio))
    bad = ~_in_bounds(rho, low, high) & jnp.asarray(mask).astype(bool)
    return jnp.broadcast_to(~jnp.any(bad), rho.shape)


def k_statistic(log_ratio: jax.Array, k: str) -> jax.Array:
    """Per-token divergence estimate of ``l = clamp(lr)``: k1 ``l``, k2 ``l^2/2``, k3 ``exp(l) - 1 - l``."""
    l = clamp_log_ratio(jnp.asarray(log_ratio))
    if k == "k1":
        return l
    if k == "k2":
        return 0.5 * l * l
    return jnp.expm1(l) - l


def sequence_statistic(values: jax.Array, mask: jax.Array, aggregate: str) -> jax.Array:
    """Aggregates per-token values over a sequence's valid tokens: ``seq_sum``, ``seq_mean`` or ``seq_max``."""
    if aggregate == "seq_sum":
        return masked_sum(values, mask)
    if aggregate == "seq_mean":
        return masked_mean(values, mask)
    return masked_max(values, mask)


def divergence_mask(log_ratio: jax.Array, mask: jax.Array, rule: str, low: float | None = None,
                    high: float | None = None) -> jax.Array:
    """verl's k-family rejection (``token_k1`` ... ``seq_max_k3``) with bounds that mean what they say.

    k1 rules keep ``low <= exp(stat) <= high`` (stat = clamped log-ratio, summed or averaged per sequence:
    ``seq_mean_k1`` is the geometric mask "Geo-RS", ``seq_sum_k1`` the product mask). k2/k3 rules keep
    ``stat <= high``. verl checks k1 on ``-log rho`` and so keeps ``1/high <= rho <= 1/low``; pass
    ``(1/high, 1/low)`` here to reproduce verl's numbers.

    >>> import numpy as np
    >>> lr, m = np.log([1.0, 1.002, 5.0]), np.array([1, 1, 0])
    >>> divergence_mask(lr, m, "seq_mean_k1", 0.999, 1.001).tolist()
    [True, True, True]
    >>> divergence_mask(lr, m, "token_k3", high=1e-6).tolist()
    [True, False, False]
    """
    aggregate, k = rule.rsplit("_", 1)
    stat = k_statistic(log_ratio, k)
    if aggregate != "token":
        stat = jnp.broadcast_to(sequence_statistic(stat, mask, aggregate), stat.shape)
    if k == "k1":
        return _in_bounds(safe_exp(stat), low, high)
    return _in_bounds(stat, None, high)


def geometric_sequence_mask(log_ratio: jax.Array, mask: jax.Array, low: float = 0.999,
                            high: float = 1.001) -> jax.Array:
    """Keeps the sequence iff ``low <= exp(masked_mean(lr)) <= high`` (SkyRL geometric, verl Geo-RS).

    >>> import numpy as np
    >>> geometric_sequence_mask(np.log([1.0005, 0.9995, 5.0]), np.array([1, 1, 0])).tolist()  # padding ignored
    [True, True, True]
    >>> geometric_sequence_mask(np.log([1.01, 1.01]), np.array([1, 1])).tolist()
    [False, False]
    """
    return divergence_mask(log_ratio, mask, "seq_mean_k1", low, high)


def product_sequence_mask(log_ratio: jax.Array, mask: jax.Array, low: float = 0.5, high: float = 2.0) -> jax.Array:
    """Keeps the sequence iff ``low <= exp(sum m*lr) <= high`` (SkyRL product, verl seq_sum_k1).

    >>> import numpy as np
    >>> product_sequence_mask(np.log([1.2, 1.5]), np.array([1, 1])).tolist()  # 1.8
    [True, True]
    >>> product_sequence_mask(np.log([1.5, 1.5, 9.0]), np.array([1, 1, 0])).tolist()  # 2.25
    [False, False, False]
    """
    return divergence_mask(log_ratio, mask, "seq_sum_k1", low, high)


def opsm_mask(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array, mask: jax.Array,
              delta: float = 1e-4) -> jax.Array:
    """slime OPSM done right (PR #1917): drops the whole sequence iff ``mean_valid(A) < 0`` and
    ``mean_valid(old - lp) > delta``, both over the sequence's valid tokens.

    >>> import numpy as np
    >>> m = np.array([1, 1, 0])
    >>> opsm_mask(np.log([0.5, 0.5, 1.0]), np.log([0.9, 0.9, 1.0]), -np.ones(3), m).tolist()
    [False, False, False]
    >>> opsm_mask(np.log([0.5, 0.5, 1.0]), np.log([0.9, 0.9, 1.0]), np.ones(3), m).tolist()
    [True, True, True]
    """
    lp = jax.lax.stop_gradient(jnp.asarray(logprobs, jnp.float32))
    divergence = masked_mean(jnp.asarray(old_logprobs, jnp.float32) - lp, mask)
    drop = (masked_mean(jnp.asarray(advantages, jnp.float32), mask) < 0) & (divergence > delta)
    return jnp.broadcast_to(~drop, lp.shape)
