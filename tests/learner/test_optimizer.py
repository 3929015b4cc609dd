"""Optimizer: validated config, warmup + cosine schedule, clipping, and skipping of non-finite gradients."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from learner.optimizer import OptimizerConfig, learning_rate_schedule, make_optimizer, skipped_updates


def test_schedule_warms_up_linearly_then_decays_by_cosine():
    schedule = learning_rate_schedule(OptimizerConfig(peak_learning_rate=2.0, warmup_steps=4, total_steps=12,
                                                      end_learning_rate=0.2))
    rates = np.array([schedule(step) for step in range(14)])
    np.testing.assert_allclose(rates[:5], [0.0, 0.5, 1.0, 1.5, 2.0], rtol=1e-6)
    np.testing.assert_allclose(rates[8], 0.2 + 1.8 * 0.5, rtol=1e-6)  # half-way through the cosine
    np.testing.assert_allclose(rates[12:], 0.2, rtol=1e-6)


def test_first_update_is_clipped_adam_step():
    config = OptimizerConfig(peak_learning_rate=0.1, total_steps=10, max_grad_norm=1.0, weight_decay=0.5)
    optimizer = make_optimizer(config)
    params = {"w": jnp.array([1.0, -2.0])}
    updates, _ = optimizer.update({"w": jnp.array([30.0, -40.0])}, optimizer.init(params), params)
    # Adam's first step moves each coordinate by -lr * sign(g); weight decay adds -lr * wd * w.
    np.testing.assert_allclose(updates["w"], -0.1 * np.array([1.0, -1.0]) - 0.1 * 0.5 * np.array([1.0, -2.0]),
                               rtol=1e-5)


def test_nonfinite_gradients_are_skipped_and_counted():
    optimizer = make_optimizer(OptimizerConfig(peak_learning_rate=0.1, max_consecutive_skips=2))
    params = {"w": jnp.ones(2)}
    state = optimizer.init(params)
    bad = {"w": jnp.array([jnp.inf, 1.0])}
    updates, state = optimizer.update(bad, state, params)
    np.testing.assert_array_equal(updates["w"], 0.0)
    updates, state = optimizer.update({"w": jnp.ones(2)}, state, params)
    assert np.all(updates["w"] < 0) and int(skipped_updates(state)) == 1
    for _ in range(12):  # optax.apply_if_finite(max_consecutive_errors=2) would apply the third one
        updates, state = optimizer.update(bad, state, params)
        np.testing.assert_array_equal(updates["w"], 0.0)
    assert int(skipped_updates(state)) == 13 and int(state.notfinite_count) == 12
    no_skip = make_optimizer(OptimizerConfig(skip_nonfinite=False))
    assert int(skipped_updates(no_skip.init(params))) == 0
    assert not isinstance(no_skip.init(params), optax.ApplyIfFiniteState)


@pytest.mark.parametrize("fields, message", [
    (dict(peak_learning_rate=-1.0), "peak_learning_rate"),
    (dict(b2=1.0), "b2"),
    (dict(warmup_steps=10, total_steps=10), "must be fewer than total_steps"),
    (dict(end_learning_rate=1.0), "exceeds peak_learning_rate"),
    (dict(max_grad_norm=0.0), "max_grad_norm"),
    (dict(total_steps=1.5), "total_steps"),
])
def test_invalid_fields_are_rejected(fields, message):
    with pytest.raises(ValueError, match=message):
        OptimizerConfig(**fields)
