"""Tether's learner: the RL loop as a library, the model, sharding, the jitted update, checkpoints and tasks.

    import learner

    with learner.Run(learner.load_config("configs/default.toml", ["loop.steps=20"])) as run:
        for record in run.steps():
            print(record.step, record.metrics["reward/mean"])

The layers, bottom-up (docs/architecture.md): `learner.model`, `learner.logprobs`, `learner.update`,
`learner.checkpoints`, `learner.reporting`, then `learner.tasks` (the task plug-in point), `learner.serving` (the
reference server's model generator) and `learner.rl` (the loop's pieces and hooks); `learner.train` and
`learner.export` are the command lines.
"""

import importlib
from typing import TYPE_CHECKING, Any

# Public name -> the module that defines it, imported on first use: `import learner.model` loads neither the RL loop
# nor gRPC.
_LAZY = {
    "CheckpointConfig": "learner.checkpoints.checkpointer",
    "Checkpointer": "learner.checkpoints.checkpointer",
    "Hook": "learner.rl",
    "ModelConfig": "learner.model.transformer",
    "OptimizerConfig": "learner.update.optimizer",
    "Run": "learner.rl",
    "RunConfig": "learner.rl",
    "RunView": "learner.rl",
    "StepRecord": "learner.rl",
    "Task": "learner.tasks",
    "TrainBatch": "learner.update.batch",
    "TrainState": "learner.update.train_state",
    "Transformer": "learner.model.transformer",
    "UpdateConfig": "learner.update.step",
    "create_sharded_train_state": "learner.update.train_state",
    "load_config": "learner.rl",
    "load_task": "learner.tasks",
    "make_mesh": "learner.model.sharding",
    "make_optimizer": "learner.update.optimizer",
    "make_update_fn": "learner.update.step",
    "model_config": "learner.model.transformer",
    "register_task": "learner.tasks",
}

__all__ = sorted(_LAZY)

if TYPE_CHECKING:  # the same names for type checkers, which do not run __getattr__ (a test keeps it equal to _LAZY)
    from learner.checkpoints.checkpointer import CheckpointConfig as CheckpointConfig
    from learner.checkpoints.checkpointer import Checkpointer as Checkpointer
    from learner.model.sharding import make_mesh as make_mesh
    from learner.model.transformer import ModelConfig as ModelConfig
    from learner.model.transformer import Transformer as Transformer
    from learner.model.transformer import model_config as model_config
    from learner.rl import Hook as Hook
    from learner.rl import Run as Run
    from learner.rl import RunConfig as RunConfig
    from learner.rl import RunView as RunView
    from learner.rl import StepRecord as StepRecord
    from learner.rl import load_config as load_config
    from learner.tasks import Task as Task
    from learner.tasks import load_task as load_task
    from learner.tasks import register_task as register_task
    from learner.update.batch import TrainBatch as TrainBatch
    from learner.update.optimizer import OptimizerConfig as OptimizerConfig
    from learner.update.optimizer import make_optimizer as make_optimizer
    from learner.update.step import UpdateConfig as UpdateConfig
    from learner.update.step import make_update_fn as make_update_fn
    from learner.update.train_state import TrainState as TrainState
    from learner.update.train_state import create_sharded_train_state as create_sharded_train_state


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'learner' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
