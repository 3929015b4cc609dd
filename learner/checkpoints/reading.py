"""Reads a run's checkpoints back on the host: which step to read, its policy parameters, its policy as a model.

`choose_checkpoint` picks a step whose manifest verifies, `read_checkpoint_params` restores its parameters alone (never
the optimizer state), `checkpoint_policy` builds the `Transformer` that holds them. `learner.export` and the tools of
`learner.tools` read checkpoints through these.
"""

from __future__ import annotations

import pathlib
import warnings

import numpy as np
from etils import epath
from flax import nnx

from learner.checkpoints.checkpointer import MANIFEST, read_step, verify_manifest
from learner.checkpoints.hf_checkpoint import model_config_from_checkpoint
from learner.model.param_paths import named_leaves, update_named
from learner.model.transformer import Transformer, model_config

__all__ = ["checkpoint_policy", "choose_checkpoint", "read_checkpoint_params"]


def _step_dirs(checkpoints: pathlib.Path) -> dict[int, pathlib.Path]:
    if not checkpoints.is_dir():
        raise FileNotFoundError(f"no checkpoints directory {checkpoints}: is this a run directory?")
    return {int(path.name): path for path in checkpoints.iterdir() if path.is_dir() and path.name.isdigit()}


def choose_checkpoint(checkpoints: pathlib.Path, step: int | None) -> pathlib.Path:
    """Checkpoint ``step`` (verified if it has a manifest), or the newest one whose manifest verifies."""
    steps = _step_dirs(checkpoints)
    if step is not None:
        if step not in steps:
            raise FileNotFoundError(f"no checkpoint {step} in {checkpoints} (have {sorted(steps)})")
        if (steps[step] / MANIFEST).exists() and (problem := verify_manifest(epath.Path(steps[step]))):
            raise ValueError(f"checkpoint {step} fails its manifest: {problem}")
        return steps[step]
    for candidate in sorted(steps, reverse=True):
        if not (steps[candidate] / MANIFEST).exists():
            warnings.warn(f"skipping checkpoint {candidate}: no manifest (saved before manifests existed, or it "
                          "was deleted); pass --step to export it anyway", stacklevel=2)
        elif problem := verify_manifest(epath.Path(steps[candidate])):
            warnings.warn(f"skipping checkpoint {candidate}: {problem}", stacklevel=2)
        else:
            return steps[candidate]
    raise ValueError(f"no checkpoint in {checkpoints} has a manifest that verifies (have {sorted(steps)})")


def read_checkpoint_params(step_dir: str | pathlib.Path) -> dict[str, np.ndarray]:
    """The policy parameters of one learner checkpoint, ``{parameter path: array}``, read on the host.

    Only the parameters are read (a partial orbax restore), whether the state is a ``TrainState`` or
    ``{"train": TrainState, "reference": params}`` (runs with a KL reference).
    """
    def params_only(metadata):
        if "train" in metadata:
            return {"train": {"params": metadata["train"]["params"]}}
        return {"params": metadata["params"]}

    tree = read_step(step_dir, params_only)[1]
    tree = tree.get("train", tree)
    return {name: np.asarray(array) for name, array in named_leaves(tree["params"]).items()}


def checkpoint_policy(step_dir: str | pathlib.Path) -> tuple[Transformer, dict]:
    """One checkpoint's policy as a `Transformer` holding its parameters, and the run's config from its metadata.

    The model is ``model.hf_path``'s architecture or the named ``model.name``, in the checkpoint's parameter dtype.

    Raises:
        ValueError: a LoRA run (its checkpoints hold the adapters alone; export it ``--merged`` and load that).
    """
    config = read_step(step_dir)[0].get("config") or {}
    model = config.get("model") or {}
    if (model.get("lora") or {}).get("rank", 0) > 0:
        raise ValueError(f"{step_dir}: a LoRA run's checkpoint holds its adapters, not the policy; export it with "
                         "`python -m learner.export RUN OUT --merged` and load OUT")
    architecture = (model_config_from_checkpoint(model["hf_path"]) if model.get("hf_path")
                    else model_config(model.get("name", "tiny")))
    policy = nnx.eval_shape(lambda: Transformer(architecture, rngs=nnx.Rngs(0)))
    update_named(policy, read_checkpoint_params(step_dir))
    return policy, config
