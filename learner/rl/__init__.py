"""The RL loop as a library: a `Run` with steps and hooks, over plug-in engines and tasks.

    from learner.rl import Run, load_config

    with Run(load_config("configs/default.toml", ["loop.steps=20"])) as run:
        for record in run.steps():
            print(record.step, record.metrics["reward/mean"])

``python -m learner.train`` is the same loop from the command line.
"""

from learner.rl.batch_assembly import NoUsableRolloutsError
from learner.rl.batch_assembly import Payload
from learner.rl.batch_assembly import PayloadSpec
from learner.rl.batch_assembly import assemble_payload
from learner.rl.batch_assembly import demonstration_batch
from learner.rl.canary import CanaryMismatchError
from learner.rl.config import RunConfig
from learner.rl.config import load_config
from learner.rl.config import to_dict
from learner.rl.hooks import AgreementHook
from learner.rl.hooks import CheckpointHook
from learner.rl.hooks import EvalHook
from learner.rl.hooks import EvaluationError
from learner.rl.hooks import Hook
from learner.rl.hooks import MetricsHook
from learner.rl.hooks import PlotHook
from learner.rl.hooks import ProgressHook
from learner.rl.hooks import RolloutLogHook
from learner.rl.hooks import RunView
from learner.rl.hooks import StepRecord
from learner.rl.hooks import SummaryHook
from learner.rl.hooks import default_hooks
from learner.rl.preflight import ConfigError
from learner.rl.run import NonFiniteUpdateError
from learner.rl.run import ResumeConfigError
from learner.rl.run import Run
from learner.rl.run_lock import RunDirLockedError
from learner.rl.trainer import Trainer

__all__ = [
    "AgreementHook",
    "CanaryMismatchError",
    "CheckpointHook",
    "ConfigError",
    "EvalHook",
    "EvaluationError",
    "Hook",
    "MetricsHook",
    "NoUsableRolloutsError",
    "NonFiniteUpdateError",
    "Payload",
    "PayloadSpec",
    "PlotHook",
    "ProgressHook",
    "ResumeConfigError",
    "RolloutLogHook",
    "Run",
    "RunConfig",
    "RunDirLockedError",
    "RunView",
    "StepRecord",
    "SummaryHook",
    "Trainer",
    "assemble_payload",
    "default_hooks",
    "demonstration_batch",
    "load_config",
    "to_dict",
]
