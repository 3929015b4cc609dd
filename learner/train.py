"""The main job: RL training of a policy against a separate inference server, from one command.

    python -m learner.train --config configs/default.toml [--set section.field=value ...]

One run, under ``run_dir``:

1. Start the reference inference server as a child process on 127.0.0.1 (unless ``server.address`` names an
   external one), build the mesh and the train state, and either restore the latest checkpoint (state, policy
   version, data position) or run the supervised warm-up: ``warmup.steps`` update calls with the corrections
   objective ``cross_entropy`` on noisy demonstrations, through the same jitted update step.
2. Publish the weights (pause -> stream -> resume; the client confirms the server's policy version), so a resumed
   run's server serves the checkpoint's policy version.
3. Loop: a `rollout_client.RolloutBuffer` keeps ``prompts_per_step * max_staleness`` requests (one per prompt,
   ``num_samples`` completions each) in flight, so the rollouts of the next steps are sampled while this one
   trains (``max_staleness = 0``: synchronous, each batch is requested after the previous update's weights are
   published, so every sample is on-policy; ``fixed_staleness``: the in-flight rollouts finish before new
   weights are published, so each sample is exactly ``max_staleness`` versions old). Each step takes one batch
   of groups, scores them with the task's reward, computes GRPO advantages per group, trains with ONE
   `learner.update.make_update_fn` call under the configured corrections preset (the per-token policy versions
   stamped by the server make the staleness metric true), publishes the new weights, logs metrics (JSONL +
   TensorBoard), the batch (tensorstore rollout log) and, every ``checkpoint_every`` steps, a checkpoint. Batches
   have one fixed shape (rows ``prompts_per_step * num_samples``, length one bucket), so the update compiles once.
4. Write the learning-curve PNG and print a summary table.

Resume: rerunning the same command after a crash (even SIGKILL) restores the latest checkpoint; metrics and the
rollout log drop the steps after it and continue. The checkpoint's data position is that of the first batch not
yet trained (requests in flight when the run died are issued again), so the prompt order is the same as in an
uninterrupted run.

Multi-host: the same command on every host (``--coordinator``, ``--num-processes``, ``--process-id``, or
auto-detection by `learner.distributed.initialize`). Process 0 owns the server and the client; it broadcasts each
rollout batch (fixed shape) to the other processes, every process runs the same jitted update on the global mesh,
and process 0 publishes the gathered weights and writes metrics, rollout log and plot. Checkpoints are written by
all processes together (orbax). Every process writes ``process_<i>.json`` (steps, reward per step, a digest of the
batches it trained on), so that runs can be checked for agreement.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import time
from collections.abc import Iterator

import corrections
import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from learner.batch import TrainBatch
from learner.bucketing import BucketConfig, pad_batch
from learner.checkpoints import CheckpointConfig, Checkpointer, restore_target
from learner.data import prompt_dataset, prompt_iterator
from learner.distributed import initialize
from learner.logprob_mode import check_logprob_mode, replay_params
from learner.metrics_writers import FanOutWriter, JsonlWriter, TensorBoardWriter
from learner.model import Transformer, model_config
from learner.optimizer import OptimizerConfig, make_optimizer
from learner.param_paths import parameter_names
from learner.plots import plot_learning_curves
from learner.progress import ProgressBar, summary_table
from learner.rollout_log import LoggedBatch, RolloutLogWriter
from learner.run_config import RunConfig, load_config, to_dict
from learner.safetensors_io import config_from_hf, load_safetensors
from learner.sampler_replay import SamplerParams, transforms, truncates
from learner.sharding import batch_sharding, make_mesh
from learner.tasks import batch_rewards, get_task, prompt_example
from learner.train_state import TrainState, create_sharded_train_state, train_state_shardings
from learner.truncation_bias import batch_truncation_bias
from learner.update import UpdateConfig, make_update_fn, recompute_logprobs
from rollout_client import ClientConfig, LogprobMode, RolloutBuffer, RolloutClient, RolloutRequest, SamplingParams
from rollout_client import EngineProcess, collate

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "learning_curves.png"


def parse_args(argv=None) -> tuple[pathlib.Path | None, list[str]]:
    """The config path and the overrides (``--set`` plus the multi-host flags, as overrides)."""
    parser = argparse.ArgumentParser(prog="python -m learner.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=pathlib.Path, help="TOML run config (default: built-in defaults)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override one config field (repeatable), e.g. --set loop.steps=50")
    parser.add_argument("--run-dir", help="same as --set run_dir=...")
    parser.add_argument("--coordinator", help="multi-host: host:port of process 0")
    parser.add_argument("--num-processes", type=int, help="multi-host: number of processes")
    parser.add_argument("--process-id", type=int, help="multi-host: this process's index")
    args = parser.parse_args(argv)
    overrides = list(args.set)
    if args.run_dir:
        overrides.append(f"run_dir={json.dumps(args.run_dir)}")
    for name in ("coordinator", "num_processes", "process_id"):
        if getattr(args, name) is not None:
            overrides.append(f"distributed.{name}={json.dumps(getattr(args, name))}")
    return args.config, overrides


def setup_jax(config: RunConfig) -> None:
    """CPU device count, CPU collectives and the distributed system: before any other JAX call."""


    if config.mesh.cpu_devices:
        jax.config.update("jax_num_cpu_devices", config.mesh.cpu_devices)
    if (config.distributed.num_processes or 1) > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    initialize(config.distributed.coordinator, config.distributed.num_processes, config.distributed.process_id)


class DataPosition:
    """A saved prompt-stream position in the form grain's orbax handler stores (``get_state`` / ``set_state``)."""

    def __init__(self, state: dict):
        self.state = state

    def get_state(self) -> bytes:
        return json.dumps(self.state).encode()

    def set_state(self, state: bytes) -> None:
        self.state = json.loads(state)

    def start_prefetch(self) -> None:
        """Nothing to prefetch: the caller applies ``state`` to its own iterator."""


class PromptStream:
    """Rollout requests, one per prompt, from the grain prompt iterator; remembers where each batch started.

    ``position(n)`` is the iterator state before the ``n``-th batch pulled (counting from this stream's start):
    after ``n`` trained batches, the position to resume from.
    """

    def __init__(self, iterator, sampling, num_samples: int, logprob_mode):
        self._iterator, self._sampling, self._num_samples, self._mode = iterator, sampling, num_samples, logprob_mode
        self._positions: list[dict] = []

    def position(self, batches_trained: int) -> dict:
        return self._positions[batches_trained] if batches_trained < len(self._positions) else (
            self._iterator.get_state())

    def requests(self) -> Iterator:

        while True:
            self._positions.append(self._iterator.get_state())
            batch = next(self._iterator)
            for prompt, length in zip(batch["prompt_ids"], batch["prompt_length"]):
                yield RolloutRequest(prompt[:length], sampling=self._sampling, num_samples=self._num_samples,
                                     logprob_mode=self._mode)


def assemble_batch(groups, task, num_samples: int, rows: int, length: int, logprob_mode: str):
    """Complete groups -> ``(batch, rewards, real_rows, collated, truncation)``: ``[rows, length]`` host NumPy.

    Groups with fewer than ``num_samples`` samples (dropped as stale or invalid) are left out; missing rows are
    fully masked padding. Advantages are GRPO's, per group, broadcast over each sample's completion tokens.
    ``collated`` is the `rollout_client.collate` batch, with the sampling parameters the server echoed; with
    PROCESSED logprobs the batch carries them, for the update to replay. ``truncation``: with RAW logprobs of a
    truncating sampler (top-k, top-p or min-p), the ``[rows]`` sampling parameters for the truncation-bias
    diagnostic (the trap RAW ratios cannot see); otherwise None.
    """


    samples = [s for group in groups if len(group) == num_samples for s in group]
    if not samples:
        raise RuntimeError("every group of this rollout batch was dropped (stale or invalid samples)")
    collated = collate(samples, pad_to_multiple=length, pad_token_id=task.tokenizer.pad_id)
    rewards = batch_rewards(task, [s.prompt_token_ids for s in samples], [s.completion_token_ids for s in samples])
    advantages = np.asarray(corrections.grpo_advantages(rewards, num_samples), np.float32)
    width = collated.tokens.shape[1]
    lengths = collated.prompt_lengths + collated.completion_lengths
    batch = TrainBatch(
        tokens=collated.tokens, positions=np.broadcast_to(np.arange(width, dtype=np.int32), collated.tokens.shape),
        attention_mask=np.arange(width) < lengths[:, None], loss_mask=collated.loss_mask,
        advantages=advantages[:, None] * collated.loss_mask, rollout_logprobs=collated.rollout_logprobs,
        policy_version=collated.policy_versions, sampling=replay_params(logprob_mode, collated))
    batch = pad_batch(batch, BucketConfig(min_length=length, max_length=length), row_multiple=rows)
    truncation = SamplerParams.from_batch(collated).pad_rows(rows) if (
        logprob_mode.upper() == "RAW" and truncates(collated.top_k, collated.top_p, collated.min_p)) else None
    return batch, np.pad(rewards, (0, rows - len(samples))), len(samples), collated, truncation


def demonstration_batch(task, rng: np.random.Generator, size: int, noise: float, length: int, row_multiple: int):
    """A supervised batch of noisy demonstrations (loss on the completion tokens), host NumPy ``[size', length]``."""

    tokens = np.full((size, length), task.tokenizer.pad_id, np.int32)
    loss_mask = np.zeros((size, length), np.float32)
    for row in range(size):
        prompt, _ = task.make_prompt(rng)
        completion = task.noisy_demonstration(prompt, rng, noise)
        tokens[row, :len(prompt) + len(completion)] = np.concatenate([prompt, completion])
        loss_mask[row, len(prompt):len(prompt) + len(completion)] = 1.0
    zeros = np.zeros_like(loss_mask)
    batch = TrainBatch(tokens=tokens, positions=np.broadcast_to(np.arange(length, dtype=np.int32), tokens.shape),
                         attention_mask=tokens != task.tokenizer.pad_id, loss_mask=loss_mask, advantages=zeros,
                         rollout_logprobs=zeros, policy_version=np.zeros_like(tokens))
    return pad_batch(batch, BucketConfig(min_length=length, max_length=length), row_multiple=row_multiple)


def _bucket(length: int) -> int:
    return max(8, 1 << (length - 1).bit_length())


def _mean_metrics(metrics) -> dict[str, float]:
    """Per-update metric arrays -> one mean per key, on the host."""

    return {name: float(np.mean(value)) for name, value in jax.device_get(metrics).items()}


class Trainer:
    """Mesh, train state and the jitted steps of one run (see the module docstring)."""

    def __init__(self, config: RunConfig):
        self.config = config
        self.task = get_task(config.task.name)
        self.max_new_tokens = config.rollout.max_new_tokens or self.task.max_completion_tokens
        self.length = _bucket(self.task.max_prompt_tokens + self.max_new_tokens)
        if config.model.hf_path:
            hf_config = json.loads((pathlib.Path(config.model.hf_path) / "config.json").read_text())
            self.model_config = config_from_hf(hf_config, param_dtype=config.model.param_dtype)
        else:
            self.model_config = model_config(config.model.name, param_dtype=config.model.param_dtype)
        self.mesh = make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
        self.data_parallel = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        self.update_config = UpdateConfig(
            corrections=corrections.preset(config.corrections.preset, **config.corrections.overrides),
            num_minibatches=config.update.num_minibatches, num_microbatches=config.update.num_microbatches,
            ppo_epochs=config.update.ppo_epochs,
            logprob_chunk_size=min(config.update.logprob_chunk_size, self.length))
        multiple = self.update_config.row_multiple(self.data_parallel)
        self.rows = -(-config.rollout.prompts_per_step * config.rollout.num_samples // multiple) * multiple
        updates_per_step = config.update.num_minibatches * config.update.ppo_epochs
        self.optimizer = make_optimizer(OptimizerConfig(
            peak_learning_rate=config.optimizer.learning_rate, end_learning_rate=config.optimizer.learning_rate,
            warmup_steps=config.optimizer.warmup_steps,
            total_steps=max(config.loop.steps * updates_per_step, config.optimizer.warmup_steps, 1),
            max_grad_norm=config.optimizer.max_grad_norm, weight_decay=config.optimizer.weight_decay))
        self.graphdef, self.state, self.shardings = create_sharded_train_state(
            self.model_config, self.optimizer, self.mesh, seed=config.loop.seed)
        self.compiler_options = {"xla_backend_optimization_level": 0} if config.update.fast_compile else None
        self.update_fn = make_update_fn(self.graphdef, self.optimizer, self.update_config, self.mesh,
                                        self.shardings, compiler_options=self.compiler_options)
        self.proximal_fn = jax.jit(
            lambda params, batch: recompute_logprobs(self.graphdef, params, batch, self.update_config, self.mesh),
            out_shardings=NamedSharding(self.mesh, P()), compiler_options=self.compiler_options)
        self.truncation_fn = jax.jit(
            functools.partial(batch_truncation_bias, self.graphdef, chunk_size=self.update_config.logprob_chunk_size),
            out_shardings=NamedSharding(self.mesh, P()), compiler_options=self.compiler_options)

    @property
    def policy_version(self) -> int:
        return int(self.state.policy_version)

    def device_batch(self, batch: TrainBatch) -> TrainBatch:
        """Host batch (the same on every process) -> global arrays sharded over the batch axes."""
        sharding = batch_sharding(self.mesh)
        return jax.tree.map(
            lambda x: jax.make_array_from_callback(np.shape(x), sharding, lambda index: np.asarray(x)[index]), batch)

    def train(self, batch: TrainBatch, truncation: SamplerParams | None = None
              ) -> tuple[dict[str, float], np.ndarray]:
        """One RL update on a host batch; returns the mean metrics and the proximal logprobs (for the log).

        ``truncation``: the sampler of a RAW batch, whose truncation bias (``sampler/log_kept_mass_*``) is measured
        under the pre-update weights and added to the metrics.
        """
        device_batch = self.device_batch(batch)
        # The update recomputes the proximal logprobs in decoupled mode and returns them; bypass mode needs a pass.
        proximal = (self.proximal_fn(self.state.params, device_batch)
                    if self.update_config.corrections.mode == "bypass" else None)
        bias = {} if truncation is None else self.truncation_fn(
            self.state.params, self.device_batch(batch.replace(sampling=truncation)))
        self.state, metrics, recomputed = self.update_fn(self.state, device_batch, None)
        return _mean_metrics(metrics) | _mean_metrics(bias), np.asarray(recomputed if proximal is None else proximal)

    def restore(self, checkpointer: Checkpointer, iterator) -> int | None:
        """Restores the latest checkpoint (state and data position); returns its step, or None if there is none."""
        if checkpointer.latest_step() is None:
            return None
        position = DataPosition(iterator.get_state())
        restored = checkpointer.restore(restore_target(self.state, self.shardings), data_iterator=position)
        self.state = restored.state
        iterator.set_state(position.state)
        return restored.step

    def load_hf_weights(self) -> None:
        """Replaces the random initial parameters with the Hugging Face checkpoint's, when configured.

        The loaded weights are a new policy version, so the first publish pushes them to a server that was started
        from the seed's random weights (version 0).
        """
        if self.config.model.hf_path:
            model = Transformer(self.model_config, rngs=nnx.Rngs(self.config.loop.seed))
            load_safetensors(model, self.config.model.hf_path)
            self.state = self.state.replace(params=jax.device_put(nnx.state(model), self.shardings.params),
                                            policy_version=self.state.policy_version + 1)

    def warm_up(self) -> list[float]:
        """Supervised warm-up: cross entropy on noisy demonstrations through the update step; returns the losses.

        It runs on its own optimizer (constant learning rate, corrections objective ``cross_entropy``); the RL
        optimizer state starts fresh afterwards. Each call advances the policy version by one, as an RL update.
        """
        warmup = self.config.warmup
        if warmup.steps == 0:
            return []
        optimizer = make_optimizer(OptimizerConfig(peak_learning_rate=warmup.learning_rate,
                                                   end_learning_rate=warmup.learning_rate, total_steps=warmup.steps))
        sft_config = dataclasses.replace(self.update_config, num_minibatches=1, ppo_epochs=1,
                                         corrections=corrections.CorrectionConfig(
                                             mode="bypass", objective=corrections.Objective(name="cross_entropy")))
        state = self.state.replace(opt_state=optimizer.init(self.state.params))
        update = make_update_fn(self.graphdef, optimizer, sft_config, self.mesh,
                                train_state_shardings(state, optimizer, self.mesh),
                                compiler_options=self.compiler_options)
        rng = np.random.default_rng((self.config.task.seed, 1))
        losses = []
        for _ in range(warmup.steps):
            batch = demonstration_batch(self.task, rng, warmup.batch_size, warmup.noise, self.length,
                                        sft_config.row_multiple(self.data_parallel))
            state, metrics, _ = update(state, self.device_batch(batch), None)
            losses.append(_mean_metrics({"loss": metrics["actor/pg_loss"]})["loss"])
        self.state = jax.jit(lambda s: s.replace(opt_state=self.optimizer.init(s.params)),
                             out_shardings=self.shardings)(state)
        return losses

    def host_weights(self) -> dict[str, np.ndarray]:
        """The parameters as ``{path: array}`` in the server's naming, gathered from every process."""
        params = multihost_utils.process_allgather(self.state.params, tiled=True)
        names, _ = parameter_names(params)
        return {name: np.asarray(leaf) for name, leaf in zip(names, jax.tree.leaves(params))}


class Rollouts:
    """Process 0's side of the server: the embedded server process, the client and the in-flight buffer."""

    def __init__(self, config: RunConfig, trainer: Trainer, run_dir: pathlib.Path):
        self.config = config
        self.server = None
        address = config.server.address
        if address is None:
            self.server = EngineProcess(
                "learner.serving",
                ["--model-config", config.model.name, "--dtype", config.server.dtype,
                 "--eos-ids", str(trainer.task.tokenizer.eos_id), "--max-batch-size", str(config.server.max_batch_size),
                 "--max-seq-len", str(trainer.length), "--decode-steps-per-call", str(config.server.decode_steps_per_call),
                 "--seed", str(config.loop.seed)],
                run_dir / "server.log", config.server.start_timeout_s)
            address = self.server.address
        token = os.environ.get(config.server.auth_token_env) if config.server.auth_token_env else None
        self.client = RolloutClient(ClientConfig(target=address, auth_token=token,
                                                 deadline_base_s=config.server.generate_deadline_s))
        self.buffer = None

    def publish(self, version: int, weights: dict[str, np.ndarray]) -> int:
        """Pause -> stream -> resume; returns the policy version the server confirms."""
        server_version = self.client.server_info().policy_version
        if server_version > version:
            raise RuntimeError(f"the server already serves policy version {server_version}, newer than the "
                               f"learner's {version}: restart the server (versions must increase)")
        if server_version == version:
            if self.server is None and version == 0:  # an external server's version 0 is its own weights, not ours
                raise RuntimeError("the external server serves policy version 0, as does the fresh learner, so its "
                                   "weights cannot be replaced (versions must increase): set warmup.steps > 0 or "
                                   "model.hf_path, or serve the learner's initial weights")
            return server_version  # our embedded server from the same seed, or a version we pushed
        return self.client.publish_weights(version, weights=weights)

    def start(self, requests: Iterator[RolloutRequest]) -> None:
        rollout = self.config.rollout
        self.buffer = RolloutBuffer(self.client, requests,
                                    max_in_flight=rollout.prompts_per_step * max(rollout.max_staleness, 1),
                                    max_staleness=rollout.max_staleness, prefetch=rollout.max_staleness > 0)

    def groups(self, learner_version: int) -> list:
        return [self.buffer.get(learner_version) for _ in range(self.config.rollout.prompts_per_step)]

    def close(self) -> None:
        if self.buffer is not None:
            self.buffer.close()
        self.client.close()
        if self.server is not None:
            self.server.stop()


def _check_echo(collated, config: RunConfig) -> None:
    """The server's echo must match what was asked: logprob mode and temperature."""
    check_logprob_mode(config.rollout.logprob_mode, collated.logprob_mode)
    if not np.allclose(collated.temperature, config.rollout.temperature):
        raise ValueError(f"rollout.temperature={config.rollout.temperature}: the server sampled at "
                         f"{sorted(set(collated.temperature.tolist()))}")


def _broadcast(tree, is_source: bool):
    """``tree`` from process 0 to all (the others pass a tree of the same shapes); identity for one process."""
    if jax.process_count() == 1:
        return tree
    return multihost_utils.broadcast_one_to_all(tree, is_source=is_source)


def _empty_payload(trainer: Trainer):
    """Zeros shaped like process 0's broadcast payload: ``(batch, rewards, real_rows, truncation)``."""
    shape = (trainer.rows, trainer.length)
    dtypes = (np.int32, np.int32, bool, np.float32, np.float32, np.float32, np.int32)
    rollout, sampling, truncation = trainer.config.rollout, None, None
    rows = SamplerParams(*(np.zeros(trainer.rows, t) for t in (np.float32, np.int32, np.float32, np.float32)))
    if rollout.logprob_mode == "processed" and transforms(rollout.temperature, rollout.top_k, rollout.top_p,
                                                          rollout.min_p):
        sampling = rows  # process 0's batch carries [rows] sampling params to replay
    if rollout.logprob_mode == "raw" and truncates(rollout.top_k, rollout.top_p, rollout.min_p):
        truncation = rows  # and its truncation-bias diagnostic
    return (TrainBatch(*(np.zeros(shape, dtype) for dtype in dtypes), sampling=sampling),
            np.zeros(trainer.rows, np.float32), np.int32(0), truncation)


def _summary(config: RunConfig, history: dict[int, dict], start_step: int, wall_s: float, trainer: Trainer,
             server_version: int) -> list[tuple[str, str]]:
    steps = sorted(history)
    rewards = [history[s]["reward/mean"] for s in steps]
    head, tail = np.mean(rewards[:3]), np.mean(rewards[-5:])
    last = history[steps[-1]]
    trained = len(steps)
    return [
        ("task", config.task.name),
        ("corrections", config.corrections.preset),
        ("steps", f"{start_step + 1}-{steps[-1]} of {config.loop.steps}"),
        ("reward (first 3 -> last 5 steps)", f"{head:.3f} -> {tail:.3f}"),
        ("train/rollout kl (last step)", f"{last.get('rollout_corr/kl', float('nan')):+.2e}"),
        ("clip fraction (last step)", f"{last.get('actor/pg_clipfrac', float('nan')):.3f}"),
        ("policy version learner / server", f"{trainer.policy_version} / {server_version}"),
        ("wall time", f"{wall_s:.0f} s"),
        ("steps/s (RL loop)", f"{trained / sum(history[s]['perf/step_s'] for s in steps):.2f}"),
        ("samples/s (RL loop)", f"{np.mean([history[s]['perf/samples_per_s'] for s in steps]):.1f}"),
        ("run directory", str(config.run_dir)),
    ]


def run(config: RunConfig) -> dict[str, float]:
    """Trains as configured, resuming from ``run_dir``'s latest checkpoint; returns process 0's last metrics."""
    started = time.monotonic()
    run_dir = pathlib.Path(config.run_dir).resolve()  # orbax needs an absolute checkpoint path
    run_dir.mkdir(parents=True, exist_ok=True)
    leader = jax.process_index() == 0
    trainer = Trainer(config)
    rollout = config.rollout
    dataset = prompt_dataset(np.arange(config.task.num_prompts),
                             functools.partial(prompt_example, trainer.task, config.task.seed),
                             global_batch_size=rollout.prompts_per_step, seed=config.task.seed,
                             process_index=0, process_count=1)  # every process walks the whole stream
    iterator = prompt_iterator(dataset)
    checkpointer = Checkpointer(CheckpointConfig(str(run_dir / "checkpoints"), keep_last=config.loop.keep_checkpoints))
    start_step = trainer.restore(checkpointer, iterator)
    if start_step is None:
        trainer.load_hf_weights()
        losses = trainer.warm_up()
        if leader and losses:
            print(f"warm-up: {len(losses)} steps, cross entropy {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)
        start_step = 0
        checkpointer.save(0, trainer.state, policy_version=trainer.policy_version, config=to_dict(config),
                          data_iterator=DataPosition(iterator.get_state()), force=True)
    stream = PromptStream(iterator, SamplingParams(
        temperature=rollout.temperature, top_k=rollout.top_k, top_p=rollout.top_p, min_p=rollout.min_p,
        max_new_tokens=trainer.max_new_tokens,
        stop_token_ids=(trainer.task.tokenizer.eos_id,)), rollout.num_samples, LogprobMode[rollout.logprob_mode.upper()])
    weights = trainer.host_weights()
    rollouts = Rollouts(config, trainer, run_dir) if leader else None
    history: dict[int, dict] = {}
    agreement = {"steps": [], "reward_mean": [], "batch_sha256": hashlib.sha256()}
    try:
        if leader:
            server_version = rollouts.publish(trainer.policy_version, weights)
            rollouts.start(stream.requests())
            writer = FanOutWriter([JsonlWriter(run_dir / METRICS_FILE, resume_step=start_step),
                                   TensorBoardWriter(run_dir / "tensorboard")])
            log = RolloutLogWriter(run_dir / "rollout_log", max_length=trainer.length, resume_step=start_step)
            progress = ProgressBar(config.loop.steps, start=start_step)
        for step in range(start_step + 1, config.loop.steps + 1):
            step_started = time.monotonic()
            if leader:
                batch, rewards, real_rows, collated, truncation = assemble_batch(
                    rollouts.groups(trainer.policy_version), trainer.task, rollout.num_samples, trainer.rows,
                    trainer.length, rollout.logprob_mode)
                _check_echo(collated, config)
                payload = (batch, rewards, np.int32(real_rows), truncation)
            else:
                next(iterator)  # the batch process 0 issued; keeps this process's saved data position in step
                payload = _empty_payload(trainer)
            batch, rewards, real_rows, truncation = jax.tree.map(np.asarray, _broadcast(payload, leader))
            real_rows = int(real_rows)
            rollout_s = time.monotonic() - step_started
            metrics, proximal = trainer.train(batch, truncation)
            update_s = time.monotonic() - step_started - rollout_s
            weights = trainer.host_weights()
            reward_mean = float(rewards[:real_rows].mean())
            agreement["steps"].append(step)
            agreement["reward_mean"].append(reward_mean)
            agreement["batch_sha256"].update(np.ascontiguousarray(batch.tokens).tobytes())
            if leader:
                if rollout.fixed_staleness:
                    rollouts.buffer.wait()
                server_version = rollouts.publish(trainer.policy_version, weights)
                step_s = time.monotonic() - step_started
                tokens = float(batch.loss_mask.sum())
                metrics.update({
                    "reward/mean": reward_mean, "reward/std": float(rewards[:real_rows].std()),
                    "rollout/samples": real_rows, "rollout/completion_tokens_mean": tokens / real_rows,
                    "policy/learner_version": trainer.policy_version, "policy/server_version": server_version,
                    "perf/step_s": step_s, "perf/rollout_wait_s": rollout_s, "perf/update_s": update_s,
                    "perf/publish_s": step_s - rollout_s - update_s, "perf/tokens_per_s": tokens / step_s,
                    "perf/samples_per_s": real_rows / step_s, **rollouts.buffer.metrics(),
                    **rollouts.client.metrics()})
                writer.write(step, metrics)
                rows = slice(0, real_rows)
                log.append(LoggedBatch(step=step, tokens=batch.tokens[rows], loss_mask=batch.loss_mask[rows],
                                       rollout_logprobs=batch.rollout_logprobs[rows], proximal_logprobs=proximal[rows],
                                       rewards=rewards[rows], advantages=batch.advantages[rows],
                                       policy_version=batch.policy_version[rows]))
                progress.update(step, metrics)
                history[step] = metrics
                if step % config.loop.plot_every == 0:
                    plot_learning_curves(run_dir / METRICS_FILE, run_dir / PLOT_FILE)
            if step % config.loop.checkpoint_every == 0 or step == config.loop.steps:
                position = stream.position(step - start_step) if leader else iterator.get_state()
                checkpointer.save(step, trainer.state, policy_version=trainer.policy_version, config=to_dict(config),
                                  data_iterator=DataPosition(position), force=True)
        checkpointer.close()
        agreement["policy_version"] = trainer.policy_version
        agreement["batch_sha256"] = agreement["batch_sha256"].hexdigest()
        (run_dir / f"process_{jax.process_index()}.json").write_text(json.dumps(agreement))
        if leader and history:
            progress.close()
            log.close()
            writer.close()
            plot_learning_curves(run_dir / METRICS_FILE, run_dir / PLOT_FILE)
            print(summary_table(_summary(config, history, start_step, time.monotonic() - started, trainer,
                                         server_version)), flush=True)
    finally:
        if leader:
            rollouts.close()
    return history[max(history)] if history else {}


def main(argv=None) -> None:
    config_path, overrides = parse_args(argv)
    config = load_config(config_path, overrides)
    setup_jax(config)
    run(config)


if __name__ == "__main__":
    main()
