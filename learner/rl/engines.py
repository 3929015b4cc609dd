"""The inference engine of a run, built from the ``server`` section, and what the run requires of it."""

from __future__ import annotations

import os
import pathlib
import secrets

from rollout_client import (Engine, EngineInfo, EngineProcess, EngineRequirements, LogprobMode, PauseMode,
                            TetherEngine, check_capabilities)
from rollout_client.server.cli import AUTH_TOKEN_ENV

from learner.rl.config import RunConfig, client_config

ENGINES = {"tether": TetherEngine}  # server.engine -> backend


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
    """Connects to ``server.address``, or launches the reference server (log: ``run_dir/server.log``) and connects.

    The launched server requires a random token of this run, handed over in its environment.

    Refuses an engine that cannot honour the run (`rollout_client.check_capabilities`) before launching anything.
    """
    backend = ENGINES[config.server.engine]
    check_capabilities(config.server.engine, backend.capabilities, requirements(config))
    token = os.environ.get(config.server.auth_token_env) if config.server.auth_token_env else None
    process = None
    if config.server.address is None:
        token = secrets.token_urlsafe(32)  # Per run: no other local user can drive the embedded server.
        process = EngineProcess("learner.serving", reference_server_args(config, trainer, eos_ids),
                                run_dir / "server.log", config.server.start_timeout_s, env={AUTH_TOKEN_ENV: token})
    target = config.server.address or process.address
    return backend(client_config(config, target, auth_token=token, vocab_size=trainer.model_config.vocab_size),
                   process=process)


def check_identity(info: EngineInfo, vocab_size: int, address: str) -> None:
    """The engine must not sample token ids the learner cannot embed."""
    if info.vocab_size > vocab_size:
        raise ValueError(f"the engine at {address} has a vocabulary of {info.vocab_size} tokens, the learner's model "
                         f"{vocab_size}: it could sample ids the learner cannot train on; serve the same model")
