"""Optimizer: validated config, warmup + cosine schedule, clipping, and skipping of non-finite gradients; the fused
update equals optax's clip + AdamW chain step by step and keeps its state layout."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from learner.update.optimizer import OptimizerConfig, learning_rate_schedule, make_optimizer, skipped_updates


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


def _optax_reference(config: OptimizerConfig) -> optax.GradientTransformation:
    """The chain `make_optimizer` fuses, built from optax's own transformations."""
    clip = [] if config.max_grad_norm is None else [optax.clip_by_global_norm(config.max_grad_norm)]
    return optax.chain(*clip, optax.adamw(learning_rate_schedule(config), b1=config.b1, b2=config.b2, eps=config.eps,
                                          weight_decay=config.weight_decay))


@pytest.mark.parametrize("fields", [
    dict(max_grad_norm=0.5, weight_decay=0.1),  # every step clipped
    dict(max_grad_norm=None, weight_decay=0.0, skip_nonfinite=False),
    dict(max_grad_norm=100.0, b1=0.5, b2=0.9, eps=1e-3),  # never clipped
])
def test_updates_and_state_equal_optax_chain_step_by_step(fields):
    config = OptimizerConfig(peak_learning_rate=0.05, warmup_steps=2, total_steps=6, **fields)
    rng = np.random.default_rng(0)
    params = {"a": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32), "b": jnp.asarray(rng.normal(size=5), jnp.float32)}
    fused, reference = make_optimizer(config), _optax_reference(config)
    fused_state, reference_state = fused.init(params), reference.init(params)
    inner = fused_state.inner_state if config.skip_nonfinite else fused_state
    assert jax.tree.structure(inner) == jax.tree.structure(reference_state)  # checkpoints keep their layout
    for _ in range(6):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
        got, fused_state = jax.jit(fused.update)(grads, fused_state, params)
        want, reference_state = reference.update(grads, reference_state, params)
        inner = fused_state.inner_state if config.skip_nonfinite else fused_state
        # A few ulp apart: the clip multiplies by max_norm / norm where optax divides by norm then multiplies, and
        # XLA may contract the jitted arithmetic into fused multiply-adds where optax runs op by op.
        for a, b in zip(jax.tree.leaves((got, inner)), jax.tree.leaves((want, reference_state)), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
        params = optax.apply_updates(params, got)


def test_skipped_update_leaves_state_bit_for_bit_and_later_steps_continue_the_chain():
    config = OptimizerConfig(peak_learning_rate=0.1, warmup_steps=1, total_steps=10, weight_decay=0.1)
    rng = np.random.default_rng(1)
    params = {"w": jnp.asarray(rng.normal(size=7), jnp.float32)}
    fused, reference = make_optimizer(config), _optax_reference(config)
    state, reference_state = fused.init(params), reference.init(params)
    update = jax.jit(fused.update)
    for step in range(5):
        grads = {"w": jnp.asarray(rng.normal(size=7), jnp.float32)}
        if step in (0, 2):  # a skipped update first (Adam's count 0), and between two taken ones
            before = state
            skipped, state = update({"w": grads["w"].at[3].set(jnp.nan)}, state, params)
            np.testing.assert_array_equal(skipped["w"], 0.0)
            for a, b in zip(jax.tree.leaves(state.inner_state), jax.tree.leaves(before.inner_state), strict=True):
                np.testing.assert_array_equal(a, b)
        got, state = update(grads, state, params)
        want, reference_state = reference.update(grads, reference_state, params)
        np.testing.assert_allclose(got["w"], want["w"], rtol=1e-5, atol=1e-7)  # as in the test above
        params = optax.apply_updates(params, got)
    assert int(skipped_updates(state)) == 2 and int(state.notfinite_count) == 0


def test_given_global_norm_is_the_one_used_for_the_clip_and_the_finite_check():
    optimizer = make_optimizer(OptimizerConfig(peak_learning_rate=0.1, max_grad_norm=1.0, b1=0.0, b2=0.0))
    params = {"w": jnp.zeros(2)}
    state = optimizer.init(params)
    grads = {"w": jnp.array([0.3, 0.4])}  # true norm 0.5: not clipped
    # b1 = b2 = 0: the first moment is the clipped gradient itself.
    _, clipped = optimizer.update(grads, state, params, global_norm=jnp.array(4.0))
    np.testing.assert_allclose(clipped.inner_state[1][0].mu["w"], [0.075, 0.1], rtol=1e-6)
    _, unclipped = optimizer.update(grads, state, params)
    np.testing.assert_allclose(unclipped.inner_state[1][0].mu["w"], [0.3, 0.4], rtol=1e-6)
    _, skipped = optimizer.update(grads, state, params, global_norm=jnp.array(jnp.nan))
    assert int(skipped_updates(skipped)) == 1


def test_gradient_whose_norm_overflows_float32_is_skipped():
    optimizer = make_optimizer(OptimizerConfig(peak_learning_rate=0.1))
    params = {"w": jnp.zeros(2)}
    updates, state = optimizer.update({"w": jnp.array([3e19, 1.0])}, optimizer.init(params), params)
    np.testing.assert_array_equal(updates["w"], 0.0)
    assert int(skipped_updates(state)) == 1


def test_bfloat16_parameters_keep_their_dtype_in_updates_and_moments():
    optimizer = make_optimizer(OptimizerConfig(peak_learning_rate=0.1, weight_decay=0.1))
    params = {"w": jnp.ones(3, jnp.bfloat16)}
    updates, state = optimizer.update({"w": jnp.ones(3, jnp.bfloat16)}, optimizer.init(params), params)
    assert updates["w"].dtype == jnp.bfloat16
    assert {leaf.dtype for leaf in jax.tree.leaves(state.inner_state[1][0].mu)} == {jnp.dtype(jnp.bfloat16)}


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
