"""``python -m tests.support.cpu_update OUT.npz [PRECISION]``: the update problem's one update (`one_update`) on
whatever backend this process has, saved for `tests.accelerator.test_update_matches_cpu` to compare (it runs this
with ``JAX_PLATFORMS=cpu``)."""

import sys

import jax
import numpy as np
from flax import nnx

from learner.model.sharding import make_mesh
from learner.update.step import make_update_fn
from learner.update.train_state import create_sharded_train_state
from tests.support import update_problem


def one_update(precision: str) -> dict[str, np.ndarray]:
    """The update problem on this process's first device: the loss and every parameter's change, flat."""
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    graphdef, state, shardings = create_sharded_train_state(update_problem.MODEL, update_problem.OPTIMIZER, mesh)
    _, reference, _ = create_sharded_train_state(update_problem.MODEL, update_problem.OPTIMIZER, mesh, seed=1)
    before = nnx.to_flat_state(jax.device_get(state.params))
    update = make_update_fn(graphdef, update_problem.OPTIMIZER, update_problem.update_config(1), mesh, shardings,
                            matmul_precision=precision)
    state, metrics, _ = update(state, jax.device_put(update_problem.rollout_batch()), reference.params)
    after = dict(nnx.to_flat_state(jax.device_get(state.params)))
    changes = {"/".join(map(str, path)): np.asarray(after[path][...]) - np.asarray(leaf[...]) for path, leaf in before}
    return {"loss": np.asarray(metrics["actor/pg_loss"]), **changes}


if __name__ == "__main__":
    np.savez(sys.argv[1], **one_update(sys.argv[2] if len(sys.argv) > 2 else "highest"))
