"""Side effects of a run, as hooks around `Run.steps`: evaluation, metrics, rollout log, progress, plot, checkpoints,
summary.

A hook sees the run start (`Hook.on_start`), every step's `StepRecord` (`Hook.on_step`, after the update and the
publish, before the record is yielded), the end of a run that reached ``loop.steps`` (`Hook.on_end`), and is
closed on every exit path, an exception included (`Hook.close`). Each call gets a `RunView`, not the run: what a
hook may read of the run (settings, directory, task, engine, start) and a callable that saves a checkpoint, so that
hooks depend on nothing else of `learner.rl.run`. Hooks run in list order; `default_hooks` gives the order the CLI
uses::

    EvalHook -> MetricsHook -> RolloutLogHook -> ProgressHook -> PlotHook -> CheckpointHook -> AgreementHook
    -> SummaryHook

so an evaluation's metrics are written with its step, and everything a step writes is on disk before its checkpoint
starts. Writers run on process 0 only
(``leader_only``); checkpoints and the agreement record run on every process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import threading
import time
from collections.abc import Callable

import grpc
import numpy as np

from learner.reporting.metrics_writers import FanOutWriter, JsonlWriter, TensorBoardWriter
from learner.reporting.plots import DEFAULT_PANELS, plot_learning_curves
from learner.reporting.progress import ProgressBar, StartupTimes, summary_table
from learner.reporting.rollout_log import LoggedBatch, RolloutLogWriter
from learner.reporting.run_files import write_atomically
from learner.rl import framework_config
from learner.rl.config import RunConfig, sampling_params
from learner.tasks import Task
from learner.update.batch import TrainBatch
from rollout_client import Engine, EnginesDownError, LogprobMode, RolloutError, RolloutRequest, SamplingParams
from rollout_client.engines.pool import describe_error
from rollout_client.sampling_params import derived_seed

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "learning_curves.png"


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What one RL step did. Rows of ``batch`` past ``samples`` are padding."""

    step: int
    metrics: dict[str, float]  # the update's metrics; on process 0 also reward, rollout, policy, perf and client
    batch: TrainBatch  # the host batch trained on, [rows, length]
    samples: int  # real rows of the batch
    rewards: np.ndarray  # float32 [samples]
    proximal_logprobs: np.ndarray  # float32 [samples, length]: the pre-update policy's logprobs of the batch (0
    # outside each row's scored window, prompt tokens included, when update.scored_window is set)
    policy_version: int  # the learner's, after the update
    server_version: int | None  # the engine's, after the publish (process 0; None elsewhere)


@dataclasses.dataclass(frozen=True)
class RunView:
    """What a hook sees of its run, built by `learner.rl.Run` once it is set up (levanter hands its callbacks a
    ``StepInfo`` likewise): fixed for the run; what changes per step is in the `StepRecord`."""

    config: RunConfig
    run_dir: pathlib.Path  # absolute
    process_index: int
    task: Task  # the run's task (`learner.tasks.load_task`)
    engine: Engine | None  # what the run samples with (`submit`: the pool's resends, the client's retries); process
    # 0 only, None elsewhere
    start_step: int  # the step restored from (0: a fresh start)
    resumed: bool  # started from a checkpoint (a run resumed from step 0 has that step's checkpoint already)
    max_new_tokens: int  # a completion's token limit
    length: int  # the longest row trained, in tokens (prompt and completion)
    startup_times: StartupTimes  # where the start-up went (its line is complete once the first step is done)
    save_checkpoint: Callable[[int], None]  # starts saving the run's state as checkpoint ``step`` (asynchronous;
    # every process must call it: collective)


class Hook:
    """Does nothing; subclasses override what they need."""

    leader_only = True  # run on process 0 only; False: on every process (collective work such as checkpoints)

    def on_start(self, run: RunView) -> None:
        """The run is set up: state restored or warmed up, weights published, rollouts requested."""

    def on_step(self, run: RunView, record: StepRecord) -> None:
        """One RL step is done (trained and published)."""

    def on_end(self, run: RunView) -> None:
        """The run reached ``loop.steps``."""

    def close(self) -> None:
        """Releases files and threads; called on every exit path."""


class EvaluationError(RuntimeError):
    """An evaluation's requests failed after the client's retries and the engine pool's resends; the message names
    the step and the first failure."""


class EvalHook(Hook):
    """Evaluates the task's validation prompts every ``validation_every`` steps and at the last step, with the weights
    just published: ``eval/greedy/pass@1`` (one greedy completion per prompt: top-k 1) and, from
    ``rollout.num_samples`` completions sampled as in training, ``eval/reward_mean``, ``eval/pass@1``,
    ``eval/pass@k`` and per-reward means (the task's `validation_metrics`).

    Active for tasks with ``validation_records``, ``validation_metrics`` and ``validation_every`` (the ``dataset``
    task with ``validation``); does nothing for others. A sample the client dropped counts as a wrong (empty)
    completion, and ``eval/dropped_samples`` counts them. The metrics join the step's record, so the metrics hook
    writes them and the plot shows them.
    """

    def on_start(self, run: RunView) -> None:
        task = run.task
        self.every = getattr(task, "validation_every", None)
        if not (self.every and hasattr(task, "validation_metrics") and len(task.validation_records())):
            self.every = None
            return
        sampling = sampling_params(run.config, run.max_new_tokens, task.tokenizer.eos_ids)
        self.modes = {"eval": (sampling, run.config.rollout.num_samples),
                      "eval/greedy": (dataclasses.replace(sampling, temperature=1.0, top_k=1, top_p=1.0, min_p=0.0),
                                      1)}
        self.logprob_mode = LogprobMode[run.config.rollout.logprob_mode.upper()]
        # loop.deterministic: each request seeded by (loop.seed, step, prompt, mode), apart from training's seeds
        self.seed = run.config.loop.seed if run.config.loop.deterministic else None

    def on_step(self, run: RunView, record: StepRecord) -> None:
        if self.every and (record.step % self.every == 0 or record.step == run.config.loop.steps):
            try:
                record.metrics.update(self.evaluate(run, record.step))
            except EnginesDownError:
                raise  # its own line names the engine's log
            except (RolloutError, grpc.RpcError) as error:
                raise EvaluationError(f"step {record.step}: evaluation failed: {describe_error(error)} (retried "
                                      "as training requests are; see server.generate_deadline_s and "
                                      "task.args.validation.max_prompts)") from error

    def evaluate(self, run: RunView, step: int) -> dict[str, float]:
        """Samples every validation prompt in each mode after ``step`` (all requests in flight at once, through the
        run's engine: the client's retries and the pool's resends, as training requests) and scores them."""
        records = run.task.validation_records()
        futures = {prefix: [run.engine.submit(RolloutRequest(np.asarray(r["prompt_ids"], np.int32),
                                                             self._seeded(sampling, step, index, mode),
                                                             num_samples=n, logprob_mode=self.logprob_mode))
                            for index, r in enumerate(records)]
                   for mode, (prefix, (sampling, n)) in enumerate(self.modes.items())}
        metrics, dropped = {}, 0
        for prefix, pending in futures.items():
            n = self.modes[prefix][1]
            completions = []
            for future in pending:
                by_index = {sample.sample_index: sample.completion_token_ids for sample in future.result()}
                dropped += n - len(by_index)
                completions += [by_index.get(i, np.zeros(0, np.int32)) for i in range(n)]
            metrics |= run.task.validation_metrics(records, completions, n, prefix=prefix)
        return metrics | {"eval/dropped_samples": float(dropped)}


    def _seeded(self, sampling: SamplingParams, step: int, index: int, mode: int) -> SamplingParams:
        """``sampling`` with the seed of prompt ``index`` in mode ``mode`` at ``step`` (unchanged if unseeded)."""
        if self.seed is None:
            return sampling
        return dataclasses.replace(sampling, seed=derived_seed(self.seed, step, index, mode))


class MetricsHook(Hook):
    """Every step's metrics to ``metrics.jsonl`` and TensorBoard (a resumed run drops the steps after its
    checkpoint)."""

    def on_start(self, run: RunView) -> None:
        self.writer = FanOutWriter([JsonlWriter(run.run_dir / METRICS_FILE, resume_step=run.start_step),
                                    TensorBoardWriter(run.run_dir / "tensorboard")])

    def on_step(self, run: RunView, record: StepRecord) -> None:
        self.writer.write(record.step, record.metrics)

    def close(self) -> None:
        if hasattr(self, "writer"):
            self.writer.close()


class RolloutLogHook(Hook):
    """Every trained batch to the tensorstore rollout log (``rollout_log/``)."""

    def on_start(self, run: RunView) -> None:
        self.log = RolloutLogWriter(run.run_dir / "rollout_log", max_length=run.length,
                                    resume_step=run.start_step)

    def on_step(self, run: RunView, record: StepRecord) -> None:
        rows = slice(0, record.samples)
        batch = record.batch
        self.log.append(LoggedBatch(step=record.step, tokens=batch.tokens[rows], loss_mask=batch.loss_mask[rows],
                                    rollout_logprobs=batch.rollout_logprobs[rows],
                                    proximal_logprobs=record.proximal_logprobs, rewards=record.rewards,
                                    advantages=batch.advantages[rows], policy_version=batch.policy_version[rows],
                                    learner_version=record.policy_version - 1))  # before this step's update

    def close(self) -> None:
        if hasattr(self, "log"):
            self.log.close()


class ProgressHook(Hook):
    """The progress bar (reward, KL, mismatch, clip fraction, staleness, multi-turn use, tokens/s), updated every
    step, and after the first step the line saying where the start-up time went."""

    def on_start(self, run: RunView) -> None:
        self.bar = ProgressBar(run.config.loop.steps)

    def on_step(self, run: RunView, record: StepRecord) -> None:
        if record.step == run.start_step + 1:
            print(run.startup_times.line(), flush=True)
        self.bar.update(record.step, record.metrics)

    def on_end(self, run: RunView) -> None:
        self.close()  # before the summary table

    def close(self) -> None:
        if hasattr(self, "bar"):
            self.bar.close()
            del self.bar


class PlotHook(Hook):
    """The learning-curve PNG, every ``every`` steps and at the end (with a validation panel when evaluated).

    A refresh is drawn on a thread, so the loop does not wait for it (on the 2-core CPU under load one took ~12 s,
    37% of the main job's time); a refresh due while the last one still draws is skipped. The end's is waited for.
    """

    def __init__(self, every: int, num_samples: int):
        self.every = every
        self.panels = DEFAULT_PANELS + (
            ("validation", ("eval/reward_mean", "eval/greedy/pass@1", "eval/pass@1", f"eval/pass@{num_samples}")),)
        self._drawing: threading.Thread | None = None

    def on_step(self, run: RunView, record: StepRecord) -> None:
        if record.step % self.every == 0 and not (self._drawing and self._drawing.is_alive()):
            self._drawing = threading.Thread(target=self._draw, args=(run.run_dir,), name="plot", daemon=True)
            self._drawing.start()

    def on_end(self, run: RunView) -> None:
        self.close()
        self._draw(run.run_dir)

    def close(self) -> None:
        if self._drawing is not None:
            self._drawing.join()

    def _draw(self, run_dir) -> None:
        plot_learning_curves(run_dir / METRICS_FILE, run_dir / PLOT_FILE, self.panels)


class CheckpointHook(Hook):
    """A checkpoint after the start of a fresh run (step 0), every ``every`` steps and at the last step.

    Saves are asynchronous; the run's checkpointer completes the one in flight on every exit path. A run resumed
    from step 0 (killed before its first periodic checkpoint) has step 0 already and does not save it again.
    """

    leader_only = False

    def __init__(self, every: int):
        self.every = every

    def on_start(self, run: RunView) -> None:
        if not run.resumed:
            run.save_checkpoint(0)

    def on_step(self, run: RunView, record: StepRecord) -> None:
        if record.step % self.every == 0 or record.step == run.config.loop.steps:
            run.save_checkpoint(record.step)


class AgreementHook(Hook):
    """``process_<i>.json`` at the end: steps, reward per step and a digest of the batches this process trained on,
    so that the processes of a multi-host run can be checked for agreement."""

    leader_only = False

    def on_start(self, run: RunView) -> None:
        self.steps, self.rewards, self.digest = [], [], hashlib.sha256()
        self.policy_version: int | None = None

    def on_step(self, run: RunView, record: StepRecord) -> None:
        self.steps.append(record.step)
        self.policy_version = record.policy_version
        self.rewards.append(float(np.mean(record.rewards)))
        self.digest.update(np.ascontiguousarray(record.batch.tokens).tobytes())

    def on_end(self, run: RunView) -> None:
        record = {"steps": self.steps, "reward_mean": self.rewards, "batch_sha256": self.digest.hexdigest(),
                  "policy_version": self.policy_version}
        write_atomically(run.run_dir / f"process_{run.process_index}.json", json.dumps(record))


class SummaryHook(Hook):
    """A summary table on stdout at the end: reward (mean of the first 20 -> the last 20 steps, as the README
    measures it), the share of samples trained on, KL, versions, speed, and the last evaluation's metrics."""

    def on_start(self, run: RunView) -> None:
        self.started, self.history = run.startup_times.started, {}  # the run's creation: start-up included

    def on_step(self, run: RunView, record: StepRecord) -> None:
        self.history[record.step] = record.metrics

    def on_end(self, run: RunView) -> None:
        if not self.history:
            return
        config, steps = run.config, sorted(self.history)
        rewards = [self.history[s]["reward/mean"] for s in steps]
        ends = min(20, max(len(steps) // 2, 1))  # 20 steps at each end; fewer in a short run, never overlapping
        kept = [self.history[s].get("rollout/kept_fraction", 1.0) for s in steps]
        last = self.history[steps[-1]]
        evaluated = [s for s in steps if any(key.startswith("eval/") for key in self.history[s])]
        rows = [
            ("task", config.task.name),
            ("corrections", framework_config.corrections_name(config.corrections)),
            ("steps", f"{steps[0]}-{steps[-1]} of {config.loop.steps}"),
            (f"reward (first {ends} -> last {ends} steps)" if ends > 1 else "reward (first step -> last step)",
             f"{np.mean(rewards[:ends]):.3f} -> {np.mean(rewards[-ends:]):.3f}"),
            ("samples trained on (mean, min share)", f"{np.mean(kept):.2f}, {np.min(kept):.2f}"),
            ("train/rollout kl k3 (last step)", f"{last.get('rollout_corr/k3_kl', float('nan')):.2e}"),
            ("clip fraction (last step)", f"{last.get('actor/pg_clipfrac', float('nan')):.3f}"),
            ("policy version learner / server",
             f"{last['policy/learner_version']:.0f} / {last['policy/server_version']:.0f}"),
            ("wall time (start-up included)", f"{time.monotonic() - self.started:.0f} s"),
            ("steps/s (RL loop)", f"{len(steps) / sum(self.history[s]['perf/step_s'] for s in steps):.2f}"),
            ("samples/s (RL loop)", f"{np.mean([self.history[s]['perf/samples_per_s'] for s in steps]):.1f}"),
            ("run directory", str(config.run_dir)),
        ]
        if evaluated:  # the last evaluation; its fault counters (dropped, skipped samples) only where not 0
            rows += [(f"{key} (step {evaluated[-1]})", f"{value:.3f}")
                     for key, value in sorted(self.history[evaluated[-1]].items())
                     if key.startswith("eval/") and (value or not key.endswith("_samples"))]
        print(summary_table(rows), flush=True)


def default_hooks(config) -> list[Hook]:
    """The CLI's hooks, in order (see the module docstring)."""
    return [EvalHook(), MetricsHook(), RolloutLogHook(), ProgressHook(),
            PlotHook(config.loop.plot_every, config.rollout.num_samples),
            CheckpointHook(config.checkpoints.every), AgreementHook(), SummaryHook()]
