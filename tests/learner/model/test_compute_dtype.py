"""``model.compute_dtype``: bfloat16 compute with float32 master weights, float32 exact by default.

The bf16 update is checked against the float32 one on `update_problem` (PPO + token TIS + KL, plain SGD with
learning rate 1, so the parameter change is minus the gradient); the master weights and the optimizer state stay
float32 through an update and a checkpoint round trip.
"""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from learner.checkpoints import CheckpointConfig, Checkpointer, restore_target
from learner.model.sharding import make_mesh
from learner.rl.config import load_config
from learner.rl.trainer import learner_model_config
from learner.update import make_update_fn
from learner.update.train_state import create_sharded_train_state
from tests.support import update_problem

EXACT = dataclasses.replace(update_problem.MODEL, num_layers=1)  # one layer: half the compile time
BF16 = dataclasses.replace(EXACT, dtype="bfloat16")


def _flat(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.fixture(scope="module")
def updates():
    """The float32 update (`update_problem.run_update`) and the bf16 one, whose device state is kept."""
    mesh = make_mesh(data=-1)
    before, exact, exact_metrics = update_problem.run_update(mesh, model=EXACT)
    optimizer = update_problem.OPTIMIZER
    graphdef, state, shardings = create_sharded_train_state(BF16, optimizer, mesh, seed=0)
    _, reference, _ = create_sharded_train_state(BF16, optimizer, mesh, seed=1)
    update = make_update_fn(graphdef, optimizer, update_problem.update_config(1), mesh, shardings,
                            update_problem.FAST_COMPILE)
    state, mixed_metrics, _ = update(state, update_problem.global_batch(update_problem.rollout_batch(), mesh),
                                     reference.params)
    return (_flat(before), _flat(exact), exact_metrics, _flat(nnx.to_pure_dict(state.params)),
            jax.device_get(mixed_metrics), (state, shardings))


def test_the_run_config_sets_the_compute_dtype_of_every_pass_and_keeps_float32_parameters():
    exact = learner_model_config(load_config(None), 32)
    mixed = learner_model_config(load_config(None, ["model.compute_dtype=bfloat16"]), 32)
    assert (exact.dtype, exact.param_dtype) == ("float32", "float32")
    assert (mixed.dtype, mixed.param_dtype) == ("bfloat16", "float32")
    with pytest.raises(ValueError, match="model.compute_dtype"):
        load_config(None, ["model.compute_dtype=float16"])


@pytest.mark.slow  # 17 s on a quiet 2-core run: out of the default run's 15 minutes
def test_a_bfloat16_update_follows_the_float32_one_to_bfloat16_precision(updates):
    """Stated tolerance: the bf16 parameter change is within 5% (L2) of the float32 one, cosine > 0.998; the loss
    within 1%. Measured on CPU: 1.4% and 0.99991 (bf16 keeps 8 mantissa bits: ~0.4% per rounding)."""
    before, exact, exact_metrics, mixed, mixed_metrics, _ = updates
    exact_step = np.concatenate([(exact[k] - before[k]).ravel() for k in sorted(before)]).astype(np.float64)
    mixed_step = np.concatenate([(mixed[k] - before[k]).ravel() for k in sorted(before)]).astype(np.float64)
    error = np.linalg.norm(mixed_step - exact_step) / np.linalg.norm(exact_step)
    cosine = mixed_step @ exact_step / (np.linalg.norm(mixed_step) * np.linalg.norm(exact_step))
    assert 1e-4 < error < 0.05, error  # above 1e-4: the bf16 setting took effect
    assert cosine > 0.998, cosine
    loss = "actor/pg_loss"
    np.testing.assert_allclose(mixed_metrics[loss], exact_metrics[loss], rtol=0.01)
    assert all(value.dtype == np.float32 for value in mixed.values())


def test_master_weights_stay_float32_through_a_checkpoint_round_trip(tmp_path, updates):
    state, shardings = updates[-1]
    assert all(leaf.dtype == np.float32 for leaf in jax.tree.leaves(nnx.to_pure_dict(state.params)))
    with Checkpointer(CheckpointConfig(str(tmp_path))) as checkpointer:
        checkpointer.save(1, state, policy_version=1)
    with Checkpointer(CheckpointConfig(str(tmp_path))) as checkpointer:
        restored = checkpointer.restore(restore_target(state, shardings)).state
    saved, loaded = _flat(nnx.to_pure_dict(state.params)), _flat(nnx.to_pure_dict(restored.params))
    assert saved.keys() == loaded.keys()
    for name, value in saved.items():
        assert loaded[name].dtype == np.float32, name
        np.testing.assert_array_equal(loaded[name], value, err_msg=name)
