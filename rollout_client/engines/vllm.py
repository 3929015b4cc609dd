"""The vLLM engine: sampling over smg's vLLM proto, weights and pauses over vLLM's HTTP API.

Data plane: ``vllm.grpc.engine.VllmEngine`` from ``smg-grpc-proto`` (served by ``vllm serve --grpc`` /
``python -m vllm.entrypoints.grpc_server``): token ids in, streamed token ids and the sampled tokens' logprobs out
(``logprobs=0``), ``n`` samples per request (``index``). Every sampling field is sent explicitly
(`vllm_generate_request`); stops are exactly the request's (``ignore_eos`` with ``stop_token_ids``: vLLM honours
stop ids with ``ignore_eos``).

Control plane (`VllmControl`), vLLM's HTTP API (``vllm/entrypoints/serve/rlhf/api_router.py``,
``vllm/entrypoints/serve/dev/rpc/api_router.py``; both need ``VLLM_SERVER_DEV_MODE=1``): ``POST /pause?mode=
abort|wait|keep&clear_cache=true`` (``{"status": "paused"}``; 400 ``{"error"}`` for a bad mode), ``POST
/collective_rpc {"method": "reload_weights", "kwargs": {"weights_path"}}`` (the worker reloads the checkpoint
directory), ``POST /resume`` (``{"status": "resumed"}``), ``GET /is_paused`` (``{"is_paused"}``). vLLM's HTTP API
has no weight version: the version is the one this client loaded (the reload answered 200 and the engine resumed).
vLLM's native gRPC control (``rust/proto/control.proto``) loads tensors over NCCL/IPC only, no checkpoint directory.

Logprobs: a server flag, ``--logprobs-mode raw_logprobs`` (vLLM's default: RAW, ``log_softmax(logits)`` before any
processing) or ``processed_logprobs`` (PROCESSED: after temperature, min-p, top-k and top-p); neither proto nor HTTP
API reports it, so it is configured here (``logprob_mode``) and must match the server.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence

from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from rollout_client.client import ClientConfig
from rollout_client.engines.base import EngineCapabilities, PartialRollouts, VersionReporting, WeightTransport
from rollout_client.engines.http_control import (
    ControlPlaneError,
    HttpControl,
    HttpControlledEngine,
    final_repeats_last_chunk,
)
from rollout_client.engines.process import EngineProcess
from rollout_client.engines.smg.dialects import EngineSampling, SmgDialect
from rollout_client.engines.weight_dirs import CheckpointWriter
from rollout_client.sampling_params import LogprobMode, PauseMode

__all__ = ["VLLM", "VLLM_CAPABILITIES", "VllmControl", "VllmEngine", "vllm_generate_request"]

VLLM_CAPABILITIES = EngineCapabilities(
    logprob_modes=frozenset({LogprobMode.RAW, LogprobMode.PROCESSED}),  # one of them, by --logprobs-mode
    sampler_order=("temperature", "min_p", "top_k", "top_p"),  # v1 Sampler: T, min-p (a logits processor), top-k/p
    pause_modes=frozenset(PauseMode),  # /pause?mode=abort|wait|keep
    weight_transport=WeightTransport.FROM_DISK,
    version_reporting=VersionReporting.ENGINE,
    native_n=True,
    honours_seed=False,  # a seed is taken, but the draws depend on the batch (not sent)
    partial_rollouts=PartialRollouts.CONTINUED,
)

_PAUSE_MODES = {PauseMode.ABORT: "abort", PauseMode.WAIT: "wait", PauseMode.KEEP: "keep"}


def vllm_generate_request(request_id: str, prompt: Sequence[int], sampling: EngineSampling
                          ) -> vllm_engine_pb2.GenerateRequest:
    """vLLM's request with an explicit value for every sampling field that changes the tokens or logprobs."""
    return vllm_engine_pb2.GenerateRequest(
        request_id=request_id, tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt), stream=True,
        sampling_params=vllm_engine_pb2.SamplingParams(
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, min_p=sampling.min_p,
            frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0, max_tokens=sampling.max_new_tokens,
            min_tokens=0, stop=sampling.stop_strings,
            stop_token_ids=sampling.stop_token_ids, ignore_eos=True, skip_special_tokens=False,
            spaces_between_special_tokens=False, include_stop_str_in_output=False, n=sampling.n, logprobs=0))


VLLM = SmgDialect(
    name="vllm", pb=vllm_engine_pb2, stub=final_repeats_last_chunk(vllm_engine_pb2_grpc.VllmEngineStub),
    native_n=True, logprob_modes=VLLM_CAPABILITIES.logprob_modes, generate_request=vllm_generate_request,
    abort_requests=lambda ids: [vllm_engine_pb2.AbortRequest(request_ids=list(ids))])


class VllmControl:
    """vLLM's HTTP control endpoints."""

    def __init__(self, http: HttpControl):
        self.http = http

    def pause(self, mode: PauseMode) -> None:
        """``POST /pause?mode=...&clear_cache=true`` (the prefix cache holds the old weights' KV)."""
        self.http.post("/pause", query={"mode": _PAUSE_MODES[mode], "clear_cache": "true"})

    def reload_weights(self, weights_path: str) -> None:
        """``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": ...}}`` (every worker)."""
        self.http.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": weights_path}})

    def resume(self) -> None:
        """``POST /resume``."""
        self.http.post("/resume")

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """``POST /v1/load_lora_adapter {"lora_name", "lora_path"}``: a PEFT adapter directory, served to OpenAI
        requests whose ``model`` is ``lora_name``. The route exists with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (or
        ``True``) on vLLM's HTTP server, the engine needs ``--enable-lora`` (else HTTP 500). vLLM 0.33.0 answers a
        text; 400 for a name already loaded (``load_inplace`` would replace it), 404 for a path without an adapter.
        Not used by `publish`: smg's vLLM ``GenerateRequest`` cannot name an adapter (docs/lora.md)."""
        self.http.post("/v1/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path})

    def unload_lora_adapter(self, lora_name: str) -> None:
        """``POST /v1/unload_lora_adapter {"lora_name"}`` (404 for an unknown name). vLLM 0.33.0 forgets the name only:
        the engine keeps the weights in its LRU adapter cache (``--max-cpu-loras``)."""
        self.http.post("/v1/unload_lora_adapter", {"lora_name": lora_name})

    def is_paused(self) -> bool:
        """``GET /is_paused``."""
        reply = self.http.get("/is_paused")
        if not (isinstance(reply, dict) and isinstance(reply.get("is_paused"), bool)):
            raise ControlPlaneError(f"GET {self.http.base_url}/is_paused: no is_paused in {reply!r}")
        return reply["is_paused"]


class VllmEngine(HttpControlledEngine):
    """A vLLM server: gRPC data plane at ``config.target``, HTTP control plane at ``control_url``.

    Args:
      config: the gRPC address and the client's patience.
      control_url: ``http://host:port`` of vLLM's HTTP API for the same engine (``VLLM_SERVER_DEV_MODE=1``).
      write_checkpoint, weights_dir, keep_weight_versions: as `HttpControlledEngine`.
      logprob_mode: RAW (``--logprobs-mode raw_logprobs``, vLLM's default) or PROCESSED
        (``--logprobs-mode processed_logprobs``): must be the server's.
      pause_mode: WAIT (default: running requests finish on the old weights, every token is of the version
        stamped) or ABORT (they end at once, keeping their tokens); ABORT whatever is given with ``partial``.
      partial: continue the samples a publish aborts from their exact tokens under the new version
        (`HttpControlledEngine`).
      control_timeout_s: per HTTP call (a reload takes as long as reading the checkpoint).
      auth_token: vLLM's ``--api-key``, for the HTTP API.
      process: the engine's process if this run launched it (`rollout_client.engines.vllm_server` in an
        `rollout_client.EngineProcess`): the client fails fast if it exits, and `close` stops it.
    """

    name = "vllm"
    capabilities = VLLM_CAPABILITIES
    dialect = VLLM

    def __init__(self, config: ClientConfig, control_url: str, write_checkpoint: CheckpointWriter,
                 weights_dir: str | os.PathLike, *, logprob_mode: LogprobMode = LogprobMode.RAW,
                 pause_mode: PauseMode = PauseMode.WAIT, keep_weight_versions: int = 2,
                 control_timeout_s: float = 600.0, auth_token: str | None = None, partial: bool = False,
                 process: EngineProcess | None = None):
        self.vllm = VllmControl(HttpControl(control_url, control_timeout_s, auth_token))
        self.process = process
        try:
            super().__init__(config, self.vllm.http, write_checkpoint, weights_dir, logprob_mode=logprob_mode,
                             pause_mode=PauseMode.ABORT if partial else pause_mode,
                             keep_weight_versions=keep_weight_versions, partial=partial,
                             check_alive=None if process is None else process.check_alive)
        except BaseException:
            if process is not None:
                process.stop()
            raise

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.process is not None:
                self.process.stop()

    def _pause(self, mode: PauseMode) -> None:
        self.vllm.pause(mode)

    def _load(self, directory: pathlib.Path, policy_version: int) -> None:
        self.vllm.reload_weights(str(directory))

    def _resume(self) -> None:
        self.vllm.resume()

    def _confirm(self, policy_version: int) -> None:
        if self.vllm.is_paused():
            raise ControlPlaneError(f"the vLLM engine at {self.vllm.http.base_url} is still paused after /resume")
