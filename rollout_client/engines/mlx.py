"""The MLX engine: ``smg_grpc_servicer.mlx.server`` (mlx-lm behind the smg MLX proto), launched and supervised here.

The MLX servicer loads a Hugging Face checkpoint directory once and has no weight-update RPC, so new weights are
published by restart: the learner's weights are written as a new checkpoint directory (``weights_dir/v<version>``,
atomically by the ``write_checkpoint`` callback), the engine is stopped and started on it (same port, so the
client's channel reconnects), and once it is healthy and serves the same model, requests are admitted again and
stamped with the new version. Old directories are deleted, keeping the newest ``keep_weight_versions`` (always
the one served).

What it honours (`MLX_CAPABILITIES`): RAW logprobs only (log-softmax of the logits, before temperature and
truncation); its sampler applies top-p, min-p and top-k to the temperature-1 logprobs, then the temperature; no
``n`` (one request per sample); the seed is not honoured; no versions (the client stamps them), so rollouts must be
synchronous (``rollout.max_staleness = 0``).

Every request is checked first (`rollout_client.request_guards`): the engine does not validate its input.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import pathlib
import time
from collections.abc import Mapping

import numpy as np

from rollout_client.client import ClientConfig
from rollout_client.engines.base import Engine, EngineCapabilities, EngineInfo, VersionReporting, WeightTransport
from rollout_client.engines.process import EngineProcess, free_port
from rollout_client.engines.smg.client import SmgClient
from rollout_client.engines.smg.dialects import MLX
from rollout_client.engines.weight_dirs import CheckpointWriter, collect_garbage, version_dir
from rollout_client.request_guards import ModelIdentity, PromptLimits, check_model_identity, check_request
from rollout_client.sampling_params import LogprobMode

__all__ = ["MLX_CAPABILITIES", "MLX_SERVER_MODULE", "MlxEngine"]

MLX_SERVER_MODULE = "smg_grpc_servicer.mlx.server"
MLX_CAPABILITIES = EngineCapabilities(
    logprob_modes=frozenset({LogprobMode.RAW}),
    sampler_order=("top_p", "min_p", "top_k", "temperature"),
    pause_modes=frozenset(),
    weight_transport=WeightTransport.RESTART,
    version_reporting=VersionReporting.NONE,
    native_n=False,
    honours_seed=False,
)


class MlxEngine(Engine):
    """Launches the MLX server on the learner's weights and connects to it.

    Args:
      config: how patient the client is; its ``target`` is ignored (the engine listens where this object starts it,
        on 127.0.0.1), its ``ready_timeout_s`` bounds every start. ``config.validation.vocab_size``: the learner's
        vocabulary (prompt ids must lie below it).
      write_checkpoint: writes a checkpoint directory (`CheckpointWriter`).
      weights_dir: where the version directories go.
      policy_version, weights: what the engine starts serving.
      keep_weight_versions: version directories kept (>= 1; the served one always).
      log_path: the server's log (appended, across restarts).
      max_batch_size: sequences the engine decodes together (its ``--completion-batch-size``); None: its default.

    Raises:
      EngineExitedError: the server exited while starting (names address, exit code, log).
      ServerNotReadyError: it was not healthy within ``config.ready_timeout_s``.
    """

    name = "mlx"
    capabilities = MLX_CAPABILITIES

    def __init__(self, config: ClientConfig, write_checkpoint: CheckpointWriter, weights_dir: str | os.PathLike,
                 policy_version: int, weights: Mapping[str, np.ndarray], *, keep_weight_versions: int = 2,
                 log_path: str | os.PathLike, max_batch_size: int | None = None):
        if keep_weight_versions < 1:
            raise ValueError(f"keep_weight_versions={keep_weight_versions}: must be >= 1 (the served directory)")
        self._write_checkpoint = write_checkpoint
        self.weights_dir = pathlib.Path(weights_dir)
        self.keep_weight_versions = keep_weight_versions
        self.log_path = pathlib.Path(log_path)
        self._server_args = [] if max_batch_size is None else ["--completion-batch-size", str(max_batch_size)]
        self.config = dataclasses.replace(config, target=f"127.0.0.1:{free_port()}")
        self.policy_version = policy_version
        self.process = self.client = None
        self._publish_metrics: dict[str, float] = {}
        try:
            self.served_dir = self._write(policy_version, weights)
            self.process = self._launch(self.served_dir)
            self.client = SmgClient(self.config, MLX, check_alive=self._check_alive)
            self.client.release(policy_version)
            self._identity = self.model_identity()
        except BaseException:
            self.close()
            raise
        collect_garbage(self.weights_dir, self.served_dir, self.keep_weight_versions)

    @property
    def address(self) -> str:
        return self.config.target

    @property
    def limits(self) -> PromptLimits:
        """What prompts must respect: the learner's and the engine's vocabulary, the engine's context."""
        info = self.client.model_info
        return PromptLimits.of(self.config.validation.vocab_size, info.vocab_size, info.max_context_length)

    def _check_alive(self) -> None:
        self.process.check_alive()

    def _launch(self, checkpoint: pathlib.Path) -> EngineProcess:
        port = int(self.address.rsplit(":", 1)[1])
        return EngineProcess(MLX_SERVER_MODULE, ["--model", str(checkpoint), *self._server_args], self.log_path,
                             port=port, env={"HF_HUB_OFFLINE": "1"})

    def _write(self, policy_version: int, weights: Mapping[str, np.ndarray]) -> pathlib.Path:
        directory = version_dir(self.weights_dir, policy_version)
        self._write_checkpoint(directory, weights)
        return directory

    def model_identity(self) -> ModelIdentity:
        """The served model: vocabulary, model_type and architectures as the engine reports them, and the shapes
        of the config.json it loaded."""
        info = self.client.model_info
        served = ModelIdentity.from_hf_config(json.loads((self.served_dir / "config.json").read_text()))
        return ModelIdentity(vocab_size=info.vocab_size, model_type=info.model_type,
                             architectures=tuple(info.architectures), shapes=served.shapes)

    def info(self) -> EngineInfo:
        reply = self.client.server_info()
        return EngineInfo(policy_version=self.policy_version, vocab_size=reply.vocab_size,
                          eos_token_ids=tuple(reply.eos_token_ids), max_seq_len=reply.max_seq_len,
                          model_identity=reply.model_config_hash)

    def submit(self, request) -> concurrent.futures.Future:
        """Checks ``request`` (`rollout_client.request_guards.check_request`), then samples it.

        Raises:
          RequestRefusedError: the request would reach the engine with a prompt it cannot serve.
        """
        check_request(request, self.limits)
        return self.client.submit(request)

    def publish(self, policy_version: int, weights: Mapping[str, np.ndarray]) -> int:
        """Writes ``weights`` as a new checkpoint directory and restarts the engine on it; a version already served
        is left alone. Records ``publish/*`` metrics: seconds writing and restarting, megabytes, seconds per MB.

        Raises:
          ValueError: ``policy_version`` is older than the one served (versions must increase).
          EngineExitedError, ServerNotReadyError: the restarted engine died or did not become healthy.
          ModelMismatchError: it serves another model than before.
        """
        if policy_version == self.policy_version:
            return policy_version
        if policy_version < self.policy_version:
            raise ValueError(f"policy_version={policy_version}: the engine serves {self.policy_version} already "
                             "(versions must increase)")
        started = time.monotonic()
        directory = self._write(policy_version, weights)
        written = time.monotonic()
        self.client.hold()  # requests admitted from now on wait for the new weights
        served = self.policy_version
        try:
            self.process.stop()
            self.process = self._launch(directory)
            self.client.wait_ready(self.config.ready_timeout_s)
            self.served_dir, served = directory, policy_version
        finally:
            self.client.release(served)
        self.policy_version = served
        check_model_identity(self.model_identity(), self._identity, self.address)
        collect_garbage(self.weights_dir, self.served_dir, self.keep_weight_versions)
        megabytes = sum(np.asarray(array).nbytes for array in weights.values()) / 1e6
        total = time.monotonic() - started
        self._publish_metrics = {"publish/write_s": written - started, "publish/restart_s": total - (written - started),
                                 "publish/megabytes": megabytes, "publish/s_per_megabyte": total / megabytes}
        return policy_version

    def metrics(self) -> dict[str, float]:
        return {**self.client.metrics(), **self._publish_metrics}

    def close(self) -> None:
        try:
            if self.client is not None:
                self.client.close()
        finally:
            if self.process is not None:
                self.process.stop()
