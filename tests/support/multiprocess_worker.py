"""One process of the multi-process update test: ``python multiprocess_worker.py PORT NUM_PROCESSES ID OUT.npz``,
the checkout on ``PYTHONPATH``.

Each process simulates ``8 / NUM_PROCESSES`` CPU devices, joins the others through the gloo collectives on
127.0.0.1 (`learner.distributed.initialize`), runs `update_problem.run_update` on the global (2, 2, 2) mesh and
process 0 writes the gathered parameter change and metrics to ``OUT.npz``.
"""

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402  (after JAX_PLATFORMS)
import numpy as np  # noqa: E402


def main(port: int, num_processes: int, process_id: int, out: str) -> None:
    jax.config.update("jax_num_cpu_devices", 8 // num_processes)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from learner.distributed import initialize
    from learner.model.sharding import make_mesh
    from tests.support.update_problem import run_update

    initialize(f"127.0.0.1:{port}", num_processes, process_id)
    before, after, metrics = run_update(make_mesh(2, 2, 2))
    if jax.process_index() == 0:
        delta = jax.tree.map(np.subtract, after, before)
        flat = {jax.tree_util.keystr(path): value for path, value in jax.tree_util.tree_leaves_with_path(delta)}
        np.savez(out, **flat, **{f"metric:{name}": value for name, value in metrics.items()})
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
