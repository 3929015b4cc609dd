"""The inference engine of a run, built from the ``server`` section, and what the run requires of it.

``server.engine`` picks the backend (`ENGINES`):

- ``"tether"``: the rollout.v1 reference server, launched here (``python -m learner.serving``) unless
  ``server.address`` names one.
- ``"mlx"``: the MLX servicer, always launched here (weights are published by restarting it on a new checkpoint
  directory under ``server.weights_dir``, written by `learner.hf_checkpoint.write_hf_checkpoint`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import secrets

from rollout_client import (Engine, EngineInfo, EngineProcess, EngineRequirements, LogprobMode, MlxEngine,
                            ModelIdentity, PauseMode, TetherEngine, check_capabilities)
from rollout_client.request_guards import check_model_identity
from rollout_client.server.cli import AUTH_TOKEN_ENV

from learner.hf_checkpoint import write_hf_checkpoint
from learner.rl.config import RunConfig, client_config
from learner.safetensors_io import config_to_hf

ENGINES = {"tether": TetherEngine, "mlx": MlxEngine}  # server.engine -> backend


def requirements(config: RunConfig) -> EngineRequirements:
    """What the run's ``rollout`` section asks of an engine."""
    rollout = config.rollout
    used = {"temperature": rollout.temperature != 1, "top_k": rollout.top_k > 0, "top_p": rollout.top_p < 1,
            "min_p": rollout.min_p > 0}
    return EngineRequirements(logprob_mode=LogprobMode[rollout.logprob_mode.upper()],
                              sampler_steps=tuple(step for step, on in used.items() if on),
                              pause_mode=PauseMode.KEEP, max_staleness=rollout.max_staleness)


def reference_server_args(config: RunConfig, trainer, eos_ids) -> list[str]:
    """The command line of the embedded reference server (``python -m learner.serving``) for this run."""
    return ["--model-config", config.model.name, "--dtype", config.server.dtype,
            "--eos-ids", *map(str, eos_ids), "--max-batch-size", str(config.server.max_batch_size),
            "--max-seq-len", str(trainer.length), "--decode-steps-per-call", str(config.server.decode_steps_per_call),
            "--seed", str(config.loop.seed)]


def build_engine(config: RunConfig, trainer, eos_ids, run_dir: pathlib.Path) -> Engine:
    """The run's engine, connected: ``server.address``, or one launched here (log: ``run_dir/server.log``).

    The launched reference server requires a random token of this run, handed over in its environment. The MLX
    engine starts on the learner's current weights; its model is checked against the learner's
    (`rollout_client.request_guards.check_model_identity`).

    Refuses an engine that cannot honour the run (`rollout_client.check_capabilities`) before launching anything.
    """
    name = config.server.engine
    if name not in ENGINES:
        raise ValueError(f"server.engine={name!r}: no backend yet; available: {', '.join(ENGINES)}")
    backend = ENGINES[name]
    check_capabilities(name, backend.capabilities, requirements(config))
    if name == "mlx":
        return _launch_mlx(config, trainer, eos_ids, run_dir)
    token = os.environ.get(config.server.auth_token_env) if config.server.auth_token_env else None
    process = None
    if config.server.address is None:
        token = secrets.token_urlsafe(32)  # Per run: no other local user can drive the embedded server.
        process = EngineProcess("learner.serving", reference_server_args(config, trainer, eos_ids),
                                run_dir / "server.log", config.server.start_timeout_s, env={AUTH_TOKEN_ENV: token})
    target = config.server.address or process.address
    return backend(client_config(config, target, auth_token=token, vocab_size=trainer.model_config.vocab_size),
                   process=process)


def _launch_mlx(config: RunConfig, trainer, eos_ids, run_dir: pathlib.Path) -> MlxEngine:
    """Starts the MLX engine on a checkpoint of the learner's current weights, with the task's tokenizer."""
    if config.server.address is not None:
        raise ValueError(f"server.address={config.server.address!r}: the mlx engine takes new weights by restart, "
                         "so Tether launches it; unset server.address")
    tokenizer = trainer.task.tokenizer
    if not hasattr(tokenizer, "save_pretrained"):
        tokenizer = config.model.hf_path  # its tokenizer files
    if tokenizer is None:
        raise ValueError(f"server.engine='mlx' loads a Hugging Face tokenizer: task {config.task.name!r}'s tokenizer "
                         "has no save_pretrained and model.hf_path is unset")
    writer = functools.partial(write_hf_checkpoint, config=trainer.model_config, tokenizer=tokenizer,
                               eos_token_ids=tuple(eos_ids), overwrite=True)
    client = client_config(config, "127.0.0.1:0", auth_token=None, vocab_size=trainer.model_config.vocab_size)
    engine = MlxEngine(dataclasses.replace(client, ready_timeout_s=config.server.start_timeout_s), writer,
                       config.server.weights_dir or run_dir / "engine_weights", trainer.policy_version,
                       trainer.host_weights(), keep_weight_versions=config.server.keep_weight_versions,
                       log_path=run_dir / "server.log", max_batch_size=config.server.max_batch_size)
    try:
        check_model_identity(engine.model_identity(), learner_identity(trainer.model_config), engine.address)
    except BaseException:
        engine.close()
        raise
    return engine


def learner_identity(model_config) -> ModelIdentity:
    """The learner's model as an engine would report it (the config.json it exports)."""
    return ModelIdentity.from_hf_config(config_to_hf(model_config))


def check_identity(info: EngineInfo, vocab_size: int, address: str) -> None:
    """The engine's logprobs must be a softmax over the learner's vocabulary."""
    check_model_identity(ModelIdentity(vocab_size=info.vocab_size), ModelIdentity(vocab_size=vocab_size), address)
