"""Tether's learner: the RL loop as a library, the model, sharding, the jitted update, checkpoints and tasks.

    import learner

    with learner.Run(learner.load_config("configs/default.toml", ["loop.steps=20"])) as run:
        for record in run.steps():
            print(record.step, record.metrics["reward/mean"])

Submodules hold the rest: `learner.rl` (the loop's pieces and hooks), `learner.tasks` (the task plug-in point),
`learner.serving` (the reference server's model engine), `learner.logprobs`, `learner.sharding`,
`learner.safetensors_io`, ...
"""

from learner.batch import TrainBatch
from learner.checkpoints import CheckpointConfig
from learner.checkpoints import Checkpointer
from learner.model import ModelConfig
from learner.model import Transformer
from learner.model import model_config
from learner.optimizer import OptimizerConfig
from learner.optimizer import make_optimizer
from learner.rl import Hook
from learner.rl import Run
from learner.rl import RunConfig
from learner.rl import StepRecord
from learner.rl import load_config
from learner.sharding import make_mesh
from learner.tasks import Task
from learner.tasks import load_task
from learner.tasks import register_task
from learner.train_state import TrainState
from learner.train_state import create_sharded_train_state
from learner.update import UpdateConfig
from learner.update import make_update_fn

__all__ = [
    "CheckpointConfig",
    "Checkpointer",
    "Hook",
    "ModelConfig",
    "OptimizerConfig",
    "Run",
    "RunConfig",
    "StepRecord",
    "Task",
    "TrainBatch",
    "TrainState",
    "Transformer",
    "UpdateConfig",
    "create_sharded_train_state",
    "load_config",
    "load_task",
    "make_mesh",
    "make_optimizer",
    "make_update_fn",
    "model_config",
    "register_task",
]
