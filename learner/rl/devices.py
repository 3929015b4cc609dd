"""How the learner and the reference server it launches share one host's accelerators.

Memory. A JAX process on a GPU takes 75% of every visible device's memory at start, so a learner and an embedded
server on the same GPU ran it out of memory (the server at its first Generate). Each gets an explicit budget,
``XLA_PYTHON_CLIENT_MEM_FRACTION``, from `learner.rl.config.memory_fractions`: by default 0.65 for the learner
(``mesh.device_memory_fraction``) and 0.25 for the server (``server.device_memory_fraction``) while they share the
devices; a process on devices of its own keeps JAX's default unless its key is set. The server's budget goes into its
environment only; the learner's is set in this process before JAX starts its backends (`configure_learner`, which
``python -m learner.train`` calls first; a notebook calls it before its first JAX computation).

Devices. ``server.device = K`` runs the embedded server alone on the host's GPU ``K`` (``CUDA_VISIBLE_DEVICES`` in
its environment) and hides that GPU from the learner (``jax_cuda_visible_devices``), whose mesh then spans the
others. A TPU chip belongs to one process, and a host's remaining chips rarely form the rectangle libtpu needs, so on
TPU hosts the engine runs on other hosts (``server.address``; docs/accelerators.md).

External engines (``server.address``, ``server.engine`` other than ``"tether"``) are left alone.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping

import jax

from learner.rl.config import RunConfig, load_config, memory_fractions  # noqa: F401 - load_config: doctests

MEMORY_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
NVIDIA_GPUS = pathlib.Path("/proc/driver/nvidia/gpus")  # one entry per GPU the driver sees (Linux)


def local_gpu_ids(environ: Mapping[str, str] = os.environ, gpu_dir: pathlib.Path = NVIDIA_GPUS) -> list[str]:
    """The host's GPUs as CUDA names them for this process: ``CUDA_VISIBLE_DEVICES``'s entries when set, else one id
    per GPU the NVIDIA driver lists (none on a host without one), without starting CUDA.

    >>> local_gpu_ids({"CUDA_VISIBLE_DEVICES": "4,6"})
    ['4', '6']
    """
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [entry.strip() for entry in visible.split(",") if entry.strip()]
    return [str(i) for i in range(len(list(gpu_dir.iterdir())))] if gpu_dir.is_dir() else []


def _server_gpu(config: RunConfig, gpu_ids: list[str]) -> int:
    """``server.device``, checked against the host's GPUs."""
    device = config.server.device
    if len(gpu_ids) < 2:
        raise ValueError(f"server.device={device}: puts the embedded server on a GPU of its own and the learner on "
                         f"the others, but this process sees {len(gpu_ids)} NVIDIA GPU(s) (CUDA_VISIBLE_DEVICES, "
                         f"{NVIDIA_GPUS}); unset it to share the device (memory budgets), or on a TPU host run the "
                         "engine elsewhere (server.address)")
    if device >= len(gpu_ids):
        raise ValueError(f"server.device={device}: this process sees {len(gpu_ids)} GPUs (0 to {len(gpu_ids) - 1})")
    return device


def engine_environment(config: RunConfig, environ: Mapping[str, str] = os.environ,
                       gpu_dir: pathlib.Path = NVIDIA_GPUS) -> dict[str, str]:
    """The variables added to the embedded server's environment: its memory budget and, with ``server.device``,
    the one GPU it sees.

    >>> engine_environment(load_config(None))
    {'XLA_PYTHON_CLIENT_MEM_FRACTION': '0.25'}
    """
    _, fraction = memory_fractions(config)
    env = {} if fraction is None else {MEMORY_FRACTION_ENV: f"{fraction:g}"}
    if config.server.device is not None:
        gpu_ids = local_gpu_ids(environ, gpu_dir)
        env["CUDA_VISIBLE_DEVICES"] = gpu_ids[_server_gpu(config, gpu_ids)]
    return env


def configure_learner(config: RunConfig, environ: dict[str, str] = os.environ,
                      gpu_dir: pathlib.Path = NVIDIA_GPUS, process_index: int = 0) -> None:
    """This process's memory budget and, with ``server.device``, the GPUs it uses (all but the server's): call it
    before JAX starts its backends (they read both once). ``process_index``: this process's in a multi-process run
    (`learner.distributed.process_index_before_backends`); only process 0 shares its devices with the server."""
    fraction, _ = memory_fractions(config, process_index)
    if fraction is not None:
        environ[MEMORY_FRACTION_ENV] = f"{fraction:g}"
    if config.server.device is not None:
        gpu_ids = local_gpu_ids(environ, gpu_dir)
        server = _server_gpu(config, gpu_ids)
        jax.config.update("jax_cuda_visible_devices", ",".join(str(i) for i in range(len(gpu_ids)) if i != server))
