"""The rollout.v1 servicer: turns RPCs into scheduler calls and outputs into messages.

Runs on the grpc.aio event loop. Blocking scheduler calls (pause, weight loading)
go to worker threads so the loop keeps streaming other requests.
"""

import asyncio
import functools
import pathlib

import grpc
import numpy as np

from rollout_client.packed_arrays import LOGPROB_DTYPE, TOKEN_ID_DTYPE, pack
from rollout_client.protocol import pb, pb_grpc
from rollout_client.sampling_params import KvCache, PauseMode
from rollout_client.server.generator import (
    PreconditionError,
    SequenceOutput,
    SequenceSpec,
    WeightSpec,
    check_tensor_layout,
    spec_bytes,
)
from rollout_client.server.request_resolution import resolve_request
from rollout_client.server.scheduler import Scheduler
from rollout_client.server.weights_io import PathsDisabledError, WeightReaders, load_weights
from rollout_client.weight_chunks import WeightsAssembler


class RolloutServicer(pb_grpc.RolloutServiceServicer):
    """Implements rollout.v1 on top of a `Scheduler`.

    Args:
      scheduler: runs the generation.
      info: the generator's `GeneratorInfo`.
      pause_wait_timeout_s: how long Pause(WAIT) waits for active requests to finish
        before it fails with DEADLINE_EXCEEDED (and generation continues unpaused).
      weight_readers: the generator's `weight_readers`, for UpdateWeights from a path.
      weight_spec: the generator's `weight_spec`; a StreamWeights call is refused at the first chunk of a tensor
        the generator does not have, or as soon as it has sent more bytes than the weights hold.
      weights_dir: the only directory UpdateWeights reads paths in; None: UpdateWeights(path) is refused.
    """

    def __init__(self, scheduler: Scheduler, info, pause_wait_timeout_s: float, weight_readers: WeightReaders,
                 weight_spec: WeightSpec, weights_dir: pathlib.Path | None = None):
        self._scheduler = scheduler
        self._info = info
        self._pause_wait_timeout_s = pause_wait_timeout_s
        self._weight_readers = weight_readers
        self._weight_spec = weight_spec
        self._weight_bytes = spec_bytes(weight_spec)
        self._weights_dir = weights_dir
        self._requests: dict[str, list[int]] = {}
        self._weights_lock = asyncio.Lock()

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            specs = resolve_request(request, self._info)
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        if request.HasField("min_policy_version") and self._scheduler.policy_version < request.min_policy_version:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"min_policy_version: {request.min_policy_version} is above the server's "
                                f"{self._scheduler.policy_version}")
        self._cancel(request.request_id)  # A repeated id supersedes the earlier request.
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()

        def deliver(spec: SequenceSpec, output: SequenceOutput) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, (spec, output))

        sequence_ids = [self._scheduler.submit(spec, functools.partial(deliver, spec), request.stream_chunk_tokens)
                        for spec in specs]
        self._requests[request.request_id] = sequence_ids
        try:
            unfinished = len(sequence_ids)
            while unfinished:
                try:  # a heartbeat when nothing else was sent for heartbeat_s (rollout.v1: the client hears silence)
                    spec, output = await asyncio.wait_for(outputs.get(), _heartbeat_interval(request.heartbeat_s))
                except TimeoutError:
                    yield pb.GenerateResponse(heartbeat=pb.Heartbeat(paused=self._scheduler.paused))
                    continue
                if output.finish_reason is None:
                    yield self.chunk_message(spec, output)
                else:
                    unfinished -= 1
                    yield self.final_message(spec, output)
        finally:
            for sequence_id in sequence_ids:
                self._scheduler.cancel(sequence_id)
            if self._requests.get(request.request_id) is sequence_ids:
                del self._requests[request.request_id]

    def chunk_message(self, spec: SequenceSpec, output: SequenceOutput) -> pb.GenerateResponse:
        """The wire form of a chunk."""
        return pb.GenerateResponse(sample_index=spec.sample_index, chunk=pb.SampleChunk(
            token_ids=pack(output.token_ids, TOKEN_ID_DTYPE), logprobs=pack(output.logprobs, LOGPROB_DTYPE),
            version_spans=_spans(output.version_spans)))

    def final_message(self, spec: SequenceSpec, output: SequenceOutput) -> pb.GenerateResponse:
        """The wire form of a sample's final message."""
        return pb.GenerateResponse(sample_index=spec.sample_index, final=pb.SampleResult(
            token_ids=pack(output.token_ids, TOKEN_ID_DTYPE),
            logprobs=pack(output.logprobs, LOGPROB_DTYPE),
            version_spans=_spans(output.version_spans),
            finish_reason=int(output.finish_reason),
            prompt_tokens=output.prompt_tokens,
            completion_tokens=output.completion_tokens,
            timings=pb.Timings(queue_s=output.queue_s, generate_s=output.generate_s),
            sampling=spec.sampling.to_proto(),
        ))

    async def GetServerInfo(self, request, context) -> pb.ServerInfo:
        return pb.ServerInfo(
            policy_version=self._scheduler.policy_version,
            vocab_size=self._info.vocab_size,
            eos_token_ids=self._info.eos_token_ids,
            model_config_hash=self._info.model_config_hash,
            dtype=self._info.dtype,
            max_seq_len=self._info.max_seq_len,
            paused=self._scheduler.paused,
            compiled_programs=self._scheduler.compiled_programs,
        )

    async def PauseGeneration(self, request, context) -> pb.PauseGenerationResponse:
        if request.mode not in (pb.PAUSE_MODE_ABORT, pb.PAUSE_MODE_WAIT, pb.PAUSE_MODE_KEEP):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"mode: must be ABORT, WAIT or KEEP, got {pb.PauseMode.Name(request.mode)}")
        if request.kv_cache not in (pb.KV_CACHE_UNSPECIFIED, pb.KV_CACHE_RECOMPUTE, pb.KV_CACHE_KEEP):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"kv_cache: must be RECOMPUTE or KEEP (or unset: RECOMPUTE), got {request.kv_cache}")
        kv_cache = KvCache.KEEP if request.kv_cache == pb.KV_CACHE_KEEP else KvCache.RECOMPUTE
        try:
            await asyncio.to_thread(self._scheduler.pause, PauseMode(request.mode), self._pause_wait_timeout_s,
                                    kv_cache)
        except TimeoutError as error:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(error))
        return pb.PauseGenerationResponse(policy_version=self._scheduler.policy_version)

    async def ResumeGeneration(self, request, context) -> pb.ResumeGenerationResponse:
        self._scheduler.resume()
        return pb.ResumeGenerationResponse(policy_version=self._scheduler.policy_version)

    async def UpdateWeights(self, request, context) -> pb.UpdateWeightsResponse:
        async def load():
            self._scheduler.check_version(request.policy_version)
            weights = await asyncio.to_thread(load_weights, request.path, request.format, self._weight_readers,
                                              self._weights_dir)
            return request.policy_version, weights

        try:
            return await self._update(load)
        except _Refusal as refusal:
            await context.abort(refusal.code, refusal.details)

    async def StreamWeights(self, request_iterator, context) -> pb.UpdateWeightsResponse:
        try:
            return await self._update(functools.partial(self._receive_weights, request_iterator))
        except _Refusal as refusal:
            # The rest of the stream is read and dropped: a client still sending when the call ends sees an INTERNAL
            # error from gRPC instead of the reason.
            async for _ in request_iterator:
                pass
            await context.abort(refusal.code, refusal.details)

    async def _receive_weights(self, request_iterator) -> tuple[int, dict[str, np.ndarray]]:
        """The streamed ``(policy_version, weights)``, assembled as the chunks arrive (`WeightsAssembler`) and
        checked one by one: a bad version is refused at the header, before any tensor is read, a tensor the engine
        does not have at its first chunk, and the stream as soon as it sends more bytes than the engine's weights
        hold."""
        assembler, received, first = WeightsAssembler(), 0, True
        async for chunk in request_iterator:
            if chunk.HasField("header") and first:
                self._scheduler.check_version(chunk.header.policy_version)
            first = False
            if chunk.HasField("tensor"):
                check_tensor_layout(self._weight_spec, chunk.tensor.name, chunk.tensor.shape,
                                    _dtype(chunk.tensor.dtype))
            received += len(chunk.tensor.data)
            if received > self._weight_bytes:
                raise ValueError(f"tensor.data: more than the {self._weight_bytes} bytes of this engine's weights")
            assembler.add(chunk)
        return assembler.result()

    async def _update(self, get_weights) -> pb.UpdateWeightsResponse:
        """Loads the ``(policy_version, weights)`` that `get_weights` returns; one update at a time, while paused.

        Pause is checked before `get_weights` reads anything, so an unpaused server keeps no byte of a call.

        Raises:
          _Refusal: with the status and details the call fails with.
        """
        async with self._weights_lock:
            if not self._scheduler.paused:
                raise _Refusal(grpc.StatusCode.FAILED_PRECONDITION, "UpdateWeights: generation must be paused first")
            try:
                policy_version, weights = await get_weights()
                await asyncio.to_thread(self._scheduler.update_weights, weights, policy_version)
            except (PreconditionError, PathsDisabledError) as error:
                raise _Refusal(grpc.StatusCode.FAILED_PRECONDITION, str(error)) from None
            except ValueError as error:
                raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from None
        return pb.UpdateWeightsResponse(policy_version=self._scheduler.policy_version)

    async def Abort(self, request, context) -> pb.AbortResponse:
        aborted = [request_id for request_id in request.request_ids if self._cancel(request_id)]
        return pb.AbortResponse(aborted_request_ids=aborted)

    def _cancel(self, request_id: str) -> bool:
        """Aborts the samples of an active request; False if there is none."""
        sequence_ids = self._requests.pop(request_id, None)
        for sequence_id in sequence_ids or ():
            self._scheduler.cancel(sequence_id)
        return sequence_ids is not None


class _Refusal(Exception):
    """A weight update the server refuses, with the status the call fails with."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code = code
        self.details = details


def _spans(spans) -> list[pb.VersionSpan]:
    return [pb.VersionSpan(start=start, end=end, policy_version=version) for start, end, version in spans]


def _dtype(name: str) -> np.dtype:
    """The numpy dtype a chunk names; ValueError (not numpy's TypeError) for an unknown one."""
    try:
        return np.dtype(name)
    except TypeError:
        raise ValueError(f"tensor.dtype: unknown dtype {name!r}") from None


def _heartbeat_interval(heartbeat_s: float) -> float | None:
    """How long a Generate stream waits for an output before it sends a heartbeat: None (forever) when the request
    asked for none; at least 50 ms, so a tiny value cannot flood the stream."""
    return max(heartbeat_s, 0.05) if heartbeat_s > 0 else None
