"""Checks before anything trains: what the config names exists and answers, so a bad run fails in seconds, before
the warm-up, with one `ConfigError` naming the key and the fix.

* `check_paths_and_names` (before JAX starts): the named model, ``model.hf_path``, the mesh sizes and a multi-process
  start's coordinator;
* `probe_engines` (before the warm-up): every ``server.address`` (``host:port`` or ``unix:path``) answers as a gRPC
  server (any status but UNAVAILABLE: an HTTP server, a closed port or a missing socket is refused);
* `probe_rewards` (before the first rollout): each reward called once on a real prompt record (a batched one on two),
  so a reward with the wrong signature, one that returns None, or a batched one returning the wrong count, is found
  at start rather than at RL step 1;
* `check_lora` (before the train state): ``model.lora``'s targets match projections of the layers, its rank fits
  each of them, and the engine takes its publish mode;
* `model_shape`: what of a model's config fixes its arrays' shapes (a resume compares the checkpoint's).
"""

from __future__ import annotations

import math
import os
import pathlib
import socket
from typing import TYPE_CHECKING

import grpc
from flax import nnx
from grpc_health.v1 import health_pb2

from learner.checkpoints.hf_checkpoint import model_config_from_checkpoint
from learner.distributed import cluster_detected
from learner.model.lora import adapter_shapes, adapter_targets
from learner.model.transformer import Projection, Transformer, model_config
from learner.rl.config import engine_addresses, lora_config
from learner.rl.rollout_engines import publishes_adapters
from rollout_client.protocol import bearer, pb, pb_grpc
from rollout_client.request_guards import ModelIdentity, check_model_identity

if TYPE_CHECKING:
    from learner.rl.config import RunConfig

PROBE_TIMEOUT_S = 10.0  # per engine address: connecting is quick, a wrong address fails at once or times out


class ConfigError(ValueError):
    """A config value that cannot work here; the message names the key and the fix."""


def check_paths_and_names(config: RunConfig) -> None:
    """The model, the mesh and the distributed start the config names are possible (no JAX call)."""
    model = config.model
    if model.hf_path is None:
        try:
            model_config(model.name)
        except ValueError as error:
            raise ConfigError(f"model.name: {error} (or set model.hf_path to a Hugging Face checkpoint "
                              "directory)") from None
    if model.hf_path is not None and not (pathlib.Path(model.hf_path) / "config.json").is_file():
        raise ConfigError(f"model.hf_path={model.hf_path!r}: no config.json there; give a Hugging Face checkpoint "
                          "directory (config.json + *.safetensors)")
    mesh = config.mesh
    sizes = {"mesh.data": mesh.data, "mesh.fsdp": mesh.fsdp, "mesh.tensor": mesh.tensor}
    bad = [f"{key}={value}" for key, value in sizes.items() if value == 0 or value < -1]
    if bad or list(sizes.values()).count(-1) > 1:
        raise ConfigError(f"{', '.join(bad or [f'{k}={v}' for k, v in sizes.items()])}: each mesh size is a "
                          "positive device count, or -1 (the remaining devices) for at most one of them")
    distributed = config.distributed
    if (distributed.num_processes or 1) > 1 and distributed.coordinator is None and not cluster_detected():
        raise ConfigError(f"distributed.num_processes={distributed.num_processes}: needs distributed.coordinator "
                          "(--coordinator host:port of process 0) and distributed.process_id (--process-id) on "
                          "each process, unless a cluster (SLURM, Open MPI, Cloud TPU) provides them")


def probe_engines(config: RunConfig, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Every ``server.address`` answers a gRPC call: a health check, whose answer (SERVING, UNIMPLEMENTED,
    UNAUTHENTICATED, ...) does not matter, only that a gRPC server gave it."""
    for address in engine_addresses(config):
        if not address.startswith("unix:"):
            host, _, port = address.rpartition(":")
            try:
                socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
            except OSError as error:
                raise ConfigError(f"server.address: cannot reach {address} ({error or type(error).__name__}); "
                                  "start the engine there, or fix server.address (leave it out to launch the "
                                  "embedded server)") from None
        if problem := _no_grpc_answer(address, timeout_s):
            raise ConfigError(f"server.address: no gRPC server answers at {address} ({problem}): is an engine "
                              "serving there (not an HTTP endpoint, and the socket path right)? Fix server.address, "
                              "or leave it out to launch the embedded server")
        if config.server.engine == "tether":  # a rollout.v1 server says its vocabulary: checked now, not after
            _check_vocabulary(config, address, timeout_s)


def _check_vocabulary(config: RunConfig, address: str, timeout_s: float) -> None:
    """An external rollout.v1 server's vocabulary is the learner's (`ModelMismatchError` otherwise); a server that
    does not answer GetServerInfo (e.g. it wants a token this run lacks) is left to the engine's own start."""
    token = os.environ.get(config.server.auth_token_env) if config.server.auth_token_env else None
    with grpc.insecure_channel(address) as channel:
        try:
            info = pb_grpc.RolloutServiceStub(channel).GetServerInfo(
                pb.GetServerInfoRequest(), timeout=timeout_s, metadata=bearer(token) if token else None)
        except grpc.RpcError:
            return
    learner = _architecture(config.model.hf_path, config.model.name).vocab_size
    check_model_identity(ModelIdentity(vocab_size=info.vocab_size), ModelIdentity(vocab_size=learner), address)


def _no_grpc_answer(address: str, timeout_s: float) -> str | None:
    """Why no gRPC server answered a health check at ``address`` within ``timeout_s``, or None if one did."""
    with grpc.insecure_channel(address) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                    request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                    response_deserializer=health_pb2.HealthCheckResponse.FromString)
        try:
            check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError as error:
            if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return f"{error.code().name}: {error.details()}"
    return None


def probe_rewards(task) -> None:
    """Calls each reward of a task with rewards (the ``dataset`` task: ``reward_set``) once, on its first training
    prompt record and an empty completion."""
    reward_set = getattr(task, "reward_set", None)
    if reward_set is None:
        return
    prompts = task.prompts()
    records = [prompts[i] for i in range(min(2, len(prompts)))]
    problem = reward_set.check_callable([""] * len(records), [record["prompt"] for record in records],
                                        [record["row"] for record in records])
    if problem:
        raise ConfigError(f"task.args.rewards: {problem} (called once on the first training prompts, before "
                          "training); fix the reward function")


def check_lora(config: RunConfig) -> None:
    """``model.lora`` can work on this model and engine, checked on the model's abstract shapes (nothing is built):
    its targets match attention or MLP projections of the layers, its rank is at most the smaller side of each
    targeted projection (a larger rank adds nothing and can exhaust any memory), and the engine takes its publish
    mode."""
    try:
        lora = lora_config(config)
        if lora is None:
            return
        publishes_adapters(config)
        base = nnx.eval_shape(lambda: Transformer(_architecture(config.model.hf_path, config.model.name),
                                                  rngs=nnx.Rngs(0)))
        targets = adapter_targets(base, lora, Projection)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    for path, projection in targets:
        sides = [math.prod(shape) for shape in adapter_shapes(projection)]
        if lora.rank > min(sides):
            raise ConfigError(f"model.lora.rank={lora.rank}: above {'/'.join(map(str, path))}'s {sides[0]} x "
                              f"{sides[1]} (a rank is at most the smaller side, here {min(sides)}); lower "
                              "model.lora.rank (8-64 is usual), or narrow model.lora.targets")


def model_shape(model: dict) -> tuple | None:
    """What of a config's ``model`` section (as saved in a checkpoint) fixes the shapes of its arrays: the
    architecture's sizes and the adapters' rank and targets; None where the architecture cannot be read (a
    ``model.hf_path`` no longer there)."""
    try:
        architecture = _architecture(model.get("hf_path"), model.get("name", "tiny"))
    except (ValueError, OSError):
        return None
    lora = model.get("lora") or {}
    sizes = tuple(getattr(architecture, name) for name in ("vocab_size", "hidden_size", "intermediate_size",
                                                           "num_layers", "num_heads", "num_kv_heads", "head_dim",
                                                           "tie_embeddings", "qkv_bias", "qk_norm"))
    return sizes, lora.get("rank", 0), tuple(lora.get("targets", ())) if lora.get("rank", 0) else ()


def _architecture(hf_path: str | None, name: str):
    return model_config_from_checkpoint(hf_path) if hf_path else model_config(name)
