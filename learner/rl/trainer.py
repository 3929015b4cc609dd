"""The learner side of a run: mesh, sharded train state, the jitted update, warm-up, checkpoint state."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import corrections
from learner.checkpoints.checkpointer import Checkpointer, restore_target
from learner.checkpoints.hf_checkpoint import model_config_from_checkpoint
from learner.checkpoints.safetensors_io import load_safetensors
from learner.logprobs.truncation_bias import truncation_bias_metrics
from learner.model.lora import merge_adapters
from learner.model.param_paths import parameter_names
from learner.model.precision import resolve_matmul_precision, with_matmul_precision
from learner.model.sharding import batch_sharding, make_mesh
from learner.model.transformer import Transformer, count_params, model_config
from learner.rl.batch_assembly import demonstration_batch
from learner.rl.config import (
    RunConfig,
    correction_config,
    lora_config,
    optimizer_config,
    optimizer_updates,
    update_config,
    warmup_optimizer_config,
)
from learner.rl.preflight import ConfigError
from learner.update.batch import TrainBatch
from learner.update.bucketing import BucketConfig, bucket_lengths, cut_batch, pad_batch
from learner.update.logprob_mode import rebuild_batch_logprobs
from learner.update.optimizer import make_optimizer, skipped_updates
from learner.update.step import make_update_fn, merge_model, recompute_logprobs
from learner.update.train_state import create_sharded_frozen, create_sharded_train_state, train_state_shardings


def bucket_length(length: int) -> int:
    """The padded batch length: the next power of two, at least 8 (few lengths, few compiled programs)."""
    return max(8, 1 << (length - 1).bit_length())


MIN_UPDATE_BUCKET = 128  # the shortest update length of a bucketed run: shorter runs compile one program


def update_buckets(length: int) -> BucketConfig:
    """The update's lengths for a run whose rows hold up to ``length`` tokens (a power of two): multiples of a quarter
    of it, at least ``MIN_UPDATE_BUCKET`` (each step trains at the shortest that holds its longest row).

    >>> from learner.update.bucketing import bucket_lengths
    >>> [bucket_lengths(update_buckets(n)) for n in (2048, 256, 128)]
    [[512, 1024, 1536, 2048], [128, 192, 256], [128]]
    """
    return BucketConfig(min_length=min(length, MIN_UPDATE_BUCKET), multiple=max(length // 4, 8), max_length=length)


def model_context(config: RunConfig) -> int:
    """The model's context in tokens: ``max_position_embeddings`` of ``model.hf_path``, or the named model's
    ``max_seq_len``."""
    if config.model.hf_path:
        return model_config_from_checkpoint(config.model.hf_path).max_seq_len
    return model_config(config.model.name).max_seq_len


def learner_model_config(config: RunConfig, length: int):
    """The policy's `ModelConfig`: ``model.hf_path``'s config.json (cut to ``length`` positions) or the named
    config, with parameters in ``model.param_dtype`` and every pass computing in ``model.compute_dtype``."""
    dtypes = {"param_dtype": config.model.param_dtype, "dtype": config.model.compute_dtype}
    if config.model.hf_path:
        return model_config_from_checkpoint(config.model.hf_path, max_seq_len=length, **dtypes)
    return model_config(config.model.name, **dtypes)


def mean_metrics(metrics) -> dict[str, float]:
    """Per-update metric arrays -> one mean per key, on the host."""
    return {name: float(np.mean(value)) for name, value in jax.device_get(metrics).items()}


def describe_train_state(params, model_config, seconds: float) -> str:
    """The start-up line on a train state whose trained parameters are ``params``: a LoRA run counts its adapters,
    not its frozen base (``model_config``, with ``lora`` set for such a run).

    >>> import jax
    >>> describe_train_state({"w": jax.ShapeDtypeStruct((4, 8), "float32")}, model_config("tiny"), 0.42)
    'train state: 32 parameters built in 0.4 s'
    """
    trained = sum(leaf.size for leaf in jax.tree.leaves(params))
    if model_config.lora is None:
        return f"train state: {trained:,} parameters built in {seconds:.1f} s"
    base = dataclasses.replace(model_config, lora=None)
    return (f"train state: {trained:,} trained parameters (LoRA rank {model_config.lora.rank} adapters; frozen base "
            f"{count_params(base):,}) built in {seconds:.1f} s")


class Trainer:
    """Mesh, train state, reference parameters and the jitted steps of one run.

    With ``model.lora`` the train state holds the adapters, ``frozen`` the base (`learner.model.lora`): ``model_config``
    is
    the base's (what the engines serve, with the adapters merged into it: `host_weights`), ``train_config`` the
    model trained. Without it both are the same and ``frozen`` is None.

    Args:
      config: the run.
      task: its task (for the batch length and the warm-up's demonstrations).
    """

    def __init__(self, config: RunConfig, task):
        self.config = config
        self.task = task
        self.max_new_tokens = config.rollout.max_new_tokens or task.max_completion_tokens
        context = model_context(config)
        if task.max_prompt_tokens + self.max_new_tokens > context:
            raise ConfigError(f"prompts of up to {task.max_prompt_tokens} tokens (the task's max_prompt_tokens) plus "
                             f"{self.max_new_tokens} new tokens (rollout.max_new_tokens, else the task's "
                             f"max_completion_tokens) exceed the model's context of {context} positions: lower "
                             "task.args.max_prompt_tokens or rollout.max_new_tokens")
        self.length = bucket_length(task.max_prompt_tokens + self.max_new_tokens)
        self.model_config = learner_model_config(config, self.length)
        try:
            self.mesh = make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
        except ValueError as error:
            raise ConfigError(f"mesh.data, mesh.fsdp, mesh.tensor: {error}; their product must be the device count "
                              "(one of them may be -1: the remaining devices; mesh.cpu_devices sets the count on a "
                              "CPU)") from None
        self.data_parallel = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        # Each step trains at the shortest bucket that holds its batch's longest row (`fit`); seq-mean-token-sum-norm
        # divides by the full length whatever the bucket, so the loss does not depend on it.
        self.buckets = (update_buckets(self.length) if config.update.length_buckets
                        else BucketConfig(min_length=self.length, max_length=self.length))
        self.update_config = dataclasses.replace(
            update_config(config, correction_config(config), self.length, self.max_new_tokens), norm_length=self.length)
        self.precompiled = False  # `compile_buckets` ran: no step compiles
        multiple = self.update_config.row_multiple(self.data_parallel)
        self.rows = -(-config.rollout.prompts_per_step * config.rollout.num_samples // multiple) * multiple
        self.optimizer_config = optimizer_config(config, optimizer_updates(config, self.update_config))
        self.optimizer = make_optimizer(self.optimizer_config)
        self.skipped_steps = 0  # consecutive RL steps that skipped a non-finite update
        self.lora = lora_config(config)
        self.train_config = dataclasses.replace(self.model_config, lora=self.lora)
        started = time.perf_counter()
        self.graphdef, self.state, self.shardings = create_sharded_train_state(
            self.train_config, self.optimizer, self.mesh, seed=config.loop.seed)
        self.frozen, self.frozen_shardings = create_sharded_frozen(self.train_config, self.mesh,
                                                                   seed=config.loop.seed)
        jax.block_until_ready((self.state, self.frozen))
        self.build_seconds = time.perf_counter() - started  # the train state's (and LoRA base's) build, for the log
        self.reference = None  # a stored copy of the KL reference policy, when kl_coef > 0 without LoRA
        self.compiler_options = {"xla_backend_optimization_level": 0} if config.update.fast_compile else None
        # Every pass below (training, proximal, reference, sampler replay) traces its dots at this precision.
        self.matmul_precision = resolve_matmul_precision(config.model.matmul_precision, self.model_config.dtype)
        # LoRA's KL reference: the base's graph over the frozen arrays (the adapters off), not a copy
        reference_graphdef = (nnx.graphdef(nnx.eval_shape(lambda: Transformer(self.model_config, rngs=nnx.Rngs(0))))
                              if self.lora is not None and self.update_config.corrections.kl_coef > 0 else None)
        self.update_fn = make_update_fn(self.graphdef, self.optimizer, self.update_config, self.mesh,
                                        self.shardings, compiler_options=self.compiler_options,
                                        frozen_shardings=self.frozen_shardings, reference_graphdef=reference_graphdef,
                                        matmul_precision=self.matmul_precision)
        replicated = NamedSharding(self.mesh, P())
        self.proximal_fn = jax.jit(with_matmul_precision(
            lambda params, frozen, batch: recompute_logprobs(self.graphdef, params, batch, self.update_config,
                                                             self.mesh, frozen),
            self.matmul_precision), out_shardings=replicated, compiler_options=self.compiler_options)
        self.rebuild_fn = jax.jit(with_matmul_precision(self._rebuild, self.matmul_precision),
                                  out_shardings=(batch_sharding(self.mesh), replicated),
                                  compiler_options=self.compiler_options)

    def describe_state(self) -> str:
        """The start-up line on the train state (`describe_train_state`)."""
        return describe_train_state(self.state.params, self.train_config, self.build_seconds)

    @property
    def policy_version(self) -> int:
        return int(self.state.policy_version)

    @property
    def uses_reference(self) -> bool:
        """Whether the run keeps a copy of the KL reference policy (LoRA's is the frozen base itself)."""
        return self.update_config.corrections.kl_coef > 0 and self.lora is None

    def device_batch(self, batch: TrainBatch) -> TrainBatch:
        """Host batch (the same on every process) -> global arrays sharded over the batch axes."""
        sharding = batch_sharding(self.mesh)
        return jax.tree.map(
            lambda x: jax.make_array_from_callback(np.shape(x), sharding, lambda index: np.asarray(x)[index]), batch)

    @property
    def bucket_lengths(self) -> list[int]:
        """The update's lengths, shortest first (`update_buckets`)."""
        return bucket_lengths(self.buckets)

    def fit(self, batch: TrainBatch) -> TrainBatch:
        """A host batch of ``length`` columns cut to the shortest bucket that holds its longest row."""
        return pad_batch(batch, self.buckets)

    def compile_buckets(self, batch: TrainBatch, raw_logprobs: bool = False) -> None:
        """Compiles the programs a step runs (`train`) for every bucket length, ``batch`` giving the structure and
        dtypes (its values are not used), so that no step compiles; the calls then find them in JAX's cache."""
        for length in self.bucket_lengths:
            device_batch = self.device_batch(cut_batch(batch, length))
            if raw_logprobs:
                self.rebuild_fn.lower(self.state.params, self.frozen, device_batch).compile()
            if self.update_config.corrections.mode == "bypass":
                self.proximal_fn.lower(self.state.params, self.frozen, device_batch).compile()
            self.update_fn.lower(self.state, device_batch, self.reference, self.frozen).compile()
        self.precompiled = True

    def train(self, batch: TrainBatch, raw_logprobs: bool = False) -> tuple[dict[str, float], np.ndarray]:
        """One RL update on a host batch; returns the mean metrics and the proximal logprobs (for the log).

        ``raw_logprobs``: the batch's rollout logprobs are RAW of the sampler in ``batch.sampling``; they are rebuilt
        as the sampling distribution's under the pre-update weights (the weights that sampled: staleness 0), and
        the kept mass (``sampler/log_kept_mass_*``) is added to the metrics.
        """
        device_batch = self.device_batch(batch)
        bias = {}
        if raw_logprobs:
            rollout_logprobs, bias = self.rebuild_fn(self.state.params, self.frozen, device_batch)
            device_batch = device_batch.replace(rollout_logprobs=rollout_logprobs)
        # The update recomputes the proximal logprobs in decoupled mode and returns them; bypass mode needs a pass.
        proximal = (self.proximal_fn(self.state.params, self.frozen, device_batch)
                    if self.update_config.corrections.mode == "bypass" else None)
        skipped = int(skipped_updates(self.state.opt_state))
        self.state, metrics, recomputed = self.update_fn(self.state, device_batch, self.reference, self.frozen)
        self.skipped_steps = self.skipped_steps + 1 if int(skipped_updates(self.state.opt_state)) > skipped else 0
        return mean_metrics(metrics) | mean_metrics(bias), np.asarray(recomputed if proximal is None else proximal)

    def _rebuild(self, params: nnx.State, frozen: nnx.State | None, batch: TrainBatch
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """RAW rollout logprobs -> the sampling distribution's at ``params``, and the kept-mass metrics."""
        graphdef, params = nnx.split(merge_model(self.graphdef, params, frozen))
        rebuilt = rebuild_batch_logprobs(graphdef, params, batch, chunk_size=self.update_config.logprob_chunk_size)
        return rebuilt["rollout_logprobs"], truncation_bias_metrics(rebuilt["log_kept_mass"], batch.loss_mask)

    def all_finite(self) -> bool:
        """Whether every float of the checkpoint tree (parameters, optimizer state, reference) is finite: one
        jitted reduction, one scalar to the host."""
        return bool(self._all_finite(self.checkpoint_tree()))

    @functools.cached_property
    def _all_finite(self):
        def finite(tree):
            leaves = [jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(tree)
                      if jnp.issubdtype(leaf.dtype, jnp.inexact)]
            return jnp.all(jnp.stack(leaves))

        return jax.jit(finite, out_shardings=NamedSharding(self.mesh, P()))

    def checkpoint_tree(self):
        """What a checkpoint holds: the train state, and the reference parameters when the KL term needs them."""
        return {"train": self.state, "reference": self.reference} if self.uses_reference else self.state

    def restore(self, checkpointer: Checkpointer, data_position) -> tuple[int, dict]:
        """Restores the latest checkpoint (state, reference, data position); returns its step and metadata."""
        target = restore_target(self.state, self.shardings)
        if self.uses_reference:
            target = {"train": target, "reference": restore_target(self.state.params, self.shardings.params)}
        restored = checkpointer.restore(target, data_iterator=data_position)
        if self.uses_reference:
            self.state, self.reference = restored.state["train"], restored.state["reference"]
        else:
            self.state = restored.state
        return restored.step, restored.metadata

    def start_fresh(self, on_warmup_step: Callable[[int, float], None] | None = None) -> list[float]:
        """A new run's initial policy: the HF checkpoint's weights (if configured), then the warm-up.

        Freezes the reference policy (the starting point of RL) when the KL term needs it. Returns the warm-up's
        losses; ``on_warmup_step(step, loss)`` sees each (a progress bar).
        """
        self.load_hf_weights()
        losses = self.warm_up(on_warmup_step)
        if self.uses_reference:
            self.reference = jax.jit(lambda p: jax.tree.map(lambda x: x.copy(), p),
                                     out_shardings=self.shardings.params)(self.state.params)
        return losses

    def load_hf_weights(self) -> None:
        """Replaces the random initial parameters with the Hugging Face checkpoint's, when configured.

        The loaded weights are a new policy version, so the first publish pushes them to a server that was started
        from the seed's random weights (version 0).
        """
        if self.config.model.hf_path:
            # Shapes only: load_safetensors sets every parameter (and raises on a missing one).
            model = nnx.eval_shape(lambda: Transformer(self.model_config, rngs=nnx.Rngs(self.config.loop.seed)))
            load_safetensors(model, self.config.model.hf_path)
            if self.lora is not None:  # the weights are the frozen base's; the adapters keep their init
                self.frozen = jax.device_put(nnx.state(model), self.frozen_shardings)
                self.state = self.state.replace(policy_version=self.state.policy_version + 1)
                return
            self.state = self.state.replace(params=jax.device_put(nnx.state(model), self.shardings.params),
                                            policy_version=self.state.policy_version + 1)

    def warm_up(self, on_step: Callable[[int, float], None] | None = None) -> list[float]:
        """Supervised warm-up: cross entropy on noisy demonstrations through the update step; returns the losses
        (``on_step(step, loss)`` sees each as it comes).

        It runs on its own optimizer (constant learning rate, corrections objective ``cross_entropy``); the RL
        optimizer state starts fresh afterwards. Each call advances the policy version by one, as an RL update.
        """
        warmup = self.config.warmup
        if warmup.steps == 0:
            return []
        optimizer = make_optimizer(warmup_optimizer_config(self.config))
        # Every token of a demonstration scored: a dataset's answers may be longer than the rollouts' budget.
        sft_config = dataclasses.replace(self.update_config, num_minibatches=1, ppo_epochs=1, scored_window=None,
                                         corrections=corrections.CorrectionConfig(
                                             mode="bypass", objective=corrections.Objective(name="cross_entropy")))
        state = self.state.replace(opt_state=optimizer.init(self.state.params))
        update = make_update_fn(self.graphdef, optimizer, sft_config, self.mesh,
                                train_state_shardings(state, optimizer, self.mesh),
                                compiler_options=self.compiler_options, frozen_shardings=self.frozen_shardings,
                                matmul_precision=self.matmul_precision)
        rng = np.random.default_rng((self.config.task.seed, 1))
        losses = []
        for step in range(1, warmup.steps + 1):
            batch = demonstration_batch(self.task, rng, warmup.batch_size, warmup.noise, self.length,
                                        sft_config.row_multiple(self.data_parallel))
            state, metrics, _ = update(state, self.device_batch(batch), None, self.frozen)
            losses.append(mean_metrics({"loss": metrics["actor/pg_loss"]})["loss"])
            if on_step is not None:
                on_step(step, losses[-1])
        self.state = jax.jit(lambda s: s.replace(opt_state=self.optimizer.init(s.params)),
                             out_shardings=self.shardings)(state)
        return losses

    def host_weights(self, dtype: str | None = None) -> dict[str, np.ndarray]:
        """The parameters as ``{path: array}`` in the engine's naming, gathered from every process (`host_arrays`:
        cast to ``dtype`` on the device first); with LoRA the base's, the adapters merged into their kernels
        (`learner.model.lora.merge_adapters`)."""
        if self.lora is None:
            return host_arrays(self.state.params, dtype)
        merged = merge_adapters(host_arrays(self.frozen) | host_arrays(self.state.params), self.lora.scale)
        return merged if dtype is None else {name: array.astype(dtype) for name, array in merged.items()}

    def host_adapters(self) -> dict[str, np.ndarray]:
        """The LoRA adapters as ``{path: array}``, gathered from every process (empty without LoRA)."""
        return {} if self.lora is None else host_arrays(self.state.params)


@functools.partial(jax.jit, static_argnames="dtype")
def _cast(tree, dtype: str):
    return jax.tree.map(lambda leaf: leaf.astype(dtype), tree)


def host_arrays(params, dtype: str | None = None) -> dict[str, np.ndarray]:
    """``params`` as host ``{parameter path: array}`` (`learner.model.param_paths`), gathered from every process.

    ``dtype`` (e.g. the engine's serving dtype): cast on the device first, in one jitted program, so the host copy
    moves no more bytes than the engine keeps. One process: every copy is started before the first is awaited
    (`jax.device_get`), so they overlap.
    """
    if dtype is not None and any(leaf.dtype != dtype for leaf in jax.tree.leaves(params)):
        params = _cast(params, dtype)
    if jax.process_count() == 1:
        leaves = jax.device_get(jax.tree.leaves(params))
    else:
        leaves = jax.tree.leaves(multihost_utils.process_allgather(params, tiled=True))
    names, _ = parameter_names(params)
    return {name: np.asarray(leaf) for name, leaf in zip(names, leaves)}
