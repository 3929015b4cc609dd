"""The SGLang engine: sampling over smg's SGLang proto, weights and pauses over SGLang's HTTP API.

Data plane: ``sglang.grpc.scheduler.SglangScheduler`` from ``smg-grpc-proto`` (served by ``sglang serve
--grpc-mode``): token ids in, streamed token ids and logprobs out, ``n`` samples per request (``index``). Every
sampling field is sent with an explicit value (`sglang_generate_request`): the proto's floats are plain proto3
fields whose zero is not SGLang's default (temperature 0 is greedy), so "off" is spelled out for each.

Control plane (`SGLangControl`), SGLang's native HTTP API (``python/sglang/srt/entrypoints/http_server.py``):
``POST /pause_generation {"mode"}`` (``PauseGenerationReqInput``), ``POST /update_weights_from_disk {"model_path",
"load_format", "weight_version", "flush_cache", "abort_all_requests"}`` (``UpdateWeightFromDiskReqInput``; 200 with
``{"success": true, ...}``, 400 with ``success: false`` and a message), ``POST /continue_generation``, and the served
version from ``GET /model_info`` (``weight_version``; older servers: ``GET /get_weight_version``). LoRA adapters
(``publish_adapters``) are loaded over the smg proto itself, under ids requests name
(`rollout_client.engines.sglang_adapters`).

Versions: the smg proto carries no per-token ``weight_versions`` (SGLang's HTTP ``meta_info`` does; the gRPC
``GenerateStreamChunk``/``GenerateComplete`` have no such field), so the client stamps the version served at
admission (`VersionReporting.ENGINE`) and runs are synchronous (``rollout.max_staleness = 0``), or partial
(``partial``: a publish aborts the running samples and the client continues each from its tokens, stamping the new
version on the rest: `rollout_client.engines.smg.adapter`).

Logprobs: SGLang returns ``log_softmax(logits / temperature)``, before top-k, top-p and min-p: Tether's PROCESSED
when no truncation is used (the default here; a truncating request is refused), or the RAW ``log_softmax(logits)``
when the server runs with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (``logprob_mode=RAW``).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
from collections.abc import Sequence

from smg_grpc_proto import sglang_scheduler_pb2, sglang_scheduler_pb2_grpc

from rollout_client.client import ClientConfig
from rollout_client.engines.base import EngineCapabilities, PartialRollouts, VersionReporting, WeightTransport
from rollout_client.engines.http_control import (
    ControlPlaneError,
    HttpControl,
    HttpControlledEngine,
    final_repeats_last_chunk,
)
from rollout_client.engines.sglang_adapters import SGLangAdapters
from rollout_client.engines.smg.dialects import EngineSampling, SmgDialect
from rollout_client.engines.weight_dirs import CheckpointWriter
from rollout_client.request_guards import RequestRefusedError
from rollout_client.sampling_params import LogprobMode, PauseMode

__all__ = ["SGLANG", "SGLANG_CAPABILITIES", "SGLangControl", "SGLangEngine", "adapter_name", "sglang_generate_request"]

STREAM_INTERVAL = 8  # tokens per streamed chunk: an abort keeps all but the last < 8; fewer messages per sample

SGLANG_CAPABILITIES = EngineCapabilities(
    logprob_modes=frozenset({LogprobMode.RAW, LogprobMode.PROCESSED}),  # one of them, by server setting
    sampler_order=("temperature", "top_k", "top_p", "min_p"),  # Sampler.forward: T, then top-k/top-p renorm, min-p
    pause_modes=frozenset({PauseMode.ABORT, PauseMode.KEEP}),  # "abort"; "in_place"/"retract" keep requests
    weight_transport=WeightTransport.FROM_DISK,
    version_reporting=VersionReporting.ENGINE,
    native_n=True,
    honours_seed=False,  # the proto has no seed field
    partial_rollouts=PartialRollouts.CONTINUED,
)

_PAUSE_MODES = {PauseMode.ABORT: "abort", PauseMode.KEEP: "in_place"}


def sglang_generate_request(request_id: str, prompt: Sequence[int], sampling: EngineSampling
                            ) -> sglang_scheduler_pb2.GenerateRequest:
    """SGLang's request with an explicit value for every sampling field (the values that mean "off" for those
    Tether does not use).

    Stops: SGLang's ``ignore_eos`` also ignores ``stop_token_ids`` (``Req.check_finished``), so a request with stop
    ids keeps ``ignore_eos`` off and lists them (the engine also stops at its eos ids: `SGLangEngine` refuses stop
    ids that leave one out), and a request with none sets it.
    """
    return sglang_scheduler_pb2.GenerateRequest(
        request_id=request_id, tokenized=sglang_scheduler_pb2.TokenizedInput(input_ids=prompt), stream=True,
        return_logprob=True, logprob_start_len=-1, top_logprobs_num=0, return_hidden_states=False,
        sampling_params=sglang_scheduler_pb2.SamplingParams(
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or -1, min_p=sampling.min_p,
            frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0,
            max_new_tokens=sampling.max_new_tokens, min_new_tokens=0, stop=sampling.stop_strings,
            stop_token_ids=sampling.stop_token_ids,
            ignore_eos=not sampling.stop_token_ids, skip_special_tokens=False, spaces_between_special_tokens=False,
            no_stop_trim=True, n=sampling.n, stream_interval=STREAM_INTERVAL))


SGLANG = SmgDialect(
    name="sglang", pb=sglang_scheduler_pb2,
    stub=final_repeats_last_chunk(sglang_scheduler_pb2_grpc.SglangSchedulerStub), native_n=True,
    logprob_modes=SGLANG_CAPABILITIES.logprob_modes, generate_request=sglang_generate_request,
    abort_requests=lambda ids: [sglang_scheduler_pb2.AbortRequest(request_id=request_id, reason="aborted by Tether")
                                for request_id in ids])


def adapter_name(policy_version: int) -> str:
    """The name, and the caller-minted id requests give as ``GenerateRequest.lora_id``, under which an adapter
    publish serves ``policy_version`` (`rollout_client.engines.sglang_adapters`)."""
    return f"tether-v{policy_version}"


_ADAPTER_ID = re.compile(r"tether-v\d+")  # every `adapter_name`


class SGLangControl:
    """SGLang's HTTP control endpoints (bodies as in ``io_struct.py``)."""

    def __init__(self, http: HttpControl):
        self.http = http

    def pause(self, mode: PauseMode) -> None:
        """``POST /pause_generation {"mode": "abort" | "in_place"}``."""
        self.http.post("/pause_generation", {"mode": _PAUSE_MODES[mode]})

    def update_weights_from_disk(self, model_path: str, weight_version: str) -> None:
        """``POST /update_weights_from_disk``; safetensors named explicitly (a server started with
        ``--load-format dummy`` would otherwise reload dummy weights), the prefix cache flushed (it holds the old
        weights' KV), nothing aborted (the engine is paused already).

        Raises:
          ControlPlaneError: HTTP 400 (SGLang's ``success: false``, with its message) or a reply without success.
        """
        reply = self.http.post("/update_weights_from_disk", {
            "model_path": model_path, "load_format": "safetensors", "weight_version": weight_version,
            "flush_cache": True, "abort_all_requests": False})
        if not (isinstance(reply, dict) and reply.get("success") is True):
            raise ControlPlaneError(f"POST {self.http.base_url}/update_weights_from_disk: no success in {reply!r}")

    def continue_generation(self) -> None:
        """``POST /continue_generation``."""
        self.http.post("/continue_generation")

    def weight_version(self) -> str:
        """The served ``weight_version``: ``GET /model_info``, or ``GET /get_weight_version`` where the first is
        missing (SGLang renamed it; each answers 404 where it does not exist)."""
        try:
            reply = self.http.get("/model_info")
        except ControlPlaneError as error:
            if "HTTP 404" not in str(error):
                raise
            reply = self.http.get("/get_weight_version")
        if not (isinstance(reply, dict) and "weight_version" in reply):
            raise ControlPlaneError(f"GET {self.http.base_url}/model_info: no weight_version in {reply!r}")
        return str(reply["weight_version"])


class SGLangEngine(HttpControlledEngine):
    """An SGLang server: gRPC data plane at ``config.target``, HTTP control plane at ``control_url``.

    Args:
      config: the gRPC address and the client's patience.
      control_url: ``http://host:port`` of SGLang's HTTP API for the same engine.
      write_checkpoint, weights_dir, keep_weight_versions: as `HttpControlledEngine`.
      logprob_mode: PROCESSED (SGLang's default logprobs) or RAW (server run with
        ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``).
      control_timeout_s: per HTTP call (a weight load takes as long as reading the checkpoint).
      auth_token: SGLang's ``--api-key`` / ``--admin-api-key``, for the HTTP API.
      publish_adapters: `publish` gets LoRA adapters (``write_checkpoint`` writes a PEFT adapter directory), loads
        them over the smg proto's ``LoadLoRAAdapter`` with `adapter_name` (version) as name and id, unloads the
        previous version's once the new one serves, and every request names the adapter of the version it was
        admitted at (``GenerateRequest.lora_id``; `rollout_client.engines.sglang_adapters`). The engine must implement
        those
        RPCs (smg-grpc-servicer 0.14.1 does not: refused here, at construction). False: merged weights,
        ``/update_weights_from_disk``.
      partial: continue the samples a publish aborts from their exact tokens under the new version
        (`HttpControlledEngine`).
    """

    name = "sglang"
    capabilities = SGLANG_CAPABILITIES
    dialect = SGLANG

    def __init__(self, config: ClientConfig, control_url: str, write_checkpoint: CheckpointWriter,
                 weights_dir: str | os.PathLike, *, logprob_mode: LogprobMode = LogprobMode.PROCESSED,
                 keep_weight_versions: int = 2, control_timeout_s: float = 600.0, auth_token: str | None = None,
                 publish_adapters: bool = False, partial: bool = False):
        self.sglang = SGLangControl(HttpControl(control_url, control_timeout_s, auth_token))
        self.publish_adapters = publish_adapters
        if publish_adapters:
            self.dialect = dataclasses.replace(SGLANG, adapter_id=adapter_name)
        super().__init__(config, self.sglang.http, write_checkpoint, weights_dir, logprob_mode=logprob_mode,
                         pause_mode=PauseMode.ABORT, keep_weight_versions=keep_weight_versions, partial=partial)
        self.adapters = SGLangAdapters(self.client, config.target)
        if publish_adapters:
            try:
                self.adapters.loaded()  # an engine without smg's LoRA RPCs is refused now, not at the first publish
            except BaseException:
                self.close()
                raise

    def _check(self, request) -> None:
        """PROCESSED logprobs with truncation, and stop ids that leave out an eos id, cannot be honoured."""
        sampling, info = request.sampling, self.client.model_info
        truncated = [name for name, on in (("top_k", 0 < (sampling.top_k or 0) < info.vocab_size),
                                           ("top_p", (sampling.top_p or 1.0) < 1.0),
                                           ("min_p", (sampling.min_p or 0.0) > 0.0)) if on]
        if truncated and LogprobMode.PROCESSED in self.capabilities.logprob_modes:
            raise RequestRefusedError(
                f"request {request.request_id}: {', '.join(truncated)} with processed logprobs: SGLang's logprobs "
                "are log_softmax(logits / temperature), before truncation, so they are not of the distribution it "
                "samples; start SGLang with SGLANG_RETURN_ORIGINAL_LOGPROB=1 and use rollout.logprob_mode='raw', or "
                "sample without truncation")
        missing = sorted(set(info.eos_token_ids) - set(sampling.stop_token_ids or ()))
        if sampling.stop_token_ids and missing:
            raise RequestRefusedError(
                f"request {request.request_id}: stop_token_ids={list(sampling.stop_token_ids)} leaves out the "
                f"engine's eos ids {missing}: SGLang stops at them unless ignore_eos, which also ignores "
                "stop_token_ids; add them, or pass no stop ids (None: the eos ids; (): never stop)")

    def _pause(self, mode: PauseMode) -> None:
        self.sglang.pause(mode)

    def _load(self, directory: pathlib.Path, policy_version: int) -> None:
        """Merged weights: ``/update_weights_from_disk``. Adapters: ``LoadLoRAAdapter``, after unloading an adapter
        of the same name left by an earlier attempt at this version (no admitted request names it)."""
        if self.publish_adapters:
            name = adapter_name(policy_version)
            if name in self.adapters.loaded():
                self.adapters.unload(name, name)
            self.adapters.load(name, str(directory), name)
        else:
            self.sglang.update_weights_from_disk(str(directory), str(policy_version))

    def _resume(self) -> None:
        self.sglang.continue_generation()

    def _confirm(self, policy_version: int) -> None:
        """Merged weights: the served ``weight_version`` is ``policy_version``. Adapters: the engine lists the new
        adapter's id, and every other ``tether-v<N>`` it holds, which no request admitted from now on names, is
        unloaded (its adapter slots do not fill up), the previous version's and any that an engine taken back
        without a restart (`may_have_restarted`: the version forgotten) still holds."""
        if self.publish_adapters:
            loaded, name = self.adapters.loaded(), adapter_name(policy_version)
            if name not in loaded:
                raise ControlPlaneError(f"the SGLang engine at {self.address} does not list LoRA adapter {name!r} "
                                        f"after loading it (loaded ids: {sorted(loaded)})")
            for stale in sorted(loaded):  # ours, of older versions (also one left by a take-back: see below)
                if stale != name and _ADAPTER_ID.fullmatch(stale):
                    self.adapters.unload(stale, stale)
            return
        served = self.sglang.weight_version()
        if served != str(policy_version):
            raise ControlPlaneError(f"the SGLang engine at {self.sglang.http.base_url} reports weight_version "
                                    f"{served!r} after loading policy version {policy_version}")
