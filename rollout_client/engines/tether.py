"""The rollout.v1 engine: Tether's own protocol, served by the reference server or any rollout.v1 server."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping

import numpy as np

from rollout_client.client import ClientConfig
from rollout_client.engines.base import (
    SAMPLER_STEPS,
    Engine,
    EngineCapabilities,
    EngineInfo,
    PartialRollouts,
    VersionReporting,
    WeightTransport,
)
from rollout_client.errors import PolicyVersionError
from rollout_client.request_guards import PromptLimits, check_request
from rollout_client.sampling_params import KvCache, LogprobMode, PauseMode
from rollout_client.shared_weights import SharedWeightsFile
from rollout_client.sync_client import RolloutClient

ROLLOUT_V1_CAPABILITIES = EngineCapabilities(
    logprob_modes=frozenset(LogprobMode),
    sampler_order=SAMPLER_STEPS,
    pause_modes=frozenset(PauseMode),
    weight_transport=WeightTransport.STREAMED,
    version_reporting=VersionReporting.PER_TOKEN,
    native_n=True,
    honours_seed=True,
    partial_rollouts=PartialRollouts.IN_ENGINE,
)


class TetherEngine(Engine):
    """A rollout.v1 server reached at ``config.target``.

    Args:
      config: how to reach it.
      process: the engine process this run launched (e.g. `rollout_client.EngineProcess`), stopped on `close`;
        None for an external server.
      pause_mode: how `publish` pauses: WAIT (requests being generated finish under the old weights: one version
        per sample), KEEP (they decode on under the new ones: partial rollouts) or ABORT.
      kv_cache: with KEEP, whether the kept requests' KV cache is recomputed under the new weights (exact) or kept.
      shared_weights: for a server on this host that reads weights from the file's directory (its
        ``--weights-dir``): publishes write the weights there and have the server load them
        (`rollout_client.shared_weights`), instead of streaming them; closed on `close`. None: streamed.
    """

    name = "tether"
    capabilities = ROLLOUT_V1_CAPABILITIES

    def __init__(self, config: ClientConfig, process=None, pause_mode: PauseMode = PauseMode.KEEP,
                 kv_cache: KvCache = KvCache.RECOMPUTE, shared_weights: SharedWeightsFile | None = None):
        self.process = process
        self.shared_weights = shared_weights
        self.config = config
        self.pause_mode, self.kv_cache = pause_mode, kv_cache
        try:
            self.client = RolloutClient(config)
        except BaseException:
            if process is not None:
                process.check_alive()  # it died while the client waited: EngineExitedError names its code and log
                process.stop()
            raise

    def info(self) -> EngineInfo:
        reply = self.client.server_info()
        return EngineInfo(policy_version=reply.policy_version, vocab_size=reply.vocab_size,
                          eos_token_ids=tuple(reply.eos_token_ids), max_seq_len=reply.max_seq_len,
                          model_identity=reply.model_config_hash)

    def submit(self, request) -> concurrent.futures.Future:
        """Refuses a prompt the learner could not train on or the server could not serve (`check_request`:
        empty, an id beyond either vocabulary, longer than the context with ``max_new_tokens``), then sends it."""
        info = self.client.info
        check_request(request, PromptLimits.of(self.config.validation.vocab_size, info.vocab_size, info.max_seq_len))
        return self.client.submit(request)

    def publish(self, policy_version: int, weights: Mapping[str, np.ndarray]) -> int:
        """Pause -> load (through shared memory, or streamed) -> resume; a server already at ``policy_version`` is
        left alone.

        Raises:
          PolicyVersionError: the server serves a newer version than ``policy_version``, or an external server serves
            version 0 as a fresh learner does (its weights cannot be replaced: versions must increase).
        """
        served = self.client.server_info().policy_version
        if served > policy_version:
            raise PolicyVersionError(f"the server already serves policy version {served}, newer than the learner's "
                                     f"{policy_version}: restart the server (versions must increase)")
        if served == policy_version:
            if self.process is None and policy_version == 0:  # an external server's version 0 is its own weights
                raise PolicyVersionError("the external server serves policy version 0, as does the fresh learner, so "
                                         "its weights cannot be replaced (versions must increase): set warmup.steps "
                                         "> 0 or model.hf_path, or serve the learner's initial weights")
            return served  # our launched server from the same seed, or a version we pushed
        if self.shared_weights is not None:
            return self.client.publish_weights(policy_version, path=self.shared_weights.write(weights),
                                               pause_mode=self.pause_mode, kv_cache=self.kv_cache)
        return self.client.publish_weights(policy_version, weights=weights, pause_mode=self.pause_mode,
                                           kv_cache=self.kv_cache)

    def metrics(self) -> dict[str, float]:
        return self.client.metrics()

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            if self.process is not None:
                self.process.stop()
            if self.shared_weights is not None:
                self.shared_weights.close()
