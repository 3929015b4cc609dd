"""Checkpoints and weights on disk: orbax train-state checkpoints, safetensors, Hugging Face checkpoints, PEFT export.

`learner.checkpoints` re-exports `learner.checkpoints.checkpointer`; `safetensors_io`, `hf_checkpoint`,
`peft_export` and `reading` (a run's checkpoints read back: `choose_checkpoint`, `checkpoint_policy`) are imported by
name.
"""

from learner.checkpoints.checkpointer import CheckpointConfig
from learner.checkpoints.checkpointer import Checkpointer
from learner.checkpoints.checkpointer import MANIFEST
from learner.checkpoints.checkpointer import Restored
from learner.checkpoints.checkpointer import read_step
from learner.checkpoints.checkpointer import restore_target
from learner.checkpoints.checkpointer import verify_manifest
from learner.checkpoints.checkpointer import write_manifest

__all__ = [
    "CheckpointConfig",
    "Checkpointer",
    "MANIFEST",
    "Restored",
    "read_step",
    "restore_target",
    "verify_manifest",
    "write_manifest",
]
