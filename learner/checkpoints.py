"""Checkpoints of the learner state with orbax-checkpoint: async, atomic, retention by recency and by a metric.

One checkpoint per step, in ``<directory>/<step>/``, with three items:

* ``state``: the state pytree (e.g. ``learner.train_state.TrainState``), every leaf a jax.Array, written by
  tensorstore shard by shard (each process writes the shards it holds);
* ``metadata``: JSON ``{"step", "policy_version", "config"}``, readable without loading any array;
* ``data`` (optional): the grain iterator state (one JSON file per process, grain's own orbax handler).

Saves are asynchronous: `Checkpointer.save` returns once the arrays are copied off the devices, and the write
continues in a background thread (the next save, `wait_until_finished` or `close` waits for it). A save is
atomic: it is written to a temporary directory that is renamed to ``<step>`` only once complete (on object stores
such as GCS orbax marks completion with a commit file instead), so a process killed mid-save leaves the previous
checkpoints intact; the next `Checkpointer` on the directory deletes the partial one (in the background, finished
before its first save).

Restores take a target tree of ``jax.ShapeDtypeStruct`` with shardings (`restore_target`); each process reads
only the slices its devices need, so a state saved on one mesh restores onto any other (8 devices -> 2, another
fsdp / tensor split). Multi-host: every process makes the same calls; orbax coordinates the writes.

Policy weights for the inference server are exported with `learner.safetensors_io.save_safetensors`, not here.

Example::

    checkpointer = Checkpointer(CheckpointConfig(str(run_dir / "checkpoints"), keep_last=2))
    checkpointer.save(step, state, policy_version=version, config=run_config, data_iterator=prompts)
    ...
    restored = checkpointer.restore(restore_target(state, shardings), data_iterator=prompts)
    state, step = restored.state, restored.step
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

import grain.checkpoint
import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers

_STATE = "state"
_METADATA = "metadata"
_DATA = "data"


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Where checkpoints go and which of them are kept.

    A checkpoint is kept while it is among the ``keep_last`` most recent OR among the ``keep_best`` best by
    ``best_metric``; the others are deleted after each save.
    """

    directory: str  # Root directory; created if missing. Local path or any URL orbax supports (gs://...).
    keep_last: int | None = 3  # Most recent checkpoints kept; None keeps all.
    keep_best: int = 0  # Best checkpoints by best_metric kept in addition to the recent ones.
    best_metric: str | None = None  # Metric ranking checkpoints (needed for keep_best); every save must pass it.
    best_mode: Literal["max", "min"] = "max"  # Whether a larger or a smaller metric is better.
    save_interval_steps: int = 1  # `Checkpointer.save` skips steps not divisible by this (unless forced).
    async_save: bool = True  # Write in a background thread; False blocks in save until the checkpoint is final.

    def __post_init__(self):
        if self.keep_last is not None and self.keep_last < 1:
            raise ValueError(f"CheckpointConfig.keep_last must be >= 1 or None, got {self.keep_last}")
        if self.keep_best < 0:
            raise ValueError(f"CheckpointConfig.keep_best must be >= 0, got {self.keep_best}")
        if self.keep_best and self.best_metric is None:
            raise ValueError("CheckpointConfig.keep_best > 0 needs best_metric")
        if self.best_mode not in ("max", "min"):
            raise ValueError(f"CheckpointConfig.best_mode must be 'max' or 'min', got {self.best_mode!r}")
        if self.save_interval_steps < 1:
            raise ValueError(f"CheckpointConfig.save_interval_steps must be >= 1, got {self.save_interval_steps}")


class Restored(NamedTuple):
    """What `Checkpointer.restore` returns."""

    step: int
    state: Any  # The state pytree, on the target's shardings.
    metadata: dict[str, Any]  # {"step", "policy_version", "config"} as saved.


def restore_target(state, shardings):
    """Abstract target for `Checkpointer.restore`: ``state``'s shapes and dtypes placed on ``shardings``.

    Args:
        state: a pytree of arrays or ``jax.ShapeDtypeStruct`` (e.g. ``jax.eval_shape`` of the state constructor).
        shardings: a pytree of shardings with the same structure (e.g. on a new mesh).

    Example:
        >>> from learner.sharding import make_mesh
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> import jax.numpy as jnp
        >>> mesh = make_mesh(data=2, devices=jax.devices()[:2])
        >>> restore_target({"w": jnp.zeros((4, 2))}, {"w": NamedSharding(mesh, P("data"))})["w"].sharding.spec
        P('data',)
    """
    return jax.tree.map(lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                        state, shardings)


def _config_json(config) -> Any:
    return dataclasses.asdict(config) if dataclasses.is_dataclass(config) else config


def _retention(config: CheckpointConfig, metric_fn) -> checkpoint_managers.PreservationPolicy:
    latest = checkpoint_managers.LatestN(n=config.keep_last)
    if not config.keep_best:
        return latest
    best = checkpoint_managers.BestN(get_metric_fn=metric_fn,
                                     reverse=config.best_mode == "min", n=config.keep_best,
                                     keep_checkpoints_without_metrics=False)
    return checkpoint_managers.AnyPreservationPolicy([latest, best])


class Checkpointer:
    """Saves and restores the learner state, its metadata and the data iterator state (see the module docstring).

    Args:
        config: directory and retention.
    """

    def __init__(self, config: CheckpointConfig):
        self.config = config
        metric_fn = None if config.best_metric is None else (lambda metrics: metrics[config.best_metric])
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=config.save_interval_steps,
            preservation_policy=_retention(config, metric_fn),
            best_fn=metric_fn,  # ranks checkpoints for best_step() and makes orbax store the metrics
            best_mode=config.best_mode,
            enable_async_checkpointing=config.async_save,
            cleanup_tmp_directories=True,  # partial saves of a killed run are deleted here
        )
        self._manager = ocp.CheckpointManager(config.directory, options=options)

    def save(self, step: int, state, *, policy_version: int, config=None, data_iterator=None,
             metrics: Mapping[str, float] | None = None, force: bool = False) -> bool:
        """Starts saving checkpoint ``step`` (asynchronously unless ``CheckpointConfig.async_save`` is False).

        Args:
            step: checkpoint number, increasing across saves.
            state: the state pytree; its arrays may be donated or changed once this returns.
            policy_version: policy version of ``state``, stored in the metadata.
            config: the run's configuration (a dataclass or a JSON-serialisable mapping), stored in the metadata.
            data_iterator: a grain ``DatasetIterator`` whose current position is saved, so a restore resumes the
                data where this save left it.
            metrics: scalar metrics of this step; must hold ``best_metric`` when one is configured (otherwise
                they are not stored).
            force: save even if ``step`` is not a multiple of ``save_interval_steps``.

        Returns:
            Whether a save was started.
        """
        if self.config.best_metric is not None and (metrics is None or self.config.best_metric not in metrics):
            raise ValueError(f"save(step={step}) needs metrics[{self.config.best_metric!r}] to rank checkpoints")
        items = {_STATE: ocp.args.StandardSave(state),
                 _METADATA: ocp.args.JsonSave({"step": step, "policy_version": int(policy_version),
                                               "config": _config_json(config)})}
        if data_iterator is not None:
            items[_DATA] = grain.checkpoint.CheckpointSave(data_iterator)
        metrics = None if self.config.best_metric is None else {k: float(v) for k, v in metrics.items()}
        return self._manager.save(step, args=ocp.args.Composite(**items), metrics=metrics, force=force)

    def restore(self, target, *, step: int | None = None, data_iterator=None) -> Restored:
        """Restores checkpoint ``step`` (default: the latest) onto the shardings of ``target``.

        Args:
            target: pytree with the structure of the saved state whose leaves are ``jax.ShapeDtypeStruct`` with
                shardings (see `restore_target`) or arrays (their shardings are used).
            step: which checkpoint; None for the latest.
            data_iterator: a grain ``DatasetIterator`` over the same pipeline; its position is set to the saved one.

        Raises:
            FileNotFoundError: there is no checkpoint (at ``step``).
        """
        self._manager.wait_until_finished()  # the latest step may still be in flight
        step = self._existing_step(step)
        items = {_STATE: ocp.args.StandardRestore(target), _METADATA: ocp.args.JsonRestore()}
        if data_iterator is not None:
            items[_DATA] = grain.checkpoint.CheckpointRestore(data_iterator)
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        return Restored(step=step, state=restored[_STATE], metadata=dict(restored[_METADATA]))

    def read_metadata(self, step: int | None = None) -> dict[str, Any]:
        """The metadata of checkpoint ``step`` (default: the latest), without reading any array."""
        self._manager.wait_until_finished()
        step = self._existing_step(step)
        restored = self._manager.restore(step, args=ocp.args.Composite(**{_METADATA: ocp.args.JsonRestore()}))
        return dict(restored[_METADATA])

    def _existing_step(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.config.directory}")
        if step not in self.all_steps():
            raise FileNotFoundError(f"no checkpoint {step} in {self.config.directory} (have {self.all_steps()})")
        return step

    def latest_step(self) -> int | None:
        """The most recent checkpoint step (including a save still in flight), or None."""
        return self._manager.latest_step()

    def best_step(self) -> int | None:
        """The best step by ``best_metric`` (the latest one when no metric is configured), or None."""
        return self._manager.best_step()

    def all_steps(self) -> list[int]:
        """Steps of the checkpoints kept, in increasing order."""
        return sorted(self._manager.all_steps())

    def wait_until_finished(self) -> None:
        """Blocks until the save in flight (if any) is final and old checkpoints are deleted."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for the save in flight and releases the manager's threads."""
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
