"""The optax optimizer of the learner: AdamW on a warmup + cosine schedule after global-norm clipping.

With ``skip_nonfinite`` the chain is wrapped in `skip_nonfinite`: an update whose gradients hold NaN or inf leaves
parameters and moments unchanged and is counted in the optimizer state (`skipped_updates`), however many come in a
row (``optax.apply_if_finite`` applies the update after ``max_consecutive_errors`` skips, which trains on NaN). The
update step makes the gradients non-finite when the loss is, so a non-finite loss is skipped too; the caller stops
after ``max_consecutive_skips`` (`learner.rl` counts RL steps with a skipped update).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW, schedule and clipping constants; validated when built.

    Example:
        >>> OptimizerConfig(peak_learning_rate=1e-5, warmup_steps=10, total_steps=100).end_learning_rate
        0.0
    """

    peak_learning_rate: float = 1e-6  # learning rate reached at the end of the warmup.
    warmup_steps: int = 0  # linear warmup from 0 to the peak over this many optimizer updates.
    total_steps: int = 1000  # warmup + cosine decay length; the rate stays at end_learning_rate afterwards.
    end_learning_rate: float = 0.0  # learning rate at the end of the cosine decay.
    b1: float = 0.9  # Adam first-moment decay.
    b2: float = 0.999  # Adam second-moment decay.
    eps: float = 1e-8  # Adam denominator epsilon.
    weight_decay: float = 0.0  # decoupled (AdamW) weight decay, applied to every parameter.
    max_grad_norm: float | None = 1.0  # global-norm clip threshold; None disables clipping.
    skip_nonfinite: bool = True  # skip (and count) updates with a non-finite loss or gradient.
    max_consecutive_skips: int = 10  # consecutive skipped steps after which the caller stops (never applied).

    def __post_init__(self):
        for name in ("peak_learning_rate", "end_learning_rate", "eps", "weight_decay"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"OptimizerConfig.{name}={value!r} must be a finite number >= 0.")
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"OptimizerConfig.{name}={getattr(self, name)!r} must be in [0, 1).")
        for name, minimum in (("warmup_steps", 0), ("total_steps", 1), ("max_consecutive_skips", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"OptimizerConfig.{name}={value!r} must be an int >= {minimum}.")
        if self.warmup_steps >= self.total_steps:
            raise ValueError(f"OptimizerConfig.warmup_steps={self.warmup_steps} must be fewer than "
                             f"total_steps={self.total_steps} (which include the warmup; optax needs decay steps).")
        if self.end_learning_rate > self.peak_learning_rate:
            raise ValueError(f"OptimizerConfig.end_learning_rate={self.end_learning_rate} exceeds "
                             f"peak_learning_rate={self.peak_learning_rate}.")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"OptimizerConfig.max_grad_norm={self.max_grad_norm!r} must be > 0 or None.")


def learning_rate_schedule(config: OptimizerConfig) -> optax.Schedule:
    """Linear warmup from 0 to the peak, then cosine decay to ``end_learning_rate`` at ``total_steps``.

    Example:
        >>> schedule = learning_rate_schedule(OptimizerConfig(peak_learning_rate=1.0, warmup_steps=2, total_steps=4))
        >>> [round(float(schedule(step)), 3) for step in range(6)]
        [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    """
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=config.peak_learning_rate, warmup_steps=config.warmup_steps,
        decay_steps=config.total_steps, end_value=config.end_learning_rate)


def make_optimizer(config: OptimizerConfig) -> optax.GradientTransformation:
    """The optax transformation described by ``config`` (see the module docstring)."""
    clip = [] if config.max_grad_norm is None else [optax.clip_by_global_norm(config.max_grad_norm)]
    adamw = optax.adamw(learning_rate_schedule(config), b1=config.b1, b2=config.b2, eps=config.eps,
                        weight_decay=config.weight_decay)
    optimizer = optax.chain(*clip, adamw)
    return skip_nonfinite(optimizer) if config.skip_nonfinite else optimizer


def skip_nonfinite(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """``inner``, except that an update with a non-finite gradient is zero and leaves ``inner``'s state unchanged.

    Never applied, however many come in a row. The state is ``optax.ApplyIfFiniteState`` (``notfinite_count``:
    consecutive skips, ``total_notfinite``: all skips), so checkpoints keep their structure.

    Example:
        >>> optimizer = skip_nonfinite(optax.sgd(1.0))
        >>> params = {"w": jnp.ones(1)}
        >>> state = optimizer.init(params)
        >>> for _ in range(20):
        ...     updates, state = optimizer.update({"w": jnp.array([jnp.nan])}, state, params)
        >>> float(updates["w"][0]), int(state.notfinite_count)
        (0.0, 20)
    """
    inner = optax.with_extra_args_support(inner)

    def init(params):
        return optax.ApplyIfFiniteState(notfinite_count=jnp.zeros([], jnp.int32), last_finite=jnp.array(True),
                                        total_notfinite=jnp.zeros([], jnp.int32), inner_state=inner.init(params))

    def update(updates, state, params=None, **extra_args):
        finite = jnp.all(jnp.array([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(updates)]))
        updates, inner_state = jax.lax.cond(
            finite, lambda: inner.update(updates, state.inner_state, params, **extra_args),
            lambda: (jax.tree.map(jnp.zeros_like, updates), state.inner_state))
        skipped = (~finite).astype(jnp.int32)
        return updates, optax.ApplyIfFiniteState(
            notfinite_count=jnp.where(finite, 0, state.notfinite_count + 1), last_finite=finite,
            total_notfinite=state.total_notfinite + skipped, inner_state=inner_state)

    return optax.GradientTransformationExtraArgs(init, update)


def skipped_updates(opt_state: optax.OptState) -> jax.Array:
    """Updates skipped so far for a non-finite gradient (int32; 0 when skipping is off).

    Example:
        >>> optimizer = make_optimizer(OptimizerConfig())
        >>> params = {"w": jnp.ones(2)}
        >>> _, state = optimizer.update({"w": jnp.array([1.0, jnp.nan])}, optimizer.init(params), params)
        >>> int(skipped_updates(state))
        1
    """
    if isinstance(opt_state, optax.ApplyIfFiniteState):
        return opt_state.total_notfinite.astype(jnp.int32)
    return jnp.zeros((), jnp.int32)
