"""Checkpoints of the learner state with orbax-checkpoint: async, atomic, retention by recency and by a metric.

One checkpoint per step, in ``<directory>/<step>/``, with three items:

* ``state``: the state pytree (e.g. ``learner.update.train_state.TrainState``), every leaf a jax.Array, written by
  tensorstore shard by shard (each process writes the shards it holds);
* ``metadata``: JSON ``{"step", "policy_version", "config"}`` and any ``extra_metadata`` of the save (a LoRA run's
  ``"lora_base"``), readable without loading any array;
* ``data`` (optional): the grain iterator state (one JSON file per process, grain's own orbax handler).

Saves are asynchronous: `Checkpointer.save` returns once the arrays are copied off the devices, and the write
continues in a background thread (the next save, `wait_until_finished` or `close` waits for it). A save is
atomic: it is written to a temporary directory that is renamed to ``<step>`` only once complete (on object stores
such as GCS orbax marks completion with a commit file instead), so a process killed mid-save leaves the previous
checkpoints intact; the next `Checkpointer` on the directory deletes the partial one (in the background, finished
before its first save).

Every checkpoint is verified. The manifest is part of the commit: once every file of a save is written and before
its temporary directory is renamed to ``<step>`` (orbax's post-finalization callback), process 0 writes
``manifest.json`` into it: the sha256 and size of every file of the checkpoint. So a checkpoint is verifiable from
the moment it exists, whatever the moment a process dies. `restore` checks the files it finds against it (on
several hosts without a shared file system a process sees only its own shards) and, with no explicit step, falls
back to the newest checkpoint that verifies and loads: the skipped ones (a digest or size mismatch naming the file,
the load error, or a missing manifest while an older checkpoint has one) are reported in `Restored.skipped` and as
warnings, and set aside as ``<step>.unverified`` so the run can save those steps again. A checkpoint without a
manifest (written before manifests existed) is restored, with a warning, only when no checkpoint has one.
Retention never deletes the newest checkpoint with a manifest, whatever ``keep_last`` says.

Restores take a target tree of ``jax.ShapeDtypeStruct`` with shardings (`restore_target`); each process reads
only the slices its devices need, so a state saved on one mesh restores onto any other (8 devices -> 2, another
fsdp / tensor split). Multi-host: every process makes the same calls; orbax coordinates the writes.

Policy weights are exported as Hugging Face checkpoints by `learner.export` /
`learner.checkpoints.hf_checkpoint.write_hf_checkpoint`, not here.

Example::

    checkpointer = Checkpointer(CheckpointConfig(str(run_dir / "checkpoints"), keep_last=2))
    checkpointer.save(step, state, policy_version=version, config=run_config, data_iterator=prompts)
    ...
    restored = checkpointer.restore(restore_target(state, shardings), data_iterator=prompts)
    state, step = restored.state, restored.step
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

import grain.checkpoint
import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils
from orbax.checkpoint import checkpoint_managers

_STATE = "state"
_METADATA = "metadata"
_DATA = "data"
MANIFEST = "manifest.json"
_TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax's temporary save directory: <step> + this (atomicity.TMP_DIR_SUFFIX)
_STEP_METADATA = "_CHECKPOINT_METADATA"  # orbax's bookkeeping (timestamps, metrics): rewritten as the save commits


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
    metadata: dict[str, Any]  # {"step", "policy_version", "config", **extra_metadata} as saved.
    skipped: tuple[str, ...] = ()  # newer checkpoints that failed verification or loading, each with the reason.


def restore_target(state, shardings):
    """Abstract target for `Checkpointer.restore`: ``state``'s shapes and dtypes placed on ``shardings``.

    Args:
        state: a pytree of arrays or ``jax.ShapeDtypeStruct`` (e.g. ``jax.eval_shape`` of the state constructor).
        shardings: a pytree of shardings with the same structure (e.g. on a new mesh).

    Example:
        >>> from learner.model.sharding import make_mesh
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


def _sha256(path: epath.Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _files(step_dir: epath.Path, prefix: str = "") -> dict[str, epath.Path]:
    """Every file under ``step_dir`` but the manifest and orbax's step metadata (it changes as the save commits, after
    the manifest is written), by relative path (iterdir: epath has no recursive glob)."""
    files = {}
    for path in sorted(step_dir.iterdir()):
        if path.is_dir():
            files.update(_files(path, f"{prefix}{path.name}/"))
        elif path.name not in (MANIFEST, _STEP_METADATA) or prefix:
            files[prefix + path.name] = path
    return files


def write_manifest(step_dir: epath.Path) -> None:
    """Writes ``step_dir/manifest.json``: ``{relative path: [sha256, size]}`` of every file of the checkpoint."""
    manifest = {name: [_sha256(path), path.stat().length] for name, path in _files(step_dir).items()}
    (step_dir / MANIFEST).write_text(json.dumps(manifest, indent=0, sort_keys=True))


def verify_manifest(step_dir: epath.Path) -> str | None:
    """Why ``step_dir`` fails its manifest (the first file whose size or sha256 differs), or None if it verifies.

    Only files present here are checked (another host may hold the rest); a missing one fails the load instead.
    """
    manifest = json.loads((step_dir / MANIFEST).read_text())
    for name, (expected, size) in manifest.items():
        path = step_dir / name
        if not path.exists():
            continue
        if (actual_size := path.stat().length) != size:
            return f"{path}: {actual_size} bytes, the manifest says {size}"
        if (actual := _sha256(path)) != expected:
            return f"{path}: sha256 {actual}, the manifest says {expected}"
    return None


class _NewestVerified:
    """Preservation policy keeping the newest checkpoint that has a manifest (see `Checkpointer`)."""

    def __init__(self, directory: epath.Path):
        self.directory = directory

    def should_preserve(self, checkpoints: Sequence, *, context) -> list[bool]:
        verified = [c.step for c in checkpoints if (self.directory / str(c.step) / MANIFEST).exists()]
        return [bool(verified) and c.step == max(verified) for c in checkpoints]


def _retention(config: CheckpointConfig, metric_fn) -> checkpoint_managers.PreservationPolicy:
    policies = [checkpoint_managers.LatestN(n=config.keep_last), _NewestVerified(epath.Path(config.directory))]
    if config.keep_best:
        policies.append(checkpoint_managers.BestN(get_metric_fn=metric_fn,
                                                  reverse=config.best_mode == "min", n=config.keep_best,
                                                  keep_checkpoints_without_metrics=False))
    return checkpoint_managers.AnyPreservationPolicy(policies)


def _agree(ok: bool) -> bool:
    """True on every process when it is on all of them (identity for one process)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.asarray(ok))))


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
            # Always orbax's async checkpointer (only it runs the callback); async_save=False waits in `save`.
            async_options=ocp.AsyncOptions(post_finalization_callback=self._write_manifest),
            cleanup_tmp_directories=True,  # partial saves of a killed run are deleted here
        )
        self._directory = epath.Path(config.directory)
        self._saving: int | None = None  # the step of the save in flight
        self._manager = ocp.CheckpointManager(config.directory, options=options)

    def _write_manifest(self) -> None:
        """Writes the manifest of the save in flight into its directory, before orbax commits it (on process 0;
        orbax calls this once every process has written its files)."""
        if jax.process_index() != 0 or self._saving is None:
            return
        temporary = self._directory / f"{self._saving}{_TMP_SUFFIX}"
        write_manifest(temporary if temporary.exists() else self._directory / str(self._saving))  # GCS: in place

    def save(self, step: int, state, *, policy_version: int, config=None, data_iterator=None,
             metrics: Mapping[str, float] | None = None, force: bool = False,
             extra_metadata: Mapping[str, Any] | None = None) -> bool:
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
            extra_metadata: more JSON-serialisable entries of the metadata (e.g. a LoRA run's ``"lora_base"``).

        Returns:
            Whether a save was started.
        """
        if self.config.best_metric is not None and (metrics is None or self.config.best_metric not in metrics):
            raise ValueError(f"save(step={step}) needs metrics[{self.config.best_metric!r}] to rank checkpoints")
        items = {_STATE: ocp.args.StandardSave(state),
                 _METADATA: ocp.args.JsonSave({**(extra_metadata or {}), "step": step,
                                               "policy_version": int(policy_version), "config": _config_json(config)})}
        if data_iterator is not None:
            items[_DATA] = grain.checkpoint.CheckpointSave(data_iterator)
        metrics = None if self.config.best_metric is None else {k: float(v) for k, v in metrics.items()}
        self.wait_until_finished()  # one save in flight at a time: `_write_manifest` knows its step
        self._saving = step
        started = self._manager.save(step, args=ocp.args.Composite(**items), metrics=metrics, force=force)
        if started and not self.config.async_save:
            self.wait_until_finished()
        return started

    def restore(self, target, *, step: int | None = None, data_iterator=None) -> Restored:
        """Restores checkpoint ``step`` (default: the newest that verifies and loads) onto the shardings of ``target``.

        With no ``step``, newer checkpoints that fail their manifest or their load, or have no manifest while an
        older one has, are skipped (with a warning, in `Restored.skipped`) and set aside as ``<step>.unverified``.
        Several processes agree on a checkpoint's manifest; a load error there is raised, not skipped (the
        processes could disagree on it).

        Args:
            target: pytree with the structure of the saved state whose leaves are ``jax.ShapeDtypeStruct`` with
                shardings (see `restore_target`) or arrays (their shardings are used).
            step: which checkpoint; None for the newest one that verifies.
            data_iterator: a grain ``DatasetIterator`` over the same pipeline; its position is set to the saved one.

        Raises:
            FileNotFoundError: there is no checkpoint (at ``step``).
            ValueError: checkpoint ``step`` fails its manifest, or no checkpoint verifies and loads.
        """
        self.wait_until_finished()  # the latest step may still be in flight
        candidates = [self._existing_step(step)] if step is not None else self.all_steps()[::-1]
        if not candidates:
            raise FileNotFoundError(f"no checkpoint in {self.config.directory}")
        items = {_STATE: ocp.args.StandardRestore(target), _METADATA: ocp.args.JsonRestore()}
        if data_iterator is not None:
            items[_DATA] = grain.checkpoint.CheckpointRestore(data_iterator)
        skipped = []
        with_manifest = [s for s in candidates if self._has_manifest(s)]
        for candidate in candidates:
            problem = self._verify(candidate)
            older_verified = [s for s in with_manifest if s < candidate]
            if problem is None and step is None and older_verified and candidate not in with_manifest:
                problem = (f"no {MANIFEST}, so it cannot be verified, while checkpoint {older_verified[0]} can "
                           "(saved by an older version, or its manifest was deleted)")
            elif problem is None and candidate not in with_manifest:
                warnings.warn(f"checkpoint {candidate} in {self.config.directory} has no {MANIFEST}: restoring it "
                              "unverified (no checkpoint here has one)", stacklevel=2)
            if problem is None:
                try:
                    restored = self._manager.restore(candidate, args=ocp.args.Composite(**items))
                except Exception as error:  # noqa: BLE001 -- any load error: skip to an older checkpoint
                    if step is not None or jax.process_count() > 1:
                        raise
                    problem = f"load failed: {type(error).__name__}: {error}"
                else:
                    self._set_aside([s for s, _ in skipped])
                    return Restored(step=candidate, state=restored[_STATE], metadata=dict(restored[_METADATA]),
                                    skipped=tuple(f"checkpoint {s}: {why}" for s, why in skipped))
            if step is not None:
                raise ValueError(f"checkpoint {candidate} in {self.config.directory} fails verification: {problem}")
            warnings.warn(f"skipping checkpoint {candidate} in {self.config.directory}: {problem}", stacklevel=2)
            skipped.append((candidate, problem))
        raise ValueError(f"no checkpoint in {self.config.directory} verifies and loads: "
                         + "; ".join(f"{s}: {why}" for s, why in skipped))

    def _has_manifest(self, step: int) -> bool:
        """Whether checkpoint ``step`` has a manifest, as process 0 sees it (the one that writes manifests)."""
        exists = np.asarray((self._directory / str(step) / MANIFEST).exists())
        if jax.process_count() == 1:
            return bool(exists)
        return bool(multihost_utils.broadcast_one_to_all(exists, is_source=jax.process_index() == 0))

    def _verify(self, step: int) -> str | None:
        """Why checkpoint ``step`` fails its manifest on some process, or None (no manifest: nothing to check)."""
        step_dir = self._directory / str(step)
        problem = verify_manifest(step_dir) if (step_dir / MANIFEST).exists() else None
        if _agree(problem is None):
            return None
        return problem or "fails its manifest on another process"

    def _set_aside(self, steps: list[int]) -> None:
        """Renames skipped checkpoints to ``<step>.unverified`` (kept for inspection), so the steps can be saved
        again."""
        if not steps:
            return
        if jax.process_index() == 0:
            for step in steps:
                (self._directory / str(step)).rename(self._directory / f"{step}.unverified")
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("tether_checkpoints_set_aside")
        self._manager.reload()

    def read_metadata(self, step: int | None = None) -> dict[str, Any]:
        """The metadata of checkpoint ``step`` (default: the latest), without reading any array."""
        self.wait_until_finished()
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

    def saved_at(self, step: int) -> str | None:
        """When checkpoint ``step`` was committed (its manifest's time, UTC, to the second), or None without one."""
        manifest = self._directory / str(step) / MANIFEST
        if not manifest.exists():
            return None
        moment = datetime.datetime.fromtimestamp(manifest.stat().mtime, datetime.UTC)
        return moment.strftime("%Y-%m-%d %H:%M:%S UTC")

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
        """Blocks until the save in flight (if any) is final, its manifest included, and old checkpoints are
        deleted."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for the save in flight and releases the manager's threads."""
        self.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def read_step(step_dir: str | epath.PathLike, select_state=None) -> tuple[dict[str, Any], Any]:
    """One checkpoint ``<directory>/<step>`` read on the host, without a `Checkpointer` (which would clean up and
    prune the directory): its metadata and, given ``select_state``, part of its state, as NumPy arrays.

    Read through an orbax ``CheckpointManager`` on ``<directory>``, as the checkpoint was written: a stand-alone
    read of the ``state`` or ``metadata`` folder looks for orbax's step bookkeeping in that folder and warns.

    Args:
      step_dir: the checkpoint's directory.
      select_state: called with the state's tree metadata, returns the subtree to read (a partial restore); None:
        no array is read.

    Returns:
      ``(metadata, state subtree or None)``.
    """
    step_dir = epath.Path(step_dir)
    if not step_dir.is_absolute():  # orbax wants absolute local paths
        step_dir = step_dir.resolve()
    # Every item's handler, although only these two are read: orbax's item_metadata describes every item of the
    # step, and warns (absl, twice) of one it has no handler for (a run's ``data``).
    handlers = {_STATE: ocp.PyTreeCheckpointHandler(), _METADATA: ocp.JsonCheckpointHandler(),
                _DATA: grain.checkpoint.CheckpointHandler()}
    with ocp.CheckpointManager(step_dir.parent, options=ocp.CheckpointManagerOptions(create=False),
                               item_handlers=handlers) as manager:
        items = {_METADATA: ocp.args.JsonRestore()}
        if select_state is not None:
            item = select_state(manager.item_metadata(int(step_dir.name))[_STATE])
            restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
            items[_STATE] = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
        restored = manager.restore(int(step_dir.name), args=ocp.args.Composite(**items))
    return dict(restored[_METADATA]), restored.get(_STATE) if select_state is not None else None
