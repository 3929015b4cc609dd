"""Masked reductions and the clamped exponential shared by every correction.

Padding may hold anything (NaN, +-inf): every function here selects with ``where`` before
reducing, so values at masked positions never reach an output or a gradient.
"""

import jax
import jax.numpy as jnp

Axis = int | tuple[int, ...] | None
"""The axes a masked reduction runs over; None: all of them."""

SAFETY = 20.0
"""Bound on every log-ratio (and per-sequence sum of log-ratios) before ``exp``: exp(20) ~ 4.9e8."""

METRIC_LOGPROB_FLOOR = -1e4
"""Logprobs below this are raised to it in the mismatch metrics (their probability is 0 in float32 either way), so
that an extreme value such as -3e38 keeps sums, means and squares finite."""


def masked_sum(x: jax.Array, mask: jax.Array, axis: Axis = None) -> jax.Array:
    """Sum of ``x`` where ``mask`` is set; padding values (NaN, inf) never leak.

    >>> import numpy as np
    >>> float(masked_sum(np.array([1.0, 2.0, np.nan]), np.array([1, 1, 0])))
    3.0
    """
    return jnp.sum(jnp.where(jnp.asarray(mask).astype(bool), x, 0.0), axis=axis)


def zero_padding(x: jax.Array, mask: jax.Array) -> jax.Array:
    """``x`` as float32 with every position where ``mask`` is 0 set to 0, so that a later unmasked sum of a
    quantity that vanishes at 0 skips padding. An ``x`` of lower rank than ``mask`` (one value per sequence)
    is broadcast over the trailing axes first.

    >>> import numpy as np
    >>> zero_padding(np.array([1.0, np.nan]), np.array([1, 0])).tolist()
    [1.0, 0.0]
    """
    x, mask = jnp.asarray(x, jnp.float32), jnp.asarray(mask)
    x = jnp.broadcast_to(x.reshape(x.shape + (1,) * (mask.ndim - x.ndim)), mask.shape)
    return jnp.where(mask.astype(bool), x, 0.0)


def masked_count(mask: jax.Array, axis: Axis = None) -> jax.Array:
    """Number of set mask entries, as float32."""
    return jnp.sum(jnp.asarray(mask).astype(jnp.float32), axis=axis)


def masked_mean(x: jax.Array, mask: jax.Array, axis: Axis = None) -> jax.Array:
    """Mean of ``x`` over set mask entries; 0 for an empty mask (denominator ``max(count, 1)``).

    >>> import numpy as np
    >>> float(masked_mean(np.array([1.0, 3.0, np.inf]), np.array([1, 1, 0])))
    2.0
    >>> float(masked_mean(np.array([np.nan]), np.array([0])))
    0.0
    """
    return masked_sum(x, mask, axis) / jnp.maximum(masked_count(mask, axis), 1.0)


def masked_max(x: jax.Array, mask: jax.Array, axis: Axis = None, empty: float = 0.0) -> jax.Array:
    """Max of ``x`` over set mask entries; ``empty`` where the mask has none."""
    m = jnp.asarray(mask).astype(bool)
    out = jnp.max(jnp.where(m, x, -jnp.inf), axis=axis)
    return jnp.where(jnp.any(m, axis=axis), out, empty)


def masked_min(x: jax.Array, mask: jax.Array, axis: Axis = None, empty: float = 0.0) -> jax.Array:
    """Min of ``x`` over set mask entries; ``empty`` where the mask has none."""
    m = jnp.asarray(mask).astype(bool)
    out = jnp.min(jnp.where(m, x, jnp.inf), axis=axis)
    return jnp.where(jnp.any(m, axis=axis), out, empty)


def clamp_log_ratio(log_ratio: jax.Array) -> jax.Array:
    """Clamps a log-ratio to ``[-SAFETY, SAFETY]`` in float32."""
    return jnp.clip(jnp.asarray(log_ratio, jnp.float32), -SAFETY, SAFETY)


def safe_exp(log_ratio: jax.Array) -> jax.Array:
    """``exp`` of a clamped log-ratio: finite for any finite or infinite input.

    >>> float(safe_exp(1e9)) == float(jnp.exp(jnp.float32(20.0)))
    True
    """
    return jnp.exp(clamp_log_ratio(log_ratio))
