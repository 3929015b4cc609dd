"""A small fixed update problem, the same in the update tests and in the multi-process workers.

Decoupled PPO with token TIS weights and a KL penalty to a reference model (so the proximal and the reference
recompute both run), plain SGD with learning rate 1 (so the parameter change IS minus the gradient), 16 rows of
varied lengths whose padding holds token `PAD_TOKEN` and NaN rollout logprobs, and one fully masked row of
`EMPTY_ROW_TOKEN`. Neither token appears anywhere else, so their embedding gradients must be exactly zero.
"""

import jax
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils

from corrections import CorrectionConfig, ImportanceWeights
from learner.model.sharding import batch_sharding
from learner.model.transformer import model_config
from learner.update.batch import TrainBatch
from learner.update.step import UpdateConfig, make_update_fn
from learner.update.train_state import create_sharded_train_state

ROWS, LENGTH, PROMPT = 16, 24, 4
PAD_TOKEN, EMPTY_ROW_TOKEN = 127, 126
MODEL = model_config("tiny")
OPTIMIZER = optax.sgd(1.0)
# XLA options that halve compile times on CPU (tests are compile-bound; run time barely changes).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def rollout_batch() -> TrainBatch:
    """The fixed host batch (last row fully masked)."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(PROMPT + 2, LENGTH + 1, ROWS)
    real = np.arange(LENGTH)[None, :] < lengths[:, None]
    real[-1] = False
    tokens = np.where(real, rng.integers(1, EMPTY_ROW_TOKEN, (ROWS, LENGTH)), PAD_TOKEN)
    tokens[-1] = EMPTY_ROW_TOKEN
    loss_mask = real & (np.arange(LENGTH)[None, :] >= PROMPT)
    advantages = np.broadcast_to(rng.normal(size=(ROWS, 1)), (ROWS, LENGTH))
    rollout_logprobs = np.where(loss_mask, -rng.uniform(3.0, 6.0, (ROWS, LENGTH)), np.nan)
    return TrainBatch(tokens=tokens.astype(np.int32),
                        positions=np.broadcast_to(np.arange(LENGTH, dtype=np.int32), (ROWS, LENGTH)),
                        attention_mask=real, loss_mask=loss_mask.astype(np.float32),
                        advantages=advantages.astype(np.float32),
                        rollout_logprobs=rollout_logprobs.astype(np.float32),
                        policy_version=np.zeros((ROWS, LENGTH), np.int32))


CORRECTIONS = CorrectionConfig(importance=ImportanceWeights("token", high=2.0), kl_coef=0.1, kl_estimator="k3")


def update_config(num_microbatches: int, corrections: CorrectionConfig = CORRECTIONS) -> UpdateConfig:
    """PPO + token TIS + KL (by default), one mini-batch, no shuffle."""
    return UpdateConfig(corrections=corrections, num_microbatches=num_microbatches, shuffle=False,
                        logprob_chunk_size=8, rows_per_chunk=0)


def global_batch(batch: TrainBatch, mesh) -> TrainBatch:
    """Each process contributes the rows on its own devices (`jax.make_array_from_process_local_data`)."""
    sharding = batch_sharding(mesh)
    indices = sharding.addressable_devices_indices_map(batch.tokens.shape).values()
    start = min(index[0].start or 0 for index in indices)
    stop = max(index[0].stop or batch.tokens.shape[0] for index in indices)
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)[start:stop],
                                                                         x.shape), batch)


def run_update(mesh, num_microbatches: int = 1, batch: TrainBatch | None = None,
               corrections: CorrectionConfig = CORRECTIONS, model=MODEL):
    """One update call of ``model`` (a `ModelConfig`) on ``mesh`` (of `rollout_batch` by default); returns host
    ``(params_before, params_after, metrics)`` as pure dicts."""
    graphdef, state, shardings = create_sharded_train_state(model, OPTIMIZER, mesh, seed=0)
    _, reference, _ = create_sharded_train_state(model, OPTIMIZER, mesh, seed=1)
    gather = multihost_utils.process_allgather
    before = gather(nnx.to_pure_dict(state.params), tiled=True)
    update = make_update_fn(graphdef, OPTIMIZER, update_config(num_microbatches, corrections), mesh, shardings,
                            FAST_COMPILE)
    batch = rollout_batch() if batch is None else batch
    state, metrics, _ = update(state, global_batch(batch, mesh), reference.params)
    return before, gather(nnx.to_pure_dict(state.params), tiled=True), gather(metrics, tiled=True)
