"""Engines sampled over an smg proto and controlled over their HTTP API: what the SGLang and vLLM backends share.

The smg data plane (Generate, Abort, HealthCheck, GetModelInfo) has no pause, weight-update or version RPC, so those
go through each engine's own HTTP API:

- `HttpControl`: a small JSON-over-HTTP client (stdlib only). Every failure names the method, the URL and the
  engine's answer (`ControlPlaneError`), or says the endpoint could not be reached (`ControlPlaneUnavailableError`).
- `HttpControlledEngine`: the `rollout_client.Engine` over `rollout_client.engines.smg.SmgClient` whose `publish` writes
a
  checkpoint directory and has the engine load it (pause -> load -> resume -> confirm), stamping versions at
  admission. Subclasses name the endpoints (`rollout_client.SGLangEngine`, `rollout_client.VllmEngine`).
- `final_repeats_last_chunk`: the stream shape both engines' smg servicers share.
"""

from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
import http.client
import json
import math
import os
import pathlib
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping

import numpy as np

from rollout_client.client import ClientConfig
from rollout_client.engines.base import Engine, EngineInfo
from rollout_client.engines.smg.client import SmgClient
from rollout_client.engines.smg.dialects import SmgDialect
from rollout_client.engines.weight_dirs import CheckpointWriter, collect_garbage, version_dir
from rollout_client.errors import RolloutError
from rollout_client.request_guards import PromptLimits, RequestRefusedError, check_request
from rollout_client.sampling_params import LogprobMode, PauseMode

__all__ = ["ControlPlaneError", "ControlPlaneUnavailableError", "HttpControl", "HttpControlledEngine",
           "final_repeats_last_chunk"]


MAX_ERROR_BODY_CHARS = 2000  # an error page is quoted up to this length in the exception


class ControlPlaneError(RolloutError):
    """The engine's control endpoint answered with an error (HTTP 4xx/5xx, or a body that reports failure)."""


class ControlPlaneUnavailableError(ControlPlaneError):
    """The engine's control endpoint could not be reached (refused, reset, timed out)."""


class HttpControl:
    """JSON requests to one engine's HTTP control endpoint.

    Args:
      base_url: ``http://host:port`` (or ``https://``) of the engine's HTTP API; a trailing ``/`` is ignored.
      timeout_s: per request; a weight load can take minutes on a large model.
      auth_token: sent as ``Authorization: Bearer <token>`` when set (SGLang ``--api-key``/``--admin-api-key``,
        vLLM ``--api-key``).
    """

    def __init__(self, base_url: str, timeout_s: float = 600.0, auth_token: str | None = None):
        parsed = urllib.parse.urlsplit(base_url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.query or parsed.fragment:
            raise ValueError(f"control_url={base_url!r}: must be 'http://host:port' (or https://) of the engine's "
                             "HTTP API")
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"control_timeout_s={timeout_s!r}: must be a finite number > 0")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if auth_token:
            self._headers["Authorization"] = f"Bearer {auth_token}"

    def get(self, path: str, query: dict[str, str] | None = None):
        """``GET path``; returns the decoded JSON body (or the text, if it is not JSON)."""
        return self.request("GET", path, query=query)

    def post(self, path: str, body: dict | None = None, query: dict[str, str] | None = None):
        """``POST path`` with a JSON body (``{}`` when None); returns the decoded body."""
        return self.request("POST", path, body={} if body is None else body, query=query)

    def request(self, method: str, path: str, body: dict | None = None, query: dict[str, str] | None = None):
        """One request; returns the decoded JSON body, the text of a non-JSON body, or None for an empty one.

        Raises:
          ControlPlaneError: HTTP status >= 400; the message names method, URL, status and the body.
          ControlPlaneUnavailableError: the endpoint could not be reached or did not answer in time.
        """
        url = self.base_url + path + (f"?{urllib.parse.urlencode(query)}" if query else "")
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method, headers=self._headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return _decode(response.read())
        except urllib.error.HTTPError as error:
            text = error.read().decode(errors="replace")[:MAX_ERROR_BODY_CHARS]
            raise ControlPlaneError(f"{method} {url}: HTTP {error.code} {error.reason}: {text or '(empty body)'}"
                                    ) from error
        except (urllib.error.URLError, http.client.HTTPException, OSError) as error:
            reason = getattr(error, "reason", error)
            raise ControlPlaneUnavailableError(f"{method} {url}: the engine's control endpoint did not answer "
                                               f"({reason}); is the engine running and is the URL right?") from error


def _decode(raw: bytes):
    """The body as JSON if it parses, else as text; None when empty."""
    if not raw:
        return None
    text = raw.decode(errors="replace")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class _StreamEndsWithLastChunk:
    """An smg stub whose streamed ``Generate`` ends with a ``complete`` that repeats the last ``chunk``.

    smg's SGLang and vLLM servicers stream one ``chunk`` per engine step with that step's new tokens, then a
    ``complete`` built from the same step output: its ``output_ids`` and ``output_logprobs`` are that last step's
    tokens again (``SGLangSchedulerServicer._create_completion_response``, ``VllmEngineServicer._complete_response``:
    "For streaming (DELTA): completion has last delta"). The tokens are in the chunks, so the ``complete``'s copies
    are cleared here and it only ends the sample (finish reason). Other methods pass through.
    """

    stub_class: type  # the generated stub (set by `final_repeats_last_chunk`)

    def __init__(self, channel):
        self._stub = self.stub_class(channel)

    def __getattr__(self, name):
        return getattr(self._stub, name)

    def Generate(self, request, **kwargs):
        return _without_repeated_tokens(self._stub.Generate(request, **kwargs))


def final_repeats_last_chunk(stub_class: type) -> type:
    """``stub_class`` (a generated smg stub) wrapped as `_StreamEndsWithLastChunk`."""
    return type(f"{stub_class.__name__}LastChunkRepeated", (_StreamEndsWithLastChunk,), {"stub_class": stub_class})


async def _without_repeated_tokens(call):
    """The responses of a streamed Generate ``call``, with the final message's token fields cleared."""
    try:
        async for response in call:
            if response.WhichOneof("response") == "complete":
                del response.complete.output_ids[:]
                response.complete.ClearField("output_logprobs")
            yield response
    finally:
        call.cancel()  # a consumer that stops early (abort, deadline) ends the engine request too


class HttpControlledEngine(Engine):
    """An smg engine (data plane over gRPC) whose weights are loaded from disk through its HTTP API.

    Subclasses say how to pause, load a checkpoint directory, resume and read the served version (`_pause`,
    `_load`, `_resume`, `_confirm`). `publish` writes the learner's weights as ``weights_dir/v<version>`` (the
    ``write_checkpoint`` callback writes it atomically), holds admission of new requests, pauses the engine, loads,
    resumes, confirms the version, and admits requests again stamped with it: the engines report one version per
    engine (`VersionReporting.ENGINE`), so a request's tokens carry the version served when it was admitted.

    Until the first `publish` the engine serves the weights it was started with, which are no version of the
    learner's: `submit` refuses requests then, and again after `may_have_restarted` until a `publish` confirms.

    Args:
      config: how to reach the engine's gRPC server (``config.target``) and how patient to be.
      control: its HTTP control endpoint.
      write_checkpoint: (directory, weights) -> writes a Hugging Face checkpoint there atomically
        (`rollout_client.engines.weight_dirs.CheckpointWriter`).
      weights_dir: where the version directories go; the engine must read the same path (a shared filesystem).
      logprob_mode: which logprobs the server returns (a server setting; see the subclass).
      pause_mode: how `publish` pauses the engine.
      keep_weight_versions: version directories kept (>= 1; the served one always).
      partial: partial rollouts: `publish` pauses with ABORT and each sample it interrupts is continued from its
        exact tokens under the new version (`rollout_client.engines.smg.adapter`), so samples carry a version per token.
      check_alive: raises if the engine's launched process exited (`rollout_client.EngineProcess.check_alive`).
    """

    dialect: SmgDialect  # the engine's smg proto (class attribute of the subclass)

    def __init__(self, config: ClientConfig, control: HttpControl, write_checkpoint: CheckpointWriter,
                 weights_dir: str | os.PathLike, *, logprob_mode: LogprobMode, pause_mode: PauseMode,
                 keep_weight_versions: int = 2, partial: bool = False, check_alive=None):
        if logprob_mode not in type(self).capabilities.logprob_modes:
            raise ValueError(f"logprob_mode={logprob_mode!r}: the {self.name} engine returns "
                             f"{' or '.join(mode.name.lower() for mode in type(self).capabilities.logprob_modes)}")
        if pause_mode not in type(self).capabilities.pause_modes:
            raise ValueError(f"pause_mode={pause_mode!r}: the {self.name} engine pauses with "
                             f"{', '.join(mode.name for mode in type(self).capabilities.pause_modes)}")
        if pause_mode == PauseMode.KEEP:
            raise ValueError(f"pause_mode=KEEP: requests kept running across a weight update would mix two versions, "
                             f"and the {self.name} engine reports one version per engine (use ABORT)")
        if partial and pause_mode != PauseMode.ABORT:
            raise ValueError(f"pause_mode={pause_mode!r} with partial=True: a publish interrupts the samples being "
                             "generated (ABORT) and the client continues them; use ABORT")
        if keep_weight_versions < 1:
            raise ValueError(f"keep_weight_versions={keep_weight_versions}: must be >= 1 (the served directory)")
        self.capabilities = dataclasses.replace(type(self).capabilities, logprob_modes=frozenset({logprob_mode}))
        self.control = control
        self.pause_mode = pause_mode
        self.weights_dir = pathlib.Path(weights_dir)
        self.keep_weight_versions = keep_weight_versions
        self._write_checkpoint = write_checkpoint
        self.config = config
        self.policy_version: int | None = None  # None: the engine's own start-up weights
        self.served_dir: pathlib.Path | None = None
        self._publish_metrics: dict[str, float] = {}
        self.client = SmgClient(config, dataclasses.replace(self.dialect, logprob_modes=frozenset({logprob_mode})),
                                check_alive=check_alive, continue_interrupted=partial)
        self.client.hold()

    @property
    def address(self) -> str:
        return self.config.target

    @property
    def limits(self) -> PromptLimits:
        """What prompts must respect: the learner's and the engine's vocabulary, the engine's context."""
        info = self.client.model_info
        return PromptLimits.of(self.config.validation.vocab_size, info.vocab_size, info.max_context_length)

    def info(self) -> EngineInfo:
        """The engine's identity; ``policy_version`` -1 until the first `publish` (its start-up weights)."""
        reply = self.client.server_info()
        return EngineInfo(policy_version=-1 if self.policy_version is None else self.policy_version,
                          vocab_size=reply.vocab_size, eos_token_ids=tuple(reply.eos_token_ids),
                          max_seq_len=reply.max_seq_len, model_identity=reply.model_config_hash)

    def submit(self, request) -> concurrent.futures.Future:
        """Checks ``request`` (`check_request` and the subclass's `_check`), then samples it.

        Raises:
          RequestRefusedError: the engine would mishandle it, or no weights were published yet.
        """
        if self.policy_version is None:
            raise RequestRefusedError(f"request {request.request_id}: the {self.name} engine at {self.address} serves "
                                      "its start-up weights, no policy version of the learner's: publish first")
        if request.logprob_mode not in self.capabilities.logprob_modes:
            served = next(iter(self.capabilities.logprob_modes)).name.lower()
            raise RequestRefusedError(f"request {request.request_id}: logprob_mode={request.logprob_mode.name.lower()}"
                                      f": this {self.name} engine returns {served} logprobs (a server setting: see "
                                      f"docs/engines/{self.name}.md)")
        check_request(request, self.limits)
        self._check(request)
        return self.client.submit(request)

    def publish(self, policy_version: int, weights: Mapping[str, np.ndarray]) -> int:
        """Writes ``weights`` as ``weights_dir/v<version>``; pause -> load -> resume; confirms the version.

        The engine resumes even when the load fails (it keeps its old weights). Records ``publish/*`` metrics.

        Raises:
          ValueError: ``policy_version`` is older than the one served (versions must increase).
          ControlPlaneError: the engine refused a step (named with its address and endpoint), or reports another
            version afterwards.
        """
        if policy_version == self.policy_version:
            return policy_version
        if self.policy_version is not None and policy_version < self.policy_version:
            raise ValueError(f"policy_version={policy_version}: the engine serves {self.policy_version} already "
                             "(versions must increase)")
        started = time.monotonic()
        directory = version_dir(self.weights_dir, policy_version)
        self._write_checkpoint(directory, weights)
        written = time.monotonic()
        self.client.hold()
        confirmed = False
        try:
            self._pause(self.pause_mode)
            try:
                self._load(directory, policy_version)
            finally:
                self._resume()
            self._confirm(policy_version)
            confirmed = True
        finally:
            if confirmed or self.policy_version is not None:
                self.client.release(policy_version if confirmed else self.policy_version)
        self.policy_version, self.served_dir = policy_version, directory
        collect_garbage(self.weights_dir, self.served_dir, self.keep_weight_versions)
        megabytes = sum(np.asarray(array).nbytes for array in weights.values()) / 1e6
        total = time.monotonic() - started
        self._publish_metrics = {"publish/write_s": written - started, "publish/load_s": total - (written - started),
                                 "publish/megabytes": megabytes, "publish/s_per_megabyte": total / max(megabytes, 1e-9)}
        return policy_version

    def may_have_restarted(self) -> None:
        """Forgets the version published: a restarted engine serves its start-up weights (or holds no adapter), and
        the engines' HTTP APIs cannot always tell (vLLM's has no version). Admission is held, and the next `publish`
        loads its version whatever was published before."""
        self.client.hold()
        self.policy_version = self.served_dir = None

    def metrics(self) -> dict[str, float]:
        return {**self.client.metrics(), **self._publish_metrics}

    def close(self) -> None:
        self.client.close()

    def _check(self, request) -> None:
        """Refuses what this engine cannot sample as asked (`RequestRefusedError`); nothing by default."""

    @abc.abstractmethod
    def _pause(self, mode: PauseMode) -> None:
        """Stops the engine generating (``mode``: what happens to running requests)."""

    @abc.abstractmethod
    def _load(self, directory: pathlib.Path, policy_version: int) -> None:
        """Has the paused engine load the checkpoint at ``directory`` as ``policy_version``."""

    @abc.abstractmethod
    def _resume(self) -> None:
        """Lets the engine generate again."""

    @abc.abstractmethod
    def _confirm(self, policy_version: int) -> None:
        """Raises `ControlPlaneError` unless the engine (resumed) serves ``policy_version``."""
