"""Checks before anything trains: what the config names exists and answers, so a bad run fails in seconds, before
the warm-up, with one `ConfigError` naming the key and the fix.

* `check_paths_and_names` (before JAX starts): the named model, ``model.hf_path``, the mesh sizes and a multi-process
  start's coordinator;
* `probe_engines` (before the warm-up): a TCP connection to every ``server.address``;
* `probe_rewards` (before the first rollout): each reward called once on a real prompt record, so a reward with the
  wrong signature, or one that returns None, is found at start rather than at RL step 1.
"""

from __future__ import annotations

import pathlib
import socket
from typing import TYPE_CHECKING

from learner.distributed import cluster_detected
from learner.model.transformer import model_config
from learner.rl.config import engine_addresses

if TYPE_CHECKING:
    from learner.rl.config import RunConfig

PROBE_TIMEOUT_S = 10.0  # per engine address: connecting is quick, a wrong address fails at once or times out


class ConfigError(ValueError):
    """A config value that cannot work here; the message names the key and the fix."""


def check_paths_and_names(config: RunConfig) -> None:
    """The model, the mesh and the distributed start the config names are possible (no JAX call)."""
    model = config.model
    if model.hf_path is None:
        try:
            model_config(model.name)
        except ValueError as error:
            raise ConfigError(f"model.name: {error} (or set model.hf_path to a Hugging Face checkpoint "
                              "directory)") from None
    if model.hf_path is not None and not (pathlib.Path(model.hf_path) / "config.json").is_file():
        raise ConfigError(f"model.hf_path={model.hf_path!r}: no config.json there; give a Hugging Face checkpoint "
                          "directory (config.json + *.safetensors)")
    mesh = config.mesh
    sizes = {"mesh.data": mesh.data, "mesh.fsdp": mesh.fsdp, "mesh.tensor": mesh.tensor}
    bad = [f"{key}={value}" for key, value in sizes.items() if value == 0 or value < -1]
    if bad or list(sizes.values()).count(-1) > 1:
        raise ConfigError(f"{', '.join(bad or [f'{k}={v}' for k, v in sizes.items()])}: each mesh size is a "
                          "positive device count, or -1 (the remaining devices) for at most one of them")
    distributed = config.distributed
    if (distributed.num_processes or 1) > 1 and distributed.coordinator is None and not cluster_detected():
        raise ConfigError(f"distributed.num_processes={distributed.num_processes}: needs distributed.coordinator "
                          "(--coordinator host:port of process 0) and distributed.process_id (--process-id) on "
                          "each process, unless a cluster (SLURM, Open MPI, Cloud TPU) provides them")


def probe_engines(config: RunConfig, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Connects to every ``server.address`` (TCP only: no request is sent)."""
    for address in engine_addresses(config):
        if address.startswith("unix:"):
            continue
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
        except OSError as error:
            raise ConfigError(f"server.address: cannot reach {address} ({error or type(error).__name__}); start the "
                              "engine there, or fix server.address (leave it out to launch the embedded "
                              "server)") from None


def probe_rewards(task) -> None:
    """Calls each reward of a task with rewards (the ``dataset`` task: ``reward_set``) once, on its first training
    prompt record and an empty completion."""
    reward_set = getattr(task, "reward_set", None)
    if reward_set is None:
        return
    record = task.prompts()[0]
    problem = reward_set.check_callable("", record["prompt"], record["row"])
    if problem:
        raise ConfigError(f"task.args.rewards: {problem} (called once on the first training prompt, before "
                          "training); fix the reward function")
