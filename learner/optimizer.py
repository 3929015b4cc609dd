"""The optax optimizer of the learner: AdamW on a warmup + cosine schedule after global-norm clipping.

With ``skip_nonfinite`` the chain is wrapped in ``optax.apply_if_finite``: an update whose gradients hold NaN or inf
leaves parameters and moments unchanged and is counted in the optimizer state (`skipped_updates`). The update step
makes the gradients non-finite when the loss is, so a non-finite loss is skipped too.
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
    max_consecutive_skips: int = 10  # after this many consecutive skips the update is applied anyway (fail loud).

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
    if config.skip_nonfinite:
        optimizer = optax.apply_if_finite(optimizer, max_consecutive_errors=config.max_consecutive_skips)
    return optimizer


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
