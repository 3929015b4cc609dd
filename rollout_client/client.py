"""The asynchronous rollout.v1 client (grpc.aio).

Retries: a Generate that fails with UNAVAILABLE before any message arrived is
retried with exponential backoff. One that breaks after messages arrived keeps the
samples that completed and asks again for exactly the missing sample indices under
the same request id (the server supersedes what is left of the old call), so a
retried request never yields a sample twice and never loses one. Other status codes
fail at once.

Silence: the client asks for a heartbeat every quarter of ``silence_timeout_s`` (rollout.v1's ``heartbeat_s``); a
stream that sends nothing at all for ``silence_timeout_s`` is cancelled and asked again, and one silent
``max_silences`` times in a row raises `ServerSilentError` (a hung server). A slow server is never cut by its
silence: it sends heartbeats (or chunks) while it works.
"""

import asyncio
import dataclasses
import math
import secrets
import uuid
from collections.abc import Mapping

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout_client import errors
from rollout_client.packed_arrays import TOKEN_ID_DTYPE, pack
from rollout_client.protocol import CLIENT_OPTIONS, SERVICE_NAME, bearer, pb, pb_grpc
from rollout_client.samples import Sample, StreamAssembler, build_sample
from rollout_client.sampling_params import KvCache, LogprobMode, PauseMode, SamplingParams
from rollout_client.validation import Expected, ValidationConfig, ValidationCounters, find_problem
from rollout_client.weight_chunks import split_weights

_RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)  # besides DEADLINE_EXCEEDED (`max_attempts`)


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    """How to reach the server and how patient to be."""

    target: str  # "host:port".
    auth_token: str | None = None  # Sent as "authorization: Bearer <token>".
    tls_root_certificates: bytes | None = None  # PEM; TLS when set.
    tls_server_name: str | None = None  # Overrides the name checked against the certificate.
    ready_timeout_s: float = 60.0  # How long `wait_ready` waits for SERVING.
    deadline_base_s: float = 30.0  # Generate deadline = base + per_token * max_new_tokens.
    deadline_per_token_s: float = 0.05
    # Each attempt after a missed deadline waits this many times longer than the one before: a server that is slow
    # (a loaded machine) rather than hung then finishes on a retry, instead of every attempt restarting the same
    # samples and missing the same deadline. The price: a hung (not dead) server is given up on after 1 + 2 + ... +
    # 2^4 = 31 first deadlines, against 5 with no growth (1.5 halves that, but ran the GSM8K recipe's CPU test at load
    # ~4 in 888 s against 2.0's 471 s: each missed attempt restarts its samples).
    deadline_growth: float = 2.0
    control_deadline_s: float = 120.0  # Pause, resume, info, abort, weight updates.
    # Generate attempts on UNAVAILABLE, CANCELLED (ended by the server or the transport, e.g. a server shutting
    # down: this client's own cancels end its task instead) or DEADLINE_EXCEEDED; a retry asks only for the samples
    # still missing, with the request's seed, so they are the same draws.
    max_attempts: int = 5
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    validation: ValidationConfig = ValidationConfig()
    # A Generate stream that sends nothing, not even a heartbeat, for this long is hung: cancelled and asked again;
    # silent `max_silences` times in a row, `ServerSilentError`. None: no silence check (the deadlines alone).
    silence_timeout_s: float | None = 45.0
    max_silences: int = 2

    def __post_init__(self):
        """Each error starts with the field's name.

        >>> ClientConfig("127.0.0.1:1", deadline_base_s=0.0)
        Traceback (most recent call last):
        ...
        ValueError: deadline_base_s=0.0: must be a finite number > 0
        """
        for name in ("ready_timeout_s", "deadline_base_s", "control_deadline_s", "initial_backoff_s",
                     "max_backoff_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value!r}: must be a finite number > 0")
        if not (math.isfinite(self.deadline_per_token_s) and self.deadline_per_token_s >= 0):
            raise ValueError(f"deadline_per_token_s={self.deadline_per_token_s!r}: must be a finite number >= 0")
        if not (math.isfinite(self.deadline_growth) and self.deadline_growth >= 1):
            raise ValueError(f"deadline_growth={self.deadline_growth!r}: must be a finite number >= 1")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts={self.max_attempts!r}: must be >= 1")
        if self.silence_timeout_s is not None and not (math.isfinite(self.silence_timeout_s)
                                                       and self.silence_timeout_s > 0):
            raise ValueError(f"silence_timeout_s={self.silence_timeout_s!r}: must be a finite number > 0, or None")
        if self.max_silences < 1:
            raise ValueError(f"max_silences={self.max_silences!r}: must be >= 1")


@dataclasses.dataclass(frozen=True)
class RolloutRequest:
    """One prompt to sample `num_samples` completions of."""

    prompt_token_ids: np.ndarray | list[int]
    sampling: SamplingParams = SamplingParams()
    num_samples: int = 1
    logprob_mode: LogprobMode = LogprobMode.PROCESSED
    request_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    min_policy_version: int | None = None  # Server must be at least this; tokens below are invalid.
    stream_chunk_tokens: int = 0  # 0 or >= 64.

    def to_proto(self, sample_indices: list[int] | None = None, heartbeat_s: float = 0.0) -> pb.GenerateRequest:
        """The wire request; `sample_indices` restricts it to those samples; ``heartbeat_s`` > 0 asks for a heartbeat
        when nothing else was sent for that long."""
        message = pb.GenerateRequest(
            request_id=self.request_id,
            prompt_token_ids=pack(self.prompt_token_ids, TOKEN_ID_DTYPE),
            sampling=self.sampling.to_proto(),
            num_samples=self.num_samples,
            sample_indices=sample_indices or [],
            logprob_mode=int(self.logprob_mode),
            stream_chunk_tokens=self.stream_chunk_tokens,
            heartbeat_s=heartbeat_s,
        )
        if self.min_policy_version is not None:
            message.min_policy_version = self.min_policy_version
        return message


class AsyncRolloutClient:
    """A client of one rollout server; create, then `await connect()`."""

    def __init__(self, config: ClientConfig):
        self.config = config
        self.counters = ValidationCounters()
        self.retries = 0
        self._metadata = bearer(config.auth_token) if config.auth_token else ()
        options = list(CLIENT_OPTIONS)
        if config.tls_root_certificates or config.tls_server_name:
            if config.tls_server_name:
                options.append(("grpc.ssl_target_name_override", config.tls_server_name))
            credentials = grpc.ssl_channel_credentials(config.tls_root_certificates)
            self._channel = grpc.aio.secure_channel(config.target, credentials, options=options)
        else:
            self._channel = grpc.aio.insecure_channel(config.target, options=options)
        self._stub = pb_grpc.RolloutServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._info: pb.ServerInfo | None = None
        self._abort_requested: set[str] = set()  # Request ids this client asked to abort and not yet answered.
        self._abort_pauses = 0  # How many pause(ABORT) calls this client made.

    async def connect(self) -> pb.ServerInfo:
        """Waits for SERVING, then fetches the server info."""
        await self.wait_ready()
        return await self.server_info()

    async def wait_ready(self, timeout_s: float | None = None) -> None:
        """Polls health until rollout.v1 is SERVING.

        Raises:
          ServerNotReadyError: not SERVING within the timeout.
        """
        timeout_s = self.config.ready_timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        give_up = loop.time() + timeout_s
        last = "no answer"
        while loop.time() < give_up:
            try:
                reply = await self._health.Check(
                    health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                    timeout=max(0.1, min(2.0, give_up - loop.time())), wait_for_ready=True)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.aio.AioRpcError as error:
                last = f"{error.code().name}: {error.details()}"
            await asyncio.sleep(min(0.1, max(0.0, give_up - loop.time())))
        raise errors.ServerNotReadyError(
            f"rollout server at {self.config.target} not SERVING after {timeout_s:.1f}s (last: {last})")

    async def server_info(self) -> pb.ServerInfo:
        """Fetches (and caches) policy version, vocabulary size, eos ids, config hash."""
        self._info = await self._control(self._stub.GetServerInfo, pb.GetServerInfoRequest())
        return self._info

    def generate_deadline_s(self, request: RolloutRequest | None) -> float:
        """Deadline of one Generate attempt, sized from max_new_tokens (None: the server's whole context)."""
        max_new_tokens = (request and request.sampling.max_new_tokens) or (
            self._info.max_seq_len if self._info else 4096)
        return self.config.deadline_base_s + self.config.deadline_per_token_s * max_new_tokens

    async def generate(self, request: RolloutRequest) -> list[Sample]:
        """Samples `request`; returns the valid samples ordered by sample index.

        Raises:
          InvalidRolloutError: a sample is invalid and validation says "raise".
          RolloutDeadlineError, RolloutUnavailableError, grpc.aio.AioRpcError.
        """
        try:
            return await self._generate(request)
        finally:
            self._abort_requested.discard(request.request_id)

    async def _generate(self, request: RolloutRequest) -> list[Sample]:
        """`generate`, with its retries."""
        if self._info is None:
            await self.server_info()
        if request.sampling.seed is None:  # Fixed here so that a retried sample is the same draw.
            request = dataclasses.replace(
                request, sampling=dataclasses.replace(request.sampling, seed=secrets.randbits(63)))
        prompt = np.asarray(request.prompt_token_ids, np.int32)
        results: dict[int, Sample | None] = {}  # None: received and dropped.
        deadline_s = self.generate_deadline_s(request)
        abort_pauses = self._abort_pauses
        failures = silences = 0
        while len(results) < request.num_samples:
            missing = [i for i in range(request.num_samples) if i not in results]
            received_before = len(results)
            try:
                strays = await self._generate_once(request, prompt, missing, results, deadline_s, abort_pauses)
            except grpc.aio.AioRpcError as error:
                deadline = error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                if _too_large(error):  # a message over the size limit: this call's missing samples are lost
                    self._drop(request, [i for i in missing if i not in results], results, "message_too_large",
                               error.details())
                    continue
                if not deadline and error.code() not in _RETRIED:
                    raise
                failures = 0 if len(results) > received_before else failures + 1
                if deadline and failures >= self.config.max_attempts:
                    raise errors.RolloutDeadlineError(
                        f"Generate {request.request_id}: no result in {failures} attempts, the last within "
                        f"{deadline_s:.1f}s (max_new_tokens={request.sampling.max_new_tokens}); raise the deadline "
                        f"(ClientConfig.deadline_base_s) if the server is just slow") from error
                if deadline:
                    deadline_s *= self.config.deadline_growth
                if failures >= self.config.max_attempts:
                    raise errors.RolloutUnavailableError(
                        f"Generate {request.request_id}: server {self.config.target} unavailable after "
                        f"{failures} attempts: {error.details()}") from error
                self.retries += 1
                await asyncio.sleep(min(self.config.max_backoff_s,
                                        self.config.initial_backoff_s * 2 ** max(failures - 1, 0)))
                continue
            except _Silence:
                silences = 0 if len(results) > received_before else silences + 1
                if silences >= self.config.max_silences:
                    raise errors.ServerSilentError(
                        f"Generate {request.request_id}: the server at {self.config.target} sent nothing, not even a "
                        f"heartbeat, for {self.config.silence_timeout_s:g} s, {silences} times in a row: it is hung "
                        "(raise server.silence_timeout_s if it is only slow and sends no heartbeats)") from None
                self.retries += 1
                continue
            lost = [i for i in missing if i not in results]
            if strays:  # the samples of final messages under unknown indices, or extra messages
                self._drop(request, lost, results, "unknown_sample_index", f"final messages for sample indices "
                           f"{strays} that were not asked for")
            elif lost:
                self._drop(request, lost, results, "missing_final", "the stream ended without their final message")
        return [results[i] for i in sorted(results) if results[i] is not None]

    def expected(self, request: RolloutRequest, abort_requested: bool = False) -> Expected:
        """What each sample of `request` must satisfy, from the request, the server info and `config.validation`."""
        validation = self.config.validation
        vocab_size = min(self._info.vocab_size, validation.vocab_size or self._info.vocab_size)
        return Expected(sampling=request.sampling.to_proto(), vocab_size=vocab_size,
                        version_floor=request.min_policy_version, min_logprob=validation.min_logprob,
                        abort_requested=abort_requested)

    async def _generate_once(self, request: RolloutRequest, prompt: np.ndarray, indices: list[int],
                             results: dict[int, Sample | None], deadline_s: float, abort_pauses: int) -> list[int]:
        """One Generate call for `indices`; stores each final sample in `results` (None: dropped); returns the
        sample indices of final messages it did not ask for.

        A sample index that already has a result is a duplicate: dropped and counted, the first one kept. An
        ABORT finish is expected only when this client aborted the request, or paused with ABORT, since
        `abort_pauses` pauses were counted.
        """
        subset = indices if len(indices) < request.num_samples else None
        silence_s = self.config.silence_timeout_s
        call = self._stub.Generate(request.to_proto(subset, heartbeat_s=silence_s / 4 if silence_s else 0.0),
                                   timeout=deadline_s, metadata=self._metadata)
        try:
            return await self._read_stream(request, _unless_silent(call, silence_s), prompt, indices, results,
                                           abort_pauses)
        finally:
            call.cancel()  # a no-op once the stream ended; else the call (e.g. after a raise) stops on the server

    async def _read_stream(self, request: RolloutRequest, stream, prompt: np.ndarray, indices: list[int],
                           results: dict[int, Sample | None], abort_pauses: int) -> list[int]:
        """Stores each final sample of a Generate ``stream`` in ``results`` (None: dropped); see `_generate_once`."""
        assembler = StreamAssembler()
        strays = []
        async for response in stream:
            if response.WhichOneof("payload") == "heartbeat":
                continue
            raw = assembler.add(response)
            if raw is None:
                continue
            if response.sample_index in results:
                problem = "duplicate_sample_index", "a second final message for this sample index"
            elif response.sample_index not in indices:
                strays.append(response.sample_index)
                continue
            else:
                aborting = request.request_id in self._abort_requested or self._abort_pauses != abort_pauses
                problem = find_problem(raw, self.expected(request, aborting))
            if problem is not None:
                name, detail = problem
                if self.config.validation.on_invalid == "raise":
                    raise errors.InvalidRolloutError(
                        f"request {request.request_id} sample {response.sample_index}: {name}: {detail}")
                self.counters.dropped[name] += 1
                results.setdefault(response.sample_index, None)
                continue
            self.counters.accepted += 1
            results[response.sample_index] = build_sample(
                raw, request.request_id, response.sample_index, prompt, request.logprob_mode)
        return strays

    def _drop(self, request: RolloutRequest, indices: list[int], results: dict[int, Sample | None], problem: str,
              detail: str) -> None:
        """Drops and counts (one per sample, at least one) the samples ``indices`` of a faulty reply, as validation
        drops a bad sample; or raises `InvalidRolloutError` when validation says "raise"."""
        if self.config.validation.on_invalid == "raise":
            raise errors.InvalidRolloutError(f"request {request.request_id} samples {indices}: {problem}: {detail}")
        self.counters.dropped[problem] += max(len(indices), 1)
        for index in indices:
            results.setdefault(index, None)

    async def pause(self, mode: PauseMode = PauseMode.KEEP, kv_cache: KvCache = KvCache.RECOMPUTE) -> int:
        """Pauses generation; returns the server's policy version. ``kv_cache``: what a weight update while paused
        does with the cache of the requests KEEP keeps (partial rollouts).

        With ABORT, the samples it ends are returned (finish reason ABORT) instead of dropped as `aborted`. WAIT
        waits as long as a generation of the server's whole context may take (`generate_deadline_s`).
        """
        if mode == PauseMode.ABORT:  # Counted before the call: the aborted samples may arrive before its reply.
            self._abort_pauses += 1
        deadline_s = self.config.control_deadline_s
        if mode == PauseMode.WAIT:
            if self._info is None:
                await self.server_info()
            deadline_s += self.generate_deadline_s(None)
        reply = await self._control(self._stub.PauseGeneration,
                                    pb.PauseGenerationRequest(mode=int(mode), kv_cache=int(kv_cache)), deadline_s)
        return reply.policy_version

    async def resume(self) -> int:
        """Resumes generation; returns the server's policy version."""
        reply = await self._control(self._stub.ResumeGeneration, pb.ResumeGenerationRequest())
        return reply.policy_version

    async def abort(self, request_ids: list[str]) -> list[str]:
        """Aborts requests; returns those that were active.

        Their samples that end by the abort are returned (finish reason ABORT) instead of dropped as `aborted`.
        """
        self._abort_requested.update(request_ids)  # Before the call: the aborted samples may arrive before its reply.
        try:
            reply = await self._control(self._stub.Abort, pb.AbortRequest(request_ids=request_ids))
        except BaseException:
            self._abort_requested.difference_update(request_ids)
            raise
        self._abort_requested.difference_update(set(request_ids) - set(reply.aborted_request_ids))
        return list(reply.aborted_request_ids)

    async def update_weights_from_path(self, policy_version: int, path: str,
                                       weights_format: int = pb.WEIGHTS_FORMAT_SAFETENSORS) -> int:
        """Has the (paused) server load weights from its file system; returns its new version."""
        request = pb.UpdateWeightsRequest(policy_version=policy_version, path=path, format=weights_format)
        return (await self._control(self._stub.UpdateWeights, request)).policy_version

    async def stream_weights(self, policy_version: int, weights: Mapping[str, np.ndarray]) -> int:
        """Streams weights to the (paused) server in chunks; returns its new version."""
        call = self._stub.StreamWeights(split_weights(weights, policy_version),
                                        timeout=self.config.control_deadline_s, metadata=self._metadata)
        return (await call).policy_version

    async def publish_weights(self, policy_version: int, *, weights: Mapping[str, np.ndarray] | None = None,
                              path: str | None = None, weights_format: int = pb.WEIGHTS_FORMAT_SAFETENSORS,
                              pause_mode: PauseMode = PauseMode.KEEP, kv_cache: KvCache = KvCache.RECOMPUTE
                              ) -> int:
        """Pause (``pause_mode``, ``kv_cache``: see `pause`) -> update (streamed `weights`, or `path` on the
        server) -> resume, then confirm.

        The server resumes even when the update fails (it keeps its old weights).

        Raises:
          RolloutError: the server does not report `policy_version` afterwards.
        """
        if (weights is None) == (path is None):
            raise ValueError("publish_weights: pass exactly one of weights or path")
        await self.pause(pause_mode, kv_cache)
        try:
            if weights is not None:
                await self.stream_weights(policy_version, weights)
            else:
                await self.update_weights_from_path(policy_version, path, weights_format)
        finally:
            served = await self.resume()  # the reply carries the version serving from now on
        if served != policy_version:
            raise errors.RolloutError(
                f"publish_weights: server reports policy version {served}, expected {policy_version}")
        return served

    def metrics(self) -> dict[str, int]:
        """Validation counters, the retry count and the server's programs built (as of the last server info)."""
        compiled = {"server/compiled_programs": self._info.compiled_programs} if self._info is not None else {}
        return {**self.counters.as_dict(), "generate/retries": self.retries, **compiled}

    async def close(self) -> None:
        await self._channel.close()

    async def _control(self, method, request, deadline_s: float | None = None):
        try:
            return await method(request, timeout=deadline_s or self.config.control_deadline_s,
                                metadata=self._metadata)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise errors.RolloutDeadlineError(f"{type(request).__name__}: {error.details()}") from error
            raise


def _too_large(error: grpc.aio.AioRpcError) -> bool:
    """Whether a call failed on a message over gRPC's size limit (sent by the server, or received here)."""
    return error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "message larger than max" in (error.details() or "")


class _Silence(Exception):
    """A Generate stream sent nothing for ``silence_timeout_s`` (it was cancelled)."""


async def _unless_silent(call, silence_s: float | None):
    """The messages of a Generate ``call``; raises `_Silence` (after cancelling the call) when none comes for
    ``silence_s`` seconds (None: waits as long as the call's deadline allows)."""
    messages = aiter(call)
    while True:
        try:
            message = await asyncio.wait_for(anext(messages), silence_s)
        except StopAsyncIteration:
            return
        except TimeoutError as error:
            if isinstance(error, errors.RolloutError):  # raised by the stream itself (an engine's), not a silence
                raise
            call.cancel()
            raise _Silence from None
        yield message
