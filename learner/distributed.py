"""Multi-host start: join every process of a run to one JAX distributed system, before any other JAX call.

The same script runs on every host. Either give the coordinator, the process count and this process's id, or give
nothing and let ``jax.distributed.initialize`` read them from the cluster: Cloud TPU VMs (libtpu installed),
SLURM (``srun`` with more than one task), Open MPI (``mpirun``), or JAX's own ``JAX_COORDINATOR_ADDRESS``
environment. Anywhere else with no arguments, and whenever ``num_processes == 1``, it does nothing: a single
process needs no distributed system.
"""

from __future__ import annotations

import importlib.util
import os

import jax


def cluster_detected() -> bool:
    """Whether the environment describes a cluster that ``jax.distributed.initialize()`` can read by itself."""
    env = os.environ
    return ("JAX_COORDINATOR_ADDRESS" in env
            or int(env.get("SLURM_NTASKS", "1")) > 1
            or "OMPI_MCA_orte_hnp_uri" in env
            or importlib.util.find_spec("libtpu") is not None)


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               ) -> bool:
    """Starts JAX's distributed system for this process, unless there is nothing to start.

    Args:
        coordinator: ``"host:port"`` of process 0's coordinator service; None to auto-detect.
        num_processes: processes in the run; None to auto-detect; 1 makes this a no-op.
        process_id: this process's index in ``[0, num_processes)``; None to auto-detect.

    Returns:
        True if this process is now part of a distributed system (started here or before), False if it runs alone.

    Example:
        >>> initialize(num_processes=1)
        False
    """
    if jax.distributed.is_initialized():
        return True
    if num_processes == 1:
        return False
    if coordinator is None and num_processes is None and process_id is None and not cluster_detected():
        return False
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    return True


def process_index_before_backends() -> int:
    """This process's index in the distributed system (0 without one), read without starting a backend:
    ``jax.process_index()`` starts them, and a process's memory budget must be set before that.

        >>> process_index_before_backends()
        0
    """
    if not jax.distributed.is_initialized():
        return 0
    from jax._src import distributed  # no public accessor before a backend exists

    return distributed.global_state.process_id
