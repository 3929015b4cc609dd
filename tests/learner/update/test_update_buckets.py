"""The update at a batch's bucket length equals the update at the run's full length: every reduction, Dr. GRPO's
seq-mean-token-sum-norm included (it divides by ``UpdateConfig.norm_length``, not by the bucket)."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from corrections import CorrectionConfig, ImportanceWeights
from learner.model.sharding import make_mesh
from learner.update.bucketing import BucketConfig, cut_batch, pad_batch
from learner.update.step import make_update_fn
from learner.update.train_state import create_sharded_train_state
from tests.support.update_problem import (
    FAST_COMPILE,
    LENGTH,
    MODEL,
    OPTIMIZER,
    global_batch,
    rollout_batch,
    update_config,
)

FULL = 64  # the run's length: rollout_batch's rows (at most 24 tokens) padded to it
BUCKETS = BucketConfig(min_length=8, multiple=8, max_length=FULL)


def update(batch, corrections: CorrectionConfig, norm_length: int | None, window: int | None = None):
    """Host ``(params after, metrics)`` of one update from the same initial state."""
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    graphdef, state, shardings = create_sharded_train_state(MODEL, OPTIMIZER, mesh, seed=0)
    config = dataclasses.replace(update_config(2, corrections), norm_length=norm_length, scored_window=window)
    fn = make_update_fn(graphdef, OPTIMIZER, config, mesh, shardings, FAST_COMPILE)
    state, metrics, _ = fn(state, global_batch(batch, mesh), None)
    return jax.device_get(nnx.to_pure_dict(state.params)), jax.device_get(metrics)


@pytest.mark.parametrize("reduction, window", [
    # the scored window (32) is narrower than the full length (64) but not than the bucket (24): the bucketed update
    # scores every token, the full-length one a window
    ("seq-mean-token-sum-norm", 32),
    pytest.param("seq-mean-token-sum-norm", None, marks=pytest.mark.slow),
    pytest.param("token-mean", None, marks=pytest.mark.slow),
    pytest.param("seq-mean-token-mean", None, marks=pytest.mark.slow)])
def test_the_bucketed_update_equals_the_full_length_one(reduction, window):
    corrections = CorrectionConfig(importance=ImportanceWeights("token", high=2.0), reduction=reduction)
    full = cut_batch(rollout_batch(), FULL)
    bucketed = pad_batch(full, BUCKETS)
    assert bucketed.tokens.shape == (16, LENGTH)  # the longest row's 24 tokens, not 64
    want_params, want = update(full, corrections, FULL, window)
    got_params, got = update(bucketed, corrections, FULL, window)
    assert want["actor/pg_loss"] != 0
    np.testing.assert_allclose(got["actor/pg_loss"], want["actor/pg_loss"], rtol=1e-5)
    for name in ("actor/grad_norm", "actor/pg_clipfrac"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), got_params, want_params)


@pytest.mark.slow  # the control of the bucketed update's exactness test (18-27 s)
def test_without_the_fixed_norm_length_dr_grpo_would_change_with_the_bucket():
    """The control: dividing by the batch's own length scales seq-mean-token-sum-norm's loss by 64 / 24."""
    corrections = CorrectionConfig(importance=ImportanceWeights("token", high=2.0), reduction="seq-mean-token-sum-norm")
    full = cut_batch(rollout_batch(), FULL)
    _, want = update(full, corrections, None)
    _, got = update(pad_batch(full, BUCKETS), corrections, None)
    np.testing.assert_allclose(got["actor/pg_loss"], want["actor/pg_loss"] * FULL / LENGTH, rtol=1e-5)
