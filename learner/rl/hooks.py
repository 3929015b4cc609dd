"""Side effects of a run, as hooks around `Run.steps`: metrics, rollout log, progress, plot, checkpoints, summary.

A hook sees the run start (`Hook.on_start`), every step's `StepRecord` (`Hook.on_step`, after the update and the
publish, before the record is yielded), the end of a run that reached ``loop.steps`` (`Hook.on_end`), and is
closed on every exit path, an exception included (`Hook.close`). Hooks run in list order; `default_hooks` gives
the order the CLI uses::

    MetricsHook -> RolloutLogHook -> ProgressHook -> PlotHook -> CheckpointHook -> AgreementHook -> SummaryHook

so everything a step writes is on disk before its checkpoint starts. Writers run on process 0 only
(``leader_only``); checkpoints and the agreement record run on every process.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import TYPE_CHECKING

import numpy as np

from learner.metrics_writers import FanOutWriter, JsonlWriter, TensorBoardWriter
from learner.plots import plot_learning_curves
from learner.progress import ProgressBar, summary_table
from learner.rollout_log import LoggedBatch, RolloutLogWriter

if TYPE_CHECKING:
    from learner.rl.run import Run, StepRecord

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "learning_curves.png"


class Hook:
    """Does nothing; subclasses override what they need."""

    leader_only = True  # run on process 0 only; False: on every process (collective work such as checkpoints)

    def on_start(self, run: Run) -> None:
        """The run is set up: state restored or warmed up, weights published, rollouts requested."""

    def on_step(self, run: Run, record: StepRecord) -> None:
        """One RL step is done (trained and published)."""

    def on_end(self, run: Run) -> None:
        """The run reached ``loop.steps``."""

    def close(self) -> None:
        """Releases files and threads; called on every exit path."""


class MetricsHook(Hook):
    """Every step's metrics to ``metrics.jsonl`` and TensorBoard (a resumed run drops the steps after its
    checkpoint)."""

    def on_start(self, run: Run) -> None:
        self.writer = FanOutWriter([JsonlWriter(run.run_dir / METRICS_FILE, resume_step=run.start_step),
                                    TensorBoardWriter(run.run_dir / "tensorboard")])

    def on_step(self, run: Run, record: StepRecord) -> None:
        self.writer.write(record.step, record.metrics)

    def close(self) -> None:
        if hasattr(self, "writer"):
            self.writer.close()


class RolloutLogHook(Hook):
    """Every trained batch to the tensorstore rollout log (``rollout_log/``)."""

    def on_start(self, run: Run) -> None:
        self.log = RolloutLogWriter(run.run_dir / "rollout_log", max_length=run.trainer.length,
                                    resume_step=run.start_step)

    def on_step(self, run: Run, record: StepRecord) -> None:
        rows = slice(0, record.samples)
        batch = record.batch
        self.log.append(LoggedBatch(step=record.step, tokens=batch.tokens[rows], loss_mask=batch.loss_mask[rows],
                                    rollout_logprobs=batch.rollout_logprobs[rows],
                                    proximal_logprobs=record.proximal_logprobs, rewards=record.rewards,
                                    advantages=batch.advantages[rows], policy_version=batch.policy_version[rows]))

    def close(self) -> None:
        if hasattr(self, "log"):
            self.log.close()


class ProgressHook(Hook):
    """The progress bar (reward, KL, mismatch, clip fraction, staleness, tokens/s)."""

    def on_start(self, run: Run) -> None:
        self.bar = ProgressBar(run.config.loop.steps, start=run.start_step)

    def on_step(self, run: Run, record: StepRecord) -> None:
        self.bar.update(record.step, record.metrics)

    def on_end(self, run: Run) -> None:
        self.close()  # before the summary table

    def close(self) -> None:
        if hasattr(self, "bar"):
            self.bar.close()
            del self.bar


class PlotHook(Hook):
    """The learning-curve PNG, every ``every`` steps and at the end."""

    def __init__(self, every: int):
        self.every = every

    def on_step(self, run: Run, record: StepRecord) -> None:
        if record.step % self.every == 0:
            plot_learning_curves(run.run_dir / METRICS_FILE, run.run_dir / PLOT_FILE)

    def on_end(self, run: Run) -> None:
        plot_learning_curves(run.run_dir / METRICS_FILE, run.run_dir / PLOT_FILE)


class CheckpointHook(Hook):
    """A checkpoint after the start of a fresh run (step 0), every ``every`` steps and at the last step.

    Saves are asynchronous; the run's checkpointer completes the one in flight on every exit path.
    """

    leader_only = False

    def __init__(self, every: int):
        self.every = every

    def on_start(self, run: Run) -> None:
        if run.start_step == 0:
            run.save_checkpoint(0)

    def on_step(self, run: Run, record: StepRecord) -> None:
        if record.step % self.every == 0 or record.step == run.config.loop.steps:
            run.save_checkpoint(record.step)


class AgreementHook(Hook):
    """``process_<i>.json`` at the end: steps, reward per step and a digest of the batches this process trained on,
    so that the processes of a multi-host run can be checked for agreement."""

    leader_only = False

    def on_start(self, run: Run) -> None:
        self.steps, self.rewards, self.digest = [], [], hashlib.sha256()

    def on_step(self, run: Run, record: StepRecord) -> None:
        self.steps.append(record.step)
        self.rewards.append(float(np.mean(record.rewards)))
        self.digest.update(np.ascontiguousarray(record.batch.tokens).tobytes())

    def on_end(self, run: Run) -> None:
        record = {"steps": self.steps, "reward_mean": self.rewards, "batch_sha256": self.digest.hexdigest(),
                  "policy_version": run.trainer.policy_version}
        (run.run_dir / f"process_{run.process_index}.json").write_text(json.dumps(record))


class SummaryHook(Hook):
    """A summary table on stdout at the end (reward first 3 -> last 5 steps, KL, versions, speed)."""

    def on_start(self, run: Run) -> None:
        self.started, self.history = time.monotonic(), {}

    def on_step(self, run: Run, record: StepRecord) -> None:
        self.history[record.step] = record.metrics

    def on_end(self, run: Run) -> None:
        if not self.history:
            return
        config, steps = run.config, sorted(self.history)
        rewards = [self.history[s]["reward/mean"] for s in steps]
        last = self.history[steps[-1]]
        rows = [
            ("task", config.task.name),
            ("corrections", config.corrections.preset),
            ("steps", f"{steps[0]}-{steps[-1]} of {config.loop.steps}"),
            ("reward (first 3 -> last 5 steps)", f"{np.mean(rewards[:3]):.3f} -> {np.mean(rewards[-5:]):.3f}"),
            ("train/rollout kl (last step)", f"{last.get('rollout_corr/kl', float('nan')):+.2e}"),
            ("clip fraction (last step)", f"{last.get('actor/pg_clipfrac', float('nan')):.3f}"),
            ("policy version learner / server",
             f"{last['policy/learner_version']:.0f} / {last['policy/server_version']:.0f}"),
            ("wall time", f"{time.monotonic() - self.started:.0f} s"),
            ("steps/s (RL loop)", f"{len(steps) / sum(self.history[s]['perf/step_s'] for s in steps):.2f}"),
            ("samples/s (RL loop)", f"{np.mean([self.history[s]['perf/samples_per_s'] for s in steps]):.1f}"),
            ("run directory", str(config.run_dir)),
        ]
        print(summary_table(rows), flush=True)


def default_hooks(config) -> list[Hook]:
    """The CLI's hooks, in order (see the module docstring)."""
    return [MetricsHook(), RolloutLogHook(), ProgressHook(), PlotHook(config.loop.plot_every),
            CheckpointHook(config.checkpoints.every), AgreementHook(), SummaryHook()]
