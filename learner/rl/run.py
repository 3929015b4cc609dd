"""`Run`: one RL training run as an object, driven step by step.

    with Run(load_config("configs/default.toml")) as run:
        for record in run.steps():
            print(record.step, record.metrics["reward/mean"])

Entering a run sets it up: the run directory's lock (`learner.rl.run_lock`: one run per directory, held by process
0), the task, the mesh and the sharded train state, then either the latest checkpoint of ``run_dir`` (state,
reference policy, policy version, data position) or a fresh start (Hugging Face weights if configured, the
supervised warm-up); then, on process 0, the inference engine (launched, or reached at ``server.address``), the
weights published to it, and the rollout buffer that keeps ``prompts_per_step * max(max_staleness, 1)`` requests in
flight, as the run's `learner.rl.config.PublishPolicy` says (``max_staleness = 0``: synchronous;
``fixed_staleness``: the in-flight rollouts finish before each publish, so every sample is exactly ``max_staleness``
versions old; ``loop.deterministic``: the same, with every request seeded and the embedded server batch-invariant,
so that a rerun's metrics are equal: docs/library.md). A publish waits for the requests the engine is generating
(one policy version per sample) unless ``rollout.partial``: then they run on under the new weights, each token
stamped with the version that drew it (partial rollouts; ``rollout/partial_fraction``). Everything it opens is
closed on every exit path, in reverse order, by one ``ExitStack``; the checkpoint save in flight is completed.

`Run.steps` yields one `StepRecord` per RL step: take one batch of groups, score them with the task's reward,
compute GRPO advantages per group, train with ONE jitted update call under the configured corrections, publish the
new weights, and call the hooks (`learner.rl.hooks`: metrics, rollout log, progress, plot, checkpoints). Payloads have
one fixed shape (`learner.rl.batch_assembly.PayloadSpec`); each batch is cut to the shortest of a few lengths that holds
its longest row (`Trainer.fit`), every one compiled at start, so no step compiles.

Resume: entering a run whose ``run_dir`` has checkpoints restores the latest; metrics and rollout log drop the steps
after it. The saved data position is that of the first batch not yet trained, so the prompt order is that of an
uninterrupted run. A resume that changes the task, corrections, group size or model is refused (naming the keys)
unless ``loop.allow_config_change`` (checked against the checkpoint's metadata before any array is read); a run
that already reached ``loop.steps`` is `finished`, says so, and yields nothing. A run killed before its first
periodic checkpoint resumes from step 0 (the fresh start's checkpoint). A resume says so: "resuming from step N
(checkpoint of <time>)".

Stop signals (one process): a first SIGINT or SIGTERM while the run is open raises `Interrupted` at the step reached
(during a step's update and hooks: once they are done), and leaving the ``with`` block on it saves a checkpoint of
that step, verified as a periodic one, before anything is closed; a second signal exits at once
(`learner.rl.stop_signals`).

Multi-host: every process makes the same calls. Process 0 owns the engine and the buffer and broadcasts each step's
payload; every process runs the same update on the global mesh and writes checkpoints; process 0 publishes.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import pathlib
import time
import warnings
from collections.abc import Callable, Iterator, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from learner.checkpoints.checkpointer import Checkpointer
from learner.model.lora import base_identity, check_base_identity
from learner.reporting.compiles import compile_stats, count_compiles
from learner.reporting.progress import WARMUP_FIELDS, ProgressBar, StartupTimes, Waiting
from learner.reporting.run_files import refuse_links
from learner.reporting.version_stats import version_metrics
from learner.rl import framework_config
from learner.rl.batch_assembly import NoUsableRolloutsError, Payload, PayloadSpec, assemble_payload
from learner.rl.canary import publish_canary
from learner.rl.config import (
    RunConfig,
    changed_keys,
    checkpoint_config,
    embedded_server,
    publish_policy,
    sampling_params,
    to_dict,
)
from learner.rl.episodes import EpisodeRunner, episode_metrics
from learner.rl.hooks import Hook, RunView, StepRecord, default_hooks
from learner.rl.preflight import ConfigError, check_lora, model_shape, probe_engines, probe_rewards
from learner.rl.prompt_stream import DataPosition, PromptStream
from learner.rl.rollout_engines import (
    build_engine_pool,
    check_identity,
    launches_vllm,
    publish_dtype,
    publishes_adapters,
    sampler_order,
)
from learner.rl.run_lock import LOCK_FILE, hold_run_dir
from learner.rl.stop_signals import Interrupted, StopSignals
from learner.rl.trainer import Trainer, model_context
from learner.tasks import Demonstrations, EnvironmentTask, load_task
from learner.update.logprob_mode import check_logprob_mode
from rollout_client import LogprobMode, RolloutBuffer

# What libraries and the engine process write under run_dir (orbax, tensorstore, the TensorBoard writer, the MLX
# engine's weights, the server's log), checked for links before the run starts: no link may lead out of run_dir.
CHECKED_FOR_LINKS = ("checkpoints", "rollout_log", "tensorboard", "engine_weights", "server.log")


SLOW_PHASE_S = 15.0  # a step's rollout wait or update longer than this is announced while it lasts


class ResumeConfigError(ValueError):
    """A resume would change what the checkpoint was trained for."""


class NonFiniteUpdateError(RuntimeError):
    """Updates were non-finite (skipped) for ``optimizer.max_consecutive_skips`` steps in a row, or a checkpoint
    was asked of a non-finite state: the run stops rather than train on, or save, garbage."""


class Run:
    """One training run (see the module docstring): a context manager whose `steps` drive the training.

    Args:
      config: the run.
      hooks: side effects, called in order with the run's `learner.rl.hooks.RunView`; None:
        `learner.rl.hooks.default_hooks`. Leader-only hooks run on process 0 alone.
    """

    def __init__(self, config: RunConfig, hooks: Sequence[Hook] | None = None):
        self.config = config
        self.publish = publish_policy(config)  # how rollouts and publishes interleave
        self.run_dir = pathlib.Path(config.run_dir).resolve()  # orbax needs an absolute checkpoint path
        self.process_index = jax.process_index()
        self.leader = self.process_index == 0
        hooks = default_hooks(config) if hooks is None else list(hooks)
        self.hooks = [hook for hook in hooks if self.leader or not hook.leader_only]
        self.engine = self.buffer = None
        self.canary_engine = None  # what the publish canary samples (the engine pool; learner.rl.canary)
        self.start_step = self.step = 0  # the step restored from (0: a fresh start), the last step done
        self._stack: contextlib.ExitStack | None = None
        self.startup_times = StartupTimes()  # where the start-up went, printed once the first step is done
        self._warned_kept = False  # a step kept under half its samples (warned once)
        self._drops = collections.Counter()  # groups dropped with fewer than 2 scored samples, over the run
        count_compiles()  # compile/* in every step's metrics
        # This process's programs built by the end of the set-up, in the first step's metrics beside
        # `startup_times`'s phases: startup/compiled_programs, startup/compile_s, startup/compile_cache_hits (loaded
        # from the persistent cache).
        self._startup_compiles: dict[str, float] = {}
        self._signals = StopSignals()  # SIGINT / SIGTERM: save the step reached, then stop

    @property
    def finished(self) -> bool:
        """The run reached ``loop.steps``: `steps` yields nothing."""
        return self.step >= self.config.loop.steps

    def __enter__(self) -> Run:
        created = not self.run_dir.exists()
        try:
            with contextlib.ExitStack() as stack:
                self._set_up(stack)
                self._stack = stack.pop_all()
        except BaseException:
            if created and self.leader:  # a run refused at its start leaves no directory holding only its lock
                lock = self.run_dir / LOCK_FILE
                if [path.name for path in self.run_dir.iterdir()] == [LOCK_FILE] and not lock.is_symlink():
                    lock.unlink()
                    self.run_dir.rmdir()
            raise
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        try:
            if isinstance(exc, Interrupted) and self._stack is not None:
                self._save_on_stop(exc)
        finally:
            self.close()

    def _save_on_stop(self, stop: Interrupted) -> None:
        """A stop signal's checkpoint: the step reached (the state is that step's: `StopSignals.hold`), saved unless
        it is the latest already, and committed with its manifest before the run closes."""
        if self.checkpointer.latest_step() != self.step:
            self.save_checkpoint(self.step)
        self.checkpointer.wait_until_finished()
        stop.saved_step = self.step

    def close(self) -> None:
        """Closes hooks, buffer, engine and checkpointer (completing a save in flight), in reverse order."""
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def _set_up(self, stack: contextlib.ExitStack) -> None:
        config = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if jax.process_count() == 1:  # several processes would each stop at another step: no agreed save
            stack.enter_context(self._signals.installed())
        if self.leader:
            stack.enter_context(hold_run_dir(self.run_dir))  # before anything reads or writes the directory
            refuse_links(self.run_dir, CHECKED_FOR_LINKS)
            framework_config.report(config.corrections, self.run_dir, config)
        try:
            self.task = load_task(config.task.name, config.task.args, model_path=config.model.hf_path,
                                  model_context=model_context(config))
        except ValueError as error:  # load_task's errors name the task.* key at fault
            raise ConfigError(str(error)) from None
        if self.leader:  # before the train state and the warm-up, which a bad reward or engine would waste
            probe_rewards(self.task)
            probe_engines(config)
        check_lora(config)
        if config.warmup.steps and not isinstance(self.task, Demonstrations):
            raise ValueError(f"warmup.steps={config.warmup.steps}: task {config.task.name!r} has no "
                             "make_prompt and noisy_demonstration for a warm-up; set warmup.steps = 0")
        self.episodic = isinstance(self.task, EnvironmentTask)  # multi-turn: `learner.rl.episodes`
        if self.episodic and config.rollout.max_new_tokens:
            raise ValueError(f"rollout.max_new_tokens={config.rollout.max_new_tokens}: task {config.task.name!r} "
                             "is multi-turn; its turns and episodes are bounded by its own limits (task.args "
                             "max_turn_tokens and the task's max_completion_tokens); unset rollout.max_new_tokens")
        with self.startup_times.phase("train state", Waiting("building the train state", enabled=self.leader)):
            self.trainer = Trainer(config, self.task)
        if self.leader:
            print(self.trainer.describe_state(), flush=True)
        self.checkpointer = Checkpointer(checkpoint_config(config, str(self.run_dir / "checkpoints")))
        stack.callback(self.checkpointer.close)  # waits for the save in flight: completed, never abandoned
        stop_ids = self.task.tokenizer.eos_ids
        self.stream = PromptStream(self.task.prompts(), config.rollout.prompts_per_step, config.task.seed,
                                   sampling_params(config, self.trainer.max_new_tokens, stop_ids),
                                   config.rollout.num_samples, LogprobMode[config.rollout.logprob_mode.upper()],
                                   episodes=self.episodic,
                                   sampling_seed=config.loop.seed if config.loop.deterministic else None)
        self.spec = PayloadSpec.of_run(config.rollout, self.trainer.rows, self.trainer.length, sampler_order(config),
                                       scored_window=self.trainer.update_config.scored_window)
        fresh = self.checkpointer.latest_step() is None
        if not fresh:
            with self.startup_times.phase("restore"):
                self.start_step = self.step = self._restore()
            if self.leader and not self.finished:
                saved = self.checkpointer.saved_at(self.step)
                print(f"resuming from step {self.step} (checkpoint of {saved or 'unknown time'})", flush=True)
            if self.finished:
                if self.leader:
                    print(f"{config.run_dir}: already finished at step {self.step} of {config.loop.steps}; nothing "
                          "to do", flush=True)
                return
        launching = None
        if fresh and self.leader and (embedded_server(config) or launches_vllm(config)):
            # The embedded server compiles its programs (a launched vLLM loads model.hf_path) while the learner loads
            # weights and warms up; it starts on the seed's weights, and the publish below gives it the learner's.
            launching = _EngineStart(stack, config, self.trainer, stop_ids, self.run_dir, {})
        if fresh:
            with self.startup_times.phase("warm-up"), self._warmup_progress() as on_warmup_step:
                losses = self.trainer.start_fresh(on_warmup_step)
            if self.leader and losses:
                print(f"warm-up: {len(losses)} steps, cross entropy {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)
        lengths = self.trainer.bucket_lengths
        if len(lengths) > 1:  # every program a step runs, compiled now: no step compiles
            what = (f"compiling the RL update step for lengths {', '.join(map(str, lengths))} (each batch trains at "
                    "the shortest that holds its longest row)")
            with self.startup_times.phase("update programs", Waiting(what, enabled=self.leader)):
                self.trainer.compile_buckets(self.spec.zeros().batch, raw_logprobs=self.spec.raw)
        if self.leader:
            with self.startup_times.phase("engine start", Waiting(self._engine_wait())):
                weights = self._published()
                engine = launching.take() if launching else build_engine_pool(config, self.trainer, stop_ids,
                                                                                self.run_dir, weights)
                episodes = self.publish.in_flight * config.rollout.num_samples  # at most in flight
                self.engine = stack.enter_context(EpisodeRunner(engine, self.task, episodes) if self.episodic
                                                  else engine)
                check_identity(self.engine.info(), self.trainer.model_config.vocab_size,
                               config.server.address or "the embedded server")
                self.server_version = self.engine.publish(self.trainer.policy_version, weights)
            self.canary_engine = engine
            self.buffer = RolloutBuffer(self.engine, self.stream.requests(), max_in_flight=self.publish.in_flight,
                                        max_staleness=self.publish.max_staleness, prefetch=self.publish.prefetch)
            stack.callback(self.buffer.close)
        else:
            self._published()  # the gather is collective: every process takes part in process 0's
        self.canary = publish_canary(config, self.trainer, broadcast)
        if self.leader:
            print(self.canary.describe(), flush=True)
        with self.startup_times.phase("publish canary"):
            self._start_canary = self._verify_publish(self.start_step)  # in the first step's metrics
        self.view = RunView(config=config, run_dir=self.run_dir, process_index=self.process_index, task=self.task,
                            engine=self.engine, start_step=self.start_step,
                            resumed=self.checkpointer.latest_step() is not None,
                            max_new_tokens=self.trainer.max_new_tokens, length=self.trainer.length,
                            startup_times=self.startup_times, save_checkpoint=self.save_checkpoint)
        for hook in self.hooks:
            stack.callback(hook.close)
            hook.on_start(self.view)
        compiles = compile_stats()
        self._startup_compiles = {"startup/compiled_programs": compiles["compile/programs"],
                                  "startup/compile_s": compiles["compile/seconds"],
                                  "startup/compile_cache_hits": compiles["compile/cache_hits"]}

    @contextlib.contextmanager
    def _warmup_progress(self) -> Iterator[Callable[[int, float], None] | None]:
        """The warm-up's announcement (its first step compiles the update step) and progress bar, on process 0."""
        steps = self.config.warmup.steps
        if not (self.leader and steps):
            yield None
            return
        compiling = Waiting(f"warm-up: {steps} steps of cross entropy; compiling its update step").start()
        bar = ProgressBar(steps, fields=WARMUP_FIELDS, label="warm-up")

        def on_step(step: int, loss: float) -> None:
            compiling.stop()
            bar.update(step, {"loss": loss})

        try:
            yield on_step
        finally:
            compiling.stop()
            bar.close()

    def _first(self, phase: str, what: str, first: bool, later: str | None = None):
        """The first step's ``phase``, announced (process 0) and timed; on later steps ``later`` is announced when
        it lasts over `SLOW_PHASE_S` (a long step shows progress within it)."""
        if not first:
            return Waiting(later, enabled=self.leader, quiet_s=SLOW_PHASE_S) if later else contextlib.nullcontext()
        return self.startup_times.phase(phase, Waiting(what, enabled=self.leader))

    def _first_rollouts_wait(self) -> str:
        """What the first rollouts wait for, in words: the embedded server compiled its programs before it served."""
        if embedded_server(self.config):
            return "waiting for the first rollouts"
        return "waiting for the first rollouts (an engine may compile its sampling programs on first use)"

    def _engine_wait(self) -> str:
        """What starting the engine waits for, in words."""
        server = self.config.server
        if server.address is not None and server.engine != "mlx":
            return f"connecting to the {server.engine} engine at {server.address} and publishing the weights"
        return (f"starting the {server.engine} engine (log: {self.run_dir / 'server.log'}) and publishing the "
                "weights")

    def _restore(self) -> int:
        """Restores the latest checkpoint; refuses a changed task, corrections, group size or model, before any
        array is read (another model's arrays would not even load)."""
        latest = self.checkpointer.latest_step()
        try:
            saved = self.checkpointer.read_metadata(latest)
        except Exception:  # noqa: BLE001 -- unreadable: the restore skips it and the check below sees the one restored
            saved = None
        if saved is not None:
            self._check_resume(saved, latest)
        position = DataPosition(self.stream.get_state())
        step, metadata = self.trainer.restore(self.checkpointer, position)
        self._check_resume(metadata, step)
        self.stream.set_state(position.state)
        return step

    def _check_resume(self, metadata: dict, step: int) -> None:
        """Refuses a checkpoint of another LoRA base or, unless allowed, of other settings (`changed_keys`)."""
        if self.trainer.lora is not None:
            try:
                check_base_identity(metadata.get("lora_base"), self._base_identity,
                                    f"{self.run_dir / 'checkpoints'} step {step}")
            except ValueError as error:
                raise ResumeConfigError(str(error)) from None
        changed = changed_keys(metadata.get("config") or {}, self.config)
        allowed = self.config.loop.allow_config_change
        shapes = ((model_shape((metadata.get("config") or {}).get("model") or {}),
                   model_shape(to_dict(self.config)["model"])) if changed and allowed else ())
        if shapes and None not in shapes and shapes[0] != shapes[1]:  # allowed or not, the arrays would not load
            raise ResumeConfigError(
                f"{self.run_dir / 'checkpoints'} holds step {step} of a model of another shape "
                f"({', '.join(key for key in changed if key.startswith('model.'))} changed): its arrays cannot load "
                "into this model, loop.allow_config_change or not. Use a new run_dir, or resume with the "
                "checkpoint's model settings")
        if changed and not allowed:
            raise ResumeConfigError(
                f"{self.run_dir / 'checkpoints'} holds step {step} of a run with other settings: "
                f"{', '.join(changed)} changed. Use a new run_dir, or set loop.allow_config_change = true to resume "
                "anyway")

    @functools.cached_property
    def _base_identity(self) -> dict:
        """The LoRA base's identity (`learner.model.lora.base_identity`), hashed once per run."""
        model = self.config.model
        return base_identity(model.hf_path, model.name, self.config.loop.seed)

    def _published(self) -> dict:
        """What a publish sends (a collective gather): the LoRA adapters alone where the engine serves them
        (`learner.rl.rollout_engines.publishes_adapters`), else the weights (LoRA's merged into the base) in the dtype
        the engine takes (`learner.rl.rollout_engines.publish_dtype`)."""
        if publishes_adapters(self.config):
            return self.trainer.host_adapters()
        return self.trainer.host_weights(publish_dtype(self.config))

    def _verify_publish(self, step: int) -> dict[str, float]:
        """The publish canary (`learner.rl.canary`) on the publish after ``step`` (``start_step``: the start's) where
        due, on every process; its ``canary/*`` metrics on process 0.

        Raises:
          CanaryMismatchError: the engine serves other weights than the learner published.
        """
        if not self.canary.due(step, self.start_step + 1):
            return {}
        return self.canary.verify(self.canary_engine, self.trainer.policy_version, self.leader)

    def save_checkpoint(self, step: int) -> None:
        """Starts saving the state, reference policy and data position as checkpoint ``step`` (asynchronous).

        Raises:
            NonFiniteUpdateError: the parameters or optimizer state hold NaN or inf (nothing is written).
        """
        if not self.trainer.all_finite():
            raise NonFiniteUpdateError(f"step {step}: the train state holds NaN or inf; not saving it as a "
                                       f"checkpoint (the latest checkpoint stays {self.checkpointer.latest_step()})")
        self.checkpointer.save(step, self.trainer.checkpoint_tree(), policy_version=self.trainer.policy_version,
                               config=to_dict(self.config),
                               data_iterator=DataPosition(self.stream.position(step - self.start_step)), force=True,
                               extra_metadata=({"lora_base": self._base_identity} if self.trainer.lora is not None
                                               else None))

    def steps(self) -> Iterator[StepRecord]:
        """Trains the steps after `step` up to ``loop.steps``, yielding a record per step (resumable after a
        ``break``); the hooks' ``on_end`` runs once the last step is done."""
        if self.finished:
            return
        if self._stack is None:
            raise RuntimeError("Run.steps: enter the run first (`with Run(config) as run:`)")
        while self.step < self.config.loop.steps:
            try:
                record = self._step(self.step + 1)  # holds stop signals from its update on
                self.step = record.step
                for hook in self.hooks:
                    hook.on_step(self.view, record)
            except BaseException:
                self._signals.release(raise_pending=False)
                raise
            self._signals.release()  # a stop signal received during the update or the hooks: the step is complete
            yield record
        for hook in self.hooks:
            hook.on_end(self.view)

    def _step(self, step: int) -> StepRecord:
        started = time.monotonic()
        trainer, rollout = self.trainer, self.config.rollout
        first = step == self.start_step + 1  # announced and timed: rollouts sampled by programs still compiling
        if self.leader:
            with self._first("first rollouts", self._first_rollouts_wait(), first,
                             later=f"step {step}: waiting for rollouts"):
                groups = [self.buffer.get(trainer.policy_version) for _ in range(rollout.prompts_per_step)]
            records = [self.stream.next_record() for _ in groups]
            beyond_bound: list[str] = []  # rewards out of learner.tasks.REWARD_BOUND, skipped
            try:
                payload, collated = assemble_payload(groups, records, self.task, self.spec, rollout.num_samples,
                                                     rollout.logprob_mode, reward_errors=beyond_bound,
                                                     drops=self._drops)
            except NoUsableRolloutsError as error:
                drops = {name: count for name, count in {**self.buffer.metrics(), **self.engine.metrics()}.items()
                         if "dropped" in name and count}
                raise NoUsableRolloutsError(f"step {step}: {error} (dropped and counted, never trained on); drops so "
                                            f"far: {drops}") from None
            check_logprob_mode(rollout.logprob_mode, collated.logprob_mode)
        else:
            self.stream.skip_batch()  # the batch process 0 issued; keeps this process's data position in step
            payload = self.spec.zeros()
        payload = Payload(*jax.tree.map(np.asarray, broadcast(payload, self.leader)))
        payload = payload._replace(batch=trainer.fit(payload.batch))  # the shortest length that holds its rows
        samples = int(payload.real_rows)
        rollout_s = time.monotonic() - started
        self._signals.hold()  # from the update (it donates the state) to the step's hooks: `steps` releases
        with self._first("first update", "running the first RL update (its programs compiled at start)"
                         if trainer.precompiled else "compiling the RL update step", first,
                         later=f"step {step}: running the RL update"):
            metrics, proximal = trainer.train(payload.batch, raw_logprobs=self.spec.raw)
        limit, skipped = self.config.optimizer.max_consecutive_skips, trainer.skipped_steps
        if skipped >= limit or (step == self.config.loop.steps and skipped >= step - self.start_step):
            nonfinite = sorted(name for name, value in metrics.items() if not np.isfinite(value))
            raise NonFiniteUpdateError(
                f"steps {step - skipped + 1} to {step}: every one skipped a non-finite update (loss or gradient NaN or "
                f"inf; optimizer.max_consecutive_skips = {limit}; a run whose every update was skipped never "
                f"finishes). Non-finite at step {step}: {', '.join(nonfinite) or 'the gradient'}. The parameters are "
                f"unchanged since step {step - skipped}; the latest checkpoint is {self.checkpointer.latest_step()}")
        update_s = time.monotonic() - started - rollout_s
        weights = self._published()
        rewards = payload.rewards[:samples]
        server_version = None
        if self.leader:
            if self.publish.drain:
                self.buffer.wait()
            server_version = self.engine.publish(trainer.policy_version, weights)
            canary = self._verify_publish(step)
            kept = samples / (rollout.prompts_per_step * rollout.num_samples)
            if kept < 0.5 and not self._warned_kept:
                self._warned_kept = True
                warnings.warn(f"step {step} trained on {samples} of {rollout.prompts_per_step * rollout.num_samples} "
                              "samples (the rest dropped: failed rewards, invalid or stale samples; see "
                              "reward/skipped_samples and samples/dropped/* in metrics.jsonl); warned once",
                              stacklevel=2)
            step_s = time.monotonic() - started
            tokens = float(payload.batch.loss_mask.sum())
            metrics.update({
                "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
                "rollout/samples": samples, "rollout/kept_fraction": kept,
                "rollout/groups_dropped": self._drops["groups_dropped"],
                "rollout/completion_tokens_mean": tokens / samples,
                "policy/learner_version": trainer.policy_version, "policy/server_version": server_version,
                "perf/step_s": step_s, "perf/rollout_wait_s": rollout_s, "perf/update_s": update_s,
                "perf/publish_s": step_s - rollout_s - update_s, "perf/tokens_per_s": tokens / step_s,
                "perf/samples_per_s": samples / step_s,
                # NeMo-RL's throughput: prompt and generated tokens per second per device (learner and server)
                "perf/all_tokens_per_s_per_device": float(payload.batch.attention_mask[:samples].sum()) / step_s
                / (jax.device_count() + (self.config.server.device is not None)),
                **self.buffer.metrics(), **self.engine.metrics(),
                **version_metrics(payload.batch.policy_version[:samples], payload.batch.loss_mask[:samples]),
                **compile_stats(), **(self.startup_times.metrics() | self._startup_compiles if first else {}),
                **(self.task.metrics() if hasattr(self.task, "metrics") else {}),
                **(episode_metrics([episode for group in groups for episode in group]) if self.episodic else {})})
            metrics["reward/skipped_samples"] = metrics.get("reward/skipped_samples", 0.0) + len(beyond_bound)
            metrics.update({name.replace("canary/", "canary/start_"): value for name, value in
                            (self._start_canary.items() if first else ()) if name.startswith("canary/")} | canary)
        else:
            self._verify_publish(step)
        return StepRecord(step=step, metrics=metrics, batch=payload.batch, samples=samples, rewards=rewards,
                          proximal_logprobs=proximal[:samples], policy_version=trainer.policy_version,
                          server_version=server_version)

    def train(self) -> dict[str, float]:
        """Runs every remaining step; returns the last step's metrics (empty if the run had already finished)."""
        last = {}
        for record in self.steps():
            last = record.metrics
        return last


class _EngineStart:
    """`build_engine_pool` on a thread that lives until ``stack`` closes (a launched engine's process dies with the
    thread that started it: `rollout_client.engines.child`); the engine is closed then unless `take` handed it
    over (to be closed before, as ``stack`` unwinds)."""

    def __init__(self, stack: contextlib.ExitStack, *args):
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-start")
        self._future = self._executor.submit(build_engine_pool, *args)
        self._taken = False
        stack.callback(self._close)

    def take(self):
        """The engine (waits for it); raises what `build_engine_pool` raised."""
        self._taken = True
        return self._future.result()

    def _close(self) -> None:
        try:
            if not self._taken and self._future.exception() is None:
                self._future.result().close()
        finally:
            self._executor.shutdown(wait=False)


def broadcast(tree, is_source: bool):
    """``tree`` from process 0 to all (the others pass a tree of the same shapes); identity for one process."""
    if jax.process_count() == 1:
        return tree
    return multihost_utils.broadcast_one_to_all(tree, is_source=is_source)
