"""The scored window: logprobs and entropies over W tokens per row equal the whole-sequence computation inside the
window and are 0 outside it, gradients of a loss inside the window are the same, and `update_step` with
``scored_window`` gives the same parameters, metrics and (inside the loss mask) proximal logprobs as without.

Tolerances: the windowed pass runs the same float32 operations on the same rows, but its matmuls and reductions
have other shapes (a [B, W] window, other chunks), so XLA may sum in another order: ~1e-6 relative, hence 1e-5.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from corrections import CorrectionConfig, ImportanceWeights
from learner.logprobs.chunked import logprobs_from_hidden
from learner.logprobs.sampler_replay import SamplerParams
from learner.model.sharding import make_mesh
from learner.update.step import UpdateConfig, update_step
from learner.update.train_state import create_sharded_train_state
from tests.support import update_problem
from tests.support.update_problem import FAST_COMPILE, MODEL, OPTIMIZER

D, V = 8, 24


def _inputs(seed, rows, length):
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.standard_normal((rows, length, D)), jnp.float32)
    kernel = jnp.asarray(rng.standard_normal((D, V)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, V, (rows, length)), jnp.int32)
    mask = jnp.asarray(np.arange(length)[None, :] < rng.integers(1, length + 1, (rows, 1)))
    return hidden, kernel, tokens, mask


def _in_window(start, size, length):
    offset = np.arange(length)[None, :] - np.asarray(start)[:, None]
    return (offset >= 0) & (offset < size)


@functools.cache
def _jitted_stats(chunk_size, remat, window_size):
    """Logprobs and entropies, jitted per static setting (a hypothesis example compiles once, not op by op)."""
    def stats(hidden, kernel, tokens, mask, window_start):
        window = {} if window_size is None else dict(window_start=window_start, window_size=window_size)
        return logprobs_from_hidden(hidden, kernel, tokens, mask, temperature=0.8, chunk_size=chunk_size,
                                    remat=remat, return_entropy=True, **window)
    return jax.jit(stats)


@settings(max_examples=20, deadline=None)
@given(data=st.data(), rows=st.sampled_from([1, 3]), length=st.sampled_from([6, 12]),
       chunk_size=st.sampled_from([1, 3, 64]), remat=st.sampled_from([None, True, False]),
       seed=st.integers(0, 2**16))
def test_windowed_stats_equal_the_whole_sequence_inside_the_window_and_are_zero_outside(data, rows, length,
                                                                                       chunk_size, remat, seed):
    """Starts anywhere (before column 1, near the end, past it), windows of 1 token to longer than the row
    (``W >= T - 1``: the whole-sequence path, masked), one chunk or several, rematerialised or not."""
    size = data.draw(st.sampled_from([1, 2, length // 2 + 1, length - 2, length - 1, length + 1]), label="size")
    start = data.draw(st.lists(st.integers(0, length + 1), min_size=rows, max_size=rows), label="start")
    start = jnp.asarray(start, jnp.int32)
    hidden, kernel, tokens, mask = _inputs(seed, rows, length)
    full_lp, full_entropy = _jitted_stats(chunk_size, remat, None)(hidden, kernel, tokens, mask, start)
    lp, entropy = _jitted_stats(chunk_size, remat, size)(hidden, kernel, tokens, mask, start)
    inside = _in_window(start, size, length)
    np.testing.assert_allclose(lp, np.where(inside, full_lp, 0.0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(entropy, np.where(inside, full_entropy, 0.0), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(lp)[~inside] == 0.0) and np.all(np.asarray(entropy)[~inside] == 0.0)
    scored = inside & np.asarray(mask) & (np.arange(length) > 0)
    assert np.all(np.asarray(lp)[scored] < 0.0)  # the window's tokens really are scored


def test_windowed_replayed_sampler_equals_the_whole_sequence():
    """Per-row sampling parameters (top-k, top-p, min-p, temperature) follow their rows into the window."""
    hidden, kernel, tokens, mask = _inputs(3, 4, 10)
    sampling = SamplerParams(temperature=jnp.array([0.7, 1.0, 1.3, 0.9]), top_k=jnp.array([5, 0, 0, 3]),
                             top_p=jnp.array([1.0, 0.8, 1.0, 1.0]), min_p=jnp.array([0.0, 0.0, 0.1, 0.0]))
    start = np.array([6, 2, 0, 9])

    @jax.jit
    def both(hidden, kernel):
        full = logprobs_from_hidden(hidden, kernel, tokens, mask, chunk_size=2, sampling=sampling)
        return full, logprobs_from_hidden(hidden, kernel, tokens, mask, chunk_size=2, sampling=sampling,
                                          window_start=jnp.asarray(start), window_size=3)

    full, windowed = both(hidden, kernel)
    np.testing.assert_allclose(windowed, np.where(_in_window(start, 3, 10), full, 0.0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_size, remat", [(2, None), (2, False), (64, None)])
def test_gradients_of_a_loss_inside_the_window_equal_the_whole_sequence(chunk_size, remat):
    rows, length, size = 3, 12, 5
    hidden, kernel, tokens, mask = _inputs(1, rows, length)
    start = jnp.array([4, 1, 9])  # row 2's window runs past the end
    loss_mask = jnp.asarray(_in_window(start, size, length), jnp.float32) * np.linspace(-1.0, 2.0, length)

    def loss(window):
        def fn(h, k):
            lp, entropy = logprobs_from_hidden(h, k, tokens, mask, temperature=1.2, chunk_size=chunk_size,
                                               remat=remat, return_entropy=True, **window)
            return jnp.sum(loss_mask * (lp + 0.1 * entropy))
        return jax.jit(jax.grad(fn, argnums=(0, 1)))

    want = loss({})(hidden, kernel)
    got = loss(dict(window_start=start, window_size=size))(hidden, kernel)
    assert float(jnp.abs(want[0]).sum()) > 0
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_a_window_needs_both_its_start_and_its_size():
    hidden, kernel, tokens, mask = _inputs(0, 1, 4)
    with pytest.raises(ValueError, match="window_start and window_size"):
        logprobs_from_hidden(hidden, kernel, tokens, mask, window_size=2)
    with pytest.raises(ValueError, match="window_size=0"):
        logprobs_from_hidden(hidden, kernel, tokens, mask, window_start=jnp.zeros(1, jnp.int32), window_size=0)


WINDOW = 20  # update_problem's rows train tokens 4 .. length - 1 <= 23: spans of up to 20, in 3 chunks of 8


@pytest.fixture(scope="module")
def updates():
    """The update problem (decoupled PPO, token TIS, KL to a reference, entropy bonus) through 2 epochs x 2
    mini-batches x 2 micro-batches, with and without the scored window; host results."""
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    corrections = CorrectionConfig(importance=ImportanceWeights("token", high=2.0), kl_coef=0.1, kl_estimator="k3",
                                   entropy_coef=0.01)
    batch = jax.tree.map(jnp.asarray, update_problem.rollout_batch())
    results = {}
    for window in (None, WINDOW):
        config = UpdateConfig(corrections=corrections, num_minibatches=2, num_microbatches=2, ppo_epochs=2,
                              logprob_chunk_size=8, rows_per_chunk=0, scored_window=window)
        graphdef, state, _ = create_sharded_train_state(MODEL, OPTIMIZER, mesh, seed=0)
        _, reference, _ = create_sharded_train_state(MODEL, OPTIMIZER, mesh, seed=1)
        step = jax.jit(functools.partial(update_step, graphdef=graphdef, optimizer=OPTIMIZER, config=config),
                       compiler_options=FAST_COMPILE)
        before = jax.device_get(state.params)
        state, metrics, proximal = step(state, batch, reference.params)
        results[window] = jax.device_get((before, state.params, metrics, proximal))
    return results


@pytest.mark.slow  # 23 s on a quiet 2-core run: out of the default run's 15 minutes
def test_update_with_a_scored_window_equals_the_update_without(updates):
    before, want_params, want_metrics, want_proximal = updates[None]
    _, params, metrics, proximal = updates[WINDOW]
    moved = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(want_params), jax.tree.leaves(before)))
    assert moved > 1e-3  # the updates really train (SGD, learning rate 1)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(want_params),
                                 strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))
    assert metrics.keys() == want_metrics.keys()
    assert np.all(np.abs(want_metrics["actor/kl_loss"]) > 0)
    for name in want_metrics:
        np.testing.assert_allclose(metrics[name], want_metrics[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_the_proximal_logprobs_returned_with_a_scored_window_are_zero_outside_it(updates):
    want, got = updates[None][3], updates[WINDOW][3]
    loss_mask = update_problem.rollout_batch().loss_mask > 0
    np.testing.assert_allclose(got[loss_mask], want[loss_mask], rtol=1e-5, atol=1e-6)
    first = np.where(loss_mask.any(axis=1), np.argmax(loss_mask, axis=1), 0)
    outside = ~_in_window(first, WINDOW, loss_mask.shape[1])
    assert np.all(got[outside] == 0.0)
    assert np.all(want[:-1, 1:update_problem.PROMPT] != 0.0)  # the prompt's logprobs that are no longer computed
