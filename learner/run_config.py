"""The configuration of a training run: nested dataclasses, loaded from TOML with command-line overrides.

A run is configured by one TOML file (``configs/*.toml``) whose tables mirror the dataclasses below, plus any
number of ``--set section.field=value`` overrides (the value is parsed as a TOML value, falling back to a bare
string: ``--set loop.steps=50 --set corrections.preset=decoupled_geo_rs_token_tis``). Every field is checked when
the config is built, and an error names the field (``loop.steps=-1: must be an int >= 1``); unknown fields are
rejected the same way.
"""

from __future__ import annotations

import dataclasses
import pathlib
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """The policy model."""

    name: str = "tiny"  # learner.model.model_config name; ignored when hf_path is set.
    hf_path: str | None = None  # Hugging Face checkpoint directory (config.json + *.safetensors) to start from.
    param_dtype: str = "float32"  # learner parameter dtype.


@dataclasses.dataclass(frozen=True)
class TaskSection:
    """The verifiable task (learner.tasks) and its prompt stream."""

    name: str = "addition_1digit"  # learner.tasks.get_task name.
    num_prompts: int = 4096  # records in the prompt dataset (prompt_example(task, seed, i) for i < num_prompts).
    seed: int = 0  # prompt stream and shuffle seed.


@dataclasses.dataclass(frozen=True)
class WarmupSection:
    """Supervised warm-up on noisy demonstrations, through the same update step (objective cross_entropy)."""

    steps: int = 20  # update calls; 0 skips the warm-up (start from the initial weights).
    batch_size: int = 64  # demonstrations per update call.
    noise: float = 0.5  # probability that each answer character of a demonstration is replaced at random.
    learning_rate: float = 3e-3  # constant AdamW learning rate of the warm-up.


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    """What the inference server is asked to sample."""

    prompts_per_step: int = 16  # groups (requests) per rollout batch.
    num_samples: int = 8  # completions per prompt: the GRPO group size.
    temperature: float = 1.0  # sampling temperature (the learner's logprobs use the same one).
    top_k: int = 0  # keep the k most likely tokens; 0: off.
    top_p: float = 1.0  # keep the smallest set with this much mass; 1: off.
    min_p: float = 0.0  # keep tokens with probability >= min_p * the largest; 0: off.
    max_new_tokens: int | None = None  # None: the task's longest correct completion.
    logprob_mode: str = "processed"  # "raw" or "processed"; checked against the server's echo at start.
    max_staleness: int = 1  # rollouts run this many updates ahead (sampled while the learner trains); 0: synchronous.
    # Wait for the in-flight rollouts before publishing new weights, so that (after the first max_staleness steps)
    # every sample is exactly max_staleness versions old, however fast the server is: reproducible lag for studies.
    fixed_staleness: bool = False


@dataclasses.dataclass(frozen=True)
class ServerSection:
    """The inference server: embedded (started here) unless ``address`` is set."""

    address: str | None = None  # "host:port" of an external server; None starts the reference server.
    dtype: str = "float32"  # embedded server's compute dtype (bfloat16 against a float32 learner: real mismatch).
    max_batch_size: int = 64  # embedded server's KV-cache rows.
    decode_steps_per_call: int = 4  # embedded server's decode steps per jitted call.
    auth_token_env: str | None = None  # environment variable holding the shared token, if the server needs one.
    start_timeout_s: float = 180.0  # how long to wait for the embedded server to bind and serve.
    generate_deadline_s: float = 30.0  # one Generate attempt's deadline (+ 0.05 s per max_new_tokens); 5 attempts.


@dataclasses.dataclass(frozen=True)
class OptimizerSection:
    """AdamW of the RL updates (learner.optimizer.OptimizerConfig)."""

    learning_rate: float = 1e-3  # peak learning rate.
    warmup_steps: int = 0  # linear warmup, in optimizer updates.
    max_grad_norm: float = 1.0  # global-norm clip.
    weight_decay: float = 0.0  # decoupled weight decay.


@dataclasses.dataclass(frozen=True)
class UpdateSection:
    """How a rollout batch becomes optimizer updates (learner.update.UpdateConfig)."""

    num_minibatches: int = 1  # optimizer updates per epoch.
    num_microbatches: int = 1  # gradient-accumulation steps per mini-batch.
    ppo_epochs: int = 1  # passes over the batch.
    logprob_chunk_size: int = 512  # tokens per chunk of the output projection.
    fast_compile: bool = False  # XLA backend optimisation level 0: faster compiles, slower steps (tests).


@dataclasses.dataclass(frozen=True)
class CorrectionsSection:
    """The off-policy corrections: a named preset with optional overrides (corrections.preset)."""

    preset: str = "decoupled_token_is"  # corrections.PRESETS name.
    overrides: dict = dataclasses.field(default_factory=dict)  # preset(name, **overrides), e.g. {kl_coef = 0.0}.


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """The device mesh (learner.sharding.make_mesh); one size may be -1 (the remaining devices)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    cpu_devices: int = 0  # > 0: simulate this many CPU devices per process (jax_num_cpu_devices); CPU only.


@dataclasses.dataclass(frozen=True)
class DistributedSection:
    """Multi-process start (learner.distributed.initialize); all None: auto-detect or single process."""

    coordinator: str | None = None  # "host:port" of process 0.
    num_processes: int | None = None
    process_id: int | None = None


@dataclasses.dataclass(frozen=True)
class LoopSection:
    """Length of the run and how often it checkpoints."""

    steps: int = 60  # RL steps (rollout batches trained on).
    seed: int = 0  # model init and update PRNG seed.
    checkpoint_every: int = 10  # RL steps between checkpoints (the last step is always saved).
    keep_checkpoints: int = 2  # most recent checkpoints kept.
    plot_every: int = 10  # RL steps between refreshes of the learning-curve PNG.


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
    loop: LoopSection = LoopSection()

    def __post_init__(self):
        _check(self)


_POSITIVE = {"task.num_prompts", "warmup.batch_size", "rollout.prompts_per_step", "rollout.num_samples",
             "rollout.max_new_tokens", "server.max_batch_size", "server.decode_steps_per_call",
             "update.num_minibatches", "update.num_microbatches", "update.ppo_epochs", "update.logprob_chunk_size",
             "loop.steps", "loop.checkpoint_every", "loop.keep_checkpoints", "loop.plot_every",
             "distributed.num_processes", "server.start_timeout_s", "server.generate_deadline_s",
             "rollout.temperature"}
_NON_NEGATIVE = {"warmup.steps", "rollout.max_staleness", "optimizer.learning_rate", "optimizer.warmup_steps",
                 "optimizer.weight_decay", "warmup.learning_rate", "mesh.cpu_devices", "distributed.process_id",
                 "optimizer.max_grad_norm", "rollout.top_k", "rollout.min_p"}
_CHOICES = {"rollout.logprob_mode": ("raw", "processed"), "server.dtype": ("float32", "bfloat16", "float16"),
            "model.param_dtype": ("float32", "bfloat16")}


def _check(config: RunConfig) -> None:
    """Value checks beyond types; each error names its field."""
    import corrections

    flat = dict(_flatten(config))
    for name in _POSITIVE | _NON_NEGATIVE:
        value, bound = flat[name], 0
        if value is not None and (value < bound or (name in _POSITIVE and value == bound)):
            raise ValueError(f"{name}={value!r}: must be {'>' if name in _POSITIVE else '>='} {bound}")
    for name, options in _CHOICES.items():
        if flat[name] not in options:
            raise ValueError(f"{name}={flat[name]!r}: must be one of {', '.join(options)}")
    if not 0 < config.rollout.top_p <= 1:
        raise ValueError(f"rollout.top_p={config.rollout.top_p!r}: must be in (0, 1]")
    if not config.rollout.min_p <= 1:
        raise ValueError(f"rollout.min_p={config.rollout.min_p!r}: must be in [0, 1]")
    if not 0 <= config.warmup.noise <= 1:
        raise ValueError(f"warmup.noise={config.warmup.noise!r}: must be in [0, 1]")
    if config.rollout.num_samples < 2:
        raise ValueError(f"rollout.num_samples={config.rollout.num_samples}: GRPO needs groups of >= 2 samples")
    if config.corrections.preset not in corrections.PRESETS:
        raise ValueError(f"corrections.preset={config.corrections.preset!r}: not one of corrections.PRESETS "
                         f"({', '.join(corrections.PRESETS)})")
    try:
        corrections.preset(config.corrections.preset, **config.corrections.overrides)
    except (TypeError, ValueError) as error:
        raise ValueError(f"corrections.overrides: {error}") from None


def _flatten(config, prefix: str = ""):
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            yield from _flatten(value, f"{prefix}{field.name}.")
        else:
            yield f"{prefix}{field.name}", value


def _accepts(annotation, value) -> bool:
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


def _build(cls, data: Mapping[str, Any], prefix: str):
    """``cls`` from nested plain data; unknown fields and wrong types raise ValueError naming the field."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{prefix.rstrip('.') or 'config'}: expected a table, got {data!r}")
    fields = {field.name: field for field in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{prefix}{unknown[0]}: unknown field; known: {', '.join(fields)}")
    hints = typing.get_type_hints(cls)
    values = {}
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


def _apply(data: dict, path: list[str], value) -> None:
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
    ValueError: loop.stepz: unknown field; known: steps, seed, checkpoint_every, keep_checkpoints, plot_every
    >>> load_config(None, ["server.generate_deadline_s=0"])
    Traceback (most recent call last):
    ...
    ValueError: server.generate_deadline_s=0.0: must be > 0
    """
    data = tomllib.loads(pathlib.Path(path).read_text()) if path is not None else {}
    for override in overrides:
        _apply(data, *parse_override(override))
    return _build(RunConfig, data, "")


def to_dict(config: RunConfig) -> dict:
    """Plain data of a config (stored with every checkpoint)."""
    return dataclasses.asdict(config)
