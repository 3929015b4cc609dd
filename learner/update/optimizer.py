"""The learner's optimizer: AdamW on a warmup + cosine schedule after global-norm clipping, with a non-finite guard.

With ``skip_nonfinite`` an update whose gradients hold NaN or inf leaves parameters and moments unchanged and is
counted in the optimizer state (`skipped_updates`), however many come in a row (``optax.apply_if_finite`` applies the
update after ``max_consecutive_errors`` skips, which trains on NaN). The update step makes the gradients non-finite
when the loss is, so a non-finite loss is skipped too; the caller stops after ``max_consecutive_skips``
(`learner.rl` counts RL steps with a skipped update).

The state is exactly that of ``optax.chain(optax.clip_by_global_norm(c), optax.adamw(...))`` (wrapped in
``optax.ApplyIfFiniteState`` when skipping), so checkpoints keep their layout, and the update is optax's arithmetic
arranged so that XLA fuses it: per parameter and step (XLA's cost analysis on the CPU backend, the global norm
included) it moves 11 float32 values, where optax's chain moves 15, the same chain under a ``lax.cond`` guard 19.5
and ``optax.apply_if_finite`` 20.5. Three choices make that so:

* The gradients' global norm is computed once and shared: the finite check is ``isfinite(global_norm)`` (NaN and
  inf propagate through the sum of squares, so it needs no pass of its own), the clip scales by
  ``min(1, max_grad_norm / global_norm)``, and a caller that has the norm already (the update step logs it) passes
  it as the ``global_norm`` extra argument of ``update``. A gradient whose norm overflows float32 (above ~1.8e19)
  counts as non-finite too. Several LoRA adapters stacked on one base (`learner.update.adapter_loss`) pass ``[N]``
  norms,
  one per entry of the leading axis of every gradient: each adapter is clipped by its own norm, as it would be
  trained alone (the finite check and the step count stay shared).
* A skip is a choice of scalars, not of tensors: the moments decay by ``b1`` / ``b2`` and take ``(1 - b1)`` /
  ``(1 - b2)`` of the (zeroed) gradient, or by 1 and 0 when skipping, so a skipped update leaves them bit for bit
  and no ``lax.cond`` or select copies them.
* The parameter update reads the new moments, never the old ones, so the moments are updated in place (donated)
  without defensive copies.
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


def make_optimizer(config: OptimizerConfig) -> optax.GradientTransformationExtraArgs:
    """The transformation described by ``config`` (see the module docstring).

    ``update(grads, state, params, global_norm=None)``: ``params`` are required (weight decay), ``global_norm`` is
    the global norm of ``grads`` if the caller has it, or ``[N]`` norms of the entries of every gradient's leading
    axis (stacked adapters), each entry then clipped by its own.

    Example:
        >>> optimizer = make_optimizer(OptimizerConfig(peak_learning_rate=0.1))
        >>> params = {"w": jnp.ones(2)}
        >>> state = optimizer.init(params)
        >>> for _ in range(20):
        ...     updates, state = optimizer.update({"w": jnp.array([1.0, jnp.nan])}, state, params)
        >>> updates["w"].tolist(), int(state.notfinite_count), int(skipped_updates(state))
        ([0.0, 0.0], 20, 20)
    """
    schedule = learning_rate_schedule(config)
    clip = [] if config.max_grad_norm is None else [optax.clip_by_global_norm(config.max_grad_norm)]
    layout = optax.chain(*clip, optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.eps,
                                             weight_decay=config.weight_decay))

    def init(params):
        inner = layout.init(params)
        if not config.skip_nonfinite:
            return inner
        return optax.ApplyIfFiniteState(notfinite_count=jnp.zeros([], jnp.int32), last_finite=jnp.array(True),
                                        total_notfinite=jnp.zeros([], jnp.int32), inner_state=inner)

    def update(grads, state, params=None, *, global_norm=None, **extra_args):
        del extra_args
        if params is None:
            raise ValueError("make_optimizer(...).update needs params (AdamW's weight decay reads them).")
        if global_norm is None:
            global_norm = optax.tree.norm(grads)
        inner = state.inner_state if config.skip_nonfinite else state
        adam, decay_state, lr_state = inner[-1]
        # Scalars of this update: whether it is taken, the clip factor, the moments' weights, the learning rate.
        take = jnp.all(jnp.isfinite(global_norm)) if config.skip_nonfinite else jnp.array(True)
        clip_scale = None if config.max_grad_norm is None else jnp.minimum(1.0, config.max_grad_norm / global_norm)
        count = jnp.where(take, optax.safe_increment(adam.count), adam.count)
        # (decay, weight of the new gradient) of each moment: (b, 1 - b), or (1, 0) to leave it as it is
        b1, new1 = jnp.where(take, config.b1, 1.0), jnp.where(take, 1 - config.b1, 0.0)
        b2, new2 = jnp.where(take, config.b2, 1.0), jnp.where(take, 1 - config.b2, 0.0)
        bias1, bias2 = 1 - config.b1 ** count, 1 - config.b2 ** count
        learning_rate = -schedule(lr_state.count)

        def gradient(g, dtype):  # clipped; 0 when skipped, as a NaN would reach the moments through 0 * NaN
            if clip_scale is not None:  # a scalar, or one per entry of the leading axis
                g = g * clip_scale.reshape(clip_scale.shape + (1,) * (g.ndim - clip_scale.ndim)).astype(g.dtype)
            return jnp.where(take, g, 0).astype(dtype)

        # optax's order of operations: (1 - b) * g + b * moment
        mu = jax.tree.map(lambda g, m: new1.astype(m.dtype) * gradient(g, m.dtype) + b1.astype(m.dtype) * m,
                          grads, adam.mu)
        nu = jax.tree.map(lambda g, v: new2.astype(v.dtype) * gradient(g, v.dtype) ** 2 + b2.astype(v.dtype) * v,
                          grads, adam.nu)

        def step(mu, nu, p):
            direction = (mu / bias1.astype(mu.dtype)) / (jnp.sqrt(nu / bias2.astype(nu.dtype)) + config.eps)
            if config.weight_decay:
                direction = direction + config.weight_decay * p
            return jnp.where(take, learning_rate.astype(p.dtype) * direction.astype(p.dtype), 0).astype(p.dtype)

        updates = jax.tree.map(step, mu, nu, params)
        inner = (*inner[:-1], (adam._replace(count=count, mu=mu, nu=nu), decay_state,
                               lr_state._replace(count=jnp.where(take, optax.safe_increment(lr_state.count),
                                                                 lr_state.count))))
        if not config.skip_nonfinite:
            return updates, inner
        skipped = (~take).astype(jnp.int32)
        return updates, optax.ApplyIfFiniteState(
            notfinite_count=jnp.where(take, 0, state.notfinite_count + 1), last_finite=take,
            total_notfinite=state.total_notfinite + skipped, inner_state=inner)

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
