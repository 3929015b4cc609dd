"""rollout.v1 calls answered by an engine that speaks an smg proto: the data plane of every smg engine.

`SmgAdapter` has the methods of rollout.v1's ``RolloutServiceStub`` that `rollout_client.AsyncRolloutClient` calls for
sampling (``Generate``, ``GetServerInfo``, ``Abort``), and `SmgHealth` the ``grpc.health.v1`` check it waits on.
They translate to the engine's proto (`rollout_client.engines.smg.dialects.SmgDialect`), so the client's retries,
deadlines, validation drops and `Sample` assembly apply to these engines unchanged:

- One rollout.v1 request of ``num_samples`` becomes one engine request per sample (engine request id
  ``"<request_id>/<sample_index>"``), or one request with ``n`` where the engine has it. Each is streamed: an
  aborted streamed request keeps the tokens it sent, a non-streamed one loses them.
- Every sampling value is resolved and sent explicitly (`resolve_sampling`), and echoed back to the client as the
  sample's resolved parameters (these engines echo nothing).
- Policy versions: the engines report none. Each sample's tokens carry the version the engine served when the
  request was admitted (`policy_version`); while the engine changes weights, admission is held (`hold`,
  `release`), so no request is stamped with a version it was not sampled by.
- Partial rollouts (``continue_interrupted``): a sample that a publish interrupted (its stream ended without a
  finish, or with "abort", after a `hold`) is continued once admission is released: one more engine request whose
  prompt is the prompt and the exact token ids received so far (token in, token out, as multi-turn episodes do),
  for the tokens still allowed; its tokens carry the new version (one version span per segment). A sample of a
  request aborted by `Abort` is not continued.
- A stream that ends without the engine's final message (aborted, or the engine stopping) is an ABORT sample with
  the tokens received; the client keeps it if it asked for the abort, and drops and counts it otherwise.
- Heartbeats (rollout.v1's ``heartbeat_s``): while a call waits for its samples, a heartbeat every ``heartbeat_s``
  as long as the engine makes progress (a message of any of its streams since the last heartbeat), admission is
  held (a publish), or the engine has streamed nothing yet (it may compile its programs on first use): an engine
  that hangs once it has served stays silent, and the client takes its silence for a hang.
- A failed call to a launched engine first asks ``check_alive``, which raises a clear error if the engine's process
  died (address, log, exit code) instead of retrying a dead server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence

import grpc
import numpy as np
from grpc_health.v1 import health_pb2

from rollout_client.engines.smg.dialects import EngineSampling, SmgDialect
from rollout_client.errors import ProtocolError
from rollout_client.packed_arrays import LOGPROB_DTYPE, TOKEN_ID_DTYPE, pack
from rollout_client.protocol import pb
from rollout_client.request_guards import RequestRefusedError

_FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
                   "abort": pb.FINISH_REASON_ABORT}


def resolve_sampling(asked: pb.SamplingParams, prompt_tokens: int, model_info, n: int) -> EngineSampling:
    """Every sampling value of a rollout.v1 request, unset ones resolved as Tether's server resolves them.

    ``top_k`` at or above the vocabulary is sent as 0 (the same sampler; mlx-lm raises on it).
    """
    def value(name, default):
        return getattr(asked, name) if asked.HasField(name) else default

    top_k = value("top_k", 0)
    stops = (tuple(asked.stop_token_ids.token_ids) if asked.HasField("stop_token_ids")
             else tuple(model_info.eos_token_ids))
    return EngineSampling(temperature=value("temperature", 1.0), top_k=0 if top_k >= model_info.vocab_size else top_k,
                          top_p=value("top_p", 1.0), min_p=value("min_p", 0.0),
                          max_new_tokens=value("max_new_tokens", model_info.max_context_length - prompt_tokens),
                          stop_token_ids=stops, n=n, stop_strings=tuple(asked.stop_strings))


def echoed_sampling(asked: pb.SamplingParams, sent: EngineSampling) -> pb.SamplingParams:
    """The sample's resolved parameters: the request's own values, and what was sent for those it left unset."""
    echo = pb.SamplingParams()
    echo.CopyFrom(asked)
    for name in ("temperature", "top_k", "top_p", "min_p", "max_new_tokens"):
        if not echo.HasField(name):
            setattr(echo, name, getattr(sent, name))
    if not echo.HasField("stop_token_ids"):
        echo.stop_token_ids.SetInParent()
        echo.stop_token_ids.token_ids.extend(sent.stop_token_ids)
    return echo


class _SampleState:
    """One sample's tokens, logprobs and version spans as they stream in."""

    def __init__(self):
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.spans: list[list[int]] = []  # [start, end, policy version], one per engine request (segment)
        self.finish_reason: str | None = None
        self.holds = 0  # `SmgAdapter.holds` when the current segment began

    def start_segment(self, version: int, holds: int) -> None:
        """The tokens that follow are sampled by ``version``; ``holds``: the adapter's `SmgAdapter.holds` now."""
        self.spans.append([len(self.token_ids), len(self.token_ids), version])
        self.finish_reason = None
        self.holds = holds

    def add(self, part, token_ids) -> None:
        self.token_ids.extend(token_ids)
        self.logprobs.extend(part.output_logprobs.token_logprobs)
        self.spans[-1][1] = len(self.token_ids)

    def clear_segment(self) -> None:
        """Drops the current segment's tokens (a final message that repeats them follows)."""
        start = self.spans[-1][0]
        del self.token_ids[start:], self.logprobs[start:]
        self.spans[-1][1] = start


class SmgAdapter:
    """The rollout.v1 sampling calls over one smg engine (see the module docstring).

    Args:
      channel: a ``grpc.aio`` channel to the engine.
      dialect: the engine's proto.
      check_alive: raises if a launched engine's process has exited; None for an external engine.
    """

    def __init__(self, channel: grpc.aio.Channel, dialect: SmgDialect, check_alive: Callable[[], None] | None,
                 continue_interrupted: bool = False):
        self.dialect = dialect
        self.engine = dialect.stub(channel)
        self.check_alive = check_alive
        self.continue_interrupted = continue_interrupted
        self.holds = 0  # `hold` calls so far: a stream that ends aborted across one was interrupted by a publish
        self.continuations = 0  # engine requests that continued an interrupted sample
        self.policy_version = 0  # the version the engine serves; stamped on the tokens of requests admitted now
        self.model_info = None  # the engine's GetModelInfoResponse, once fetched
        self.engine_calls = 0  # Generate calls sent to the engine
        self.progress = 0  # messages received on the engine's Generate streams: a heartbeat's evidence of progress
        self._admission = asyncio.Event()
        self._admission.set()
        self._in_flight: dict[str, set[str]] = {}  # rollout.v1 request id -> its engine request ids now running
        self._aborted: set[str] = set()  # rollout.v1 request ids `Abort` asked for (never continued)
        self._background: set[asyncio.Task] = set()

    def hold(self) -> None:
        """Admits no new engine request until `release` (the engine is changing weights)."""
        self.holds += 1
        self._admission.clear()

    def release(self, policy_version: int) -> None:
        """Admits requests again; their tokens are stamped ``policy_version``."""
        self.policy_version = policy_version
        self._admission.set()

    async def call(self, method: str, request, timeout: float, metadata=()):
        """One unary engine call; a launched engine that died raises `check_alive`'s error."""
        try:
            return await getattr(self.engine, method)(request, timeout=timeout, metadata=metadata)
        except grpc.aio.AioRpcError as error:
            self._raise_if_dead(error)
            raise

    def _raise_if_dead(self, error: grpc.aio.AioRpcError) -> None:
        if error.code() == grpc.StatusCode.UNAVAILABLE and self.check_alive is not None:
            self.check_alive()

    async def GetServerInfo(self, request: pb.GetServerInfoRequest, timeout: float, metadata=()) -> pb.ServerInfo:
        """The engine's GetModelInfo as rollout.v1's ServerInfo, with the version it serves."""
        info = await self.call("GetModelInfo", self.dialect.pb.GetModelInfoRequest(), timeout, metadata)
        self.model_info = info
        return pb.ServerInfo(policy_version=self.policy_version, vocab_size=info.vocab_size,
                             eos_token_ids=info.eos_token_ids, model_config_hash=info.model_type,
                             max_seq_len=info.max_context_length)

    async def Abort(self, request: pb.AbortRequest, timeout: float, metadata=()) -> pb.AbortResponse:
        """Aborts every engine request of the given rollout.v1 requests; returns those that were running."""
        running = [request_id for request_id in request.request_ids if self._in_flight.get(request_id)]
        self._aborted.update(running)
        engine_ids = [engine_id for request_id in running for engine_id in self._in_flight[request_id]]
        for message in self.dialect.abort_requests(engine_ids) if engine_ids else ():
            await self.call("Abort", message, timeout, metadata)
        return pb.AbortResponse(aborted_request_ids=running)

    def Generate(self, request: pb.GenerateRequest, timeout: float, metadata=()) -> _FanOut:
        """Samples ``request`` (its ``sample_indices``, else all ``num_samples``); yields rollout.v1 final messages."""
        if request.logprob_mode not in {int(mode) for mode in self.dialect.logprob_modes}:
            raise RequestRefusedError(
                f"request {request.request_id}: logprob_mode {request.logprob_mode}: the {self.dialect.name} engine "
                f"returns only {', '.join(mode.name.lower() for mode in self.dialect.logprob_modes)} logprobs")
        indices = list(request.sample_indices) or list(range(request.num_samples))
        return _FanOut(self, request, indices, timeout, metadata)

    def _abort_quietly(self, engine_ids: Sequence[str], metadata) -> None:
        """Sends an Abort for cancelled engine requests in the background (best effort: the engine may be gone)."""
        async def abort():
            for message in self.dialect.abort_requests(engine_ids):
                try:
                    await self.engine.Abort(message, timeout=5.0, metadata=metadata)
                except grpc.aio.AioRpcError:
                    return
        task = asyncio.get_running_loop().create_task(abort())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


class _FanOut:
    """One rollout.v1 Generate call: engine requests for its sample indices, their final messages as they end."""

    def __init__(self, stub: SmgAdapter, request: pb.GenerateRequest, indices: list[int], timeout: float, metadata):
        self._stub, self._request, self._indices = stub, request, indices
        self._timeout, self._metadata = timeout, metadata
        self._tasks: list[asyncio.Task] = []

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def __aiter__(self):
        stub, request = self._stub, self._request
        async for item in self._waiting(stub._admission.wait()):
            if not isinstance(item, _Done):
                yield item
        if stub.model_info is None:
            await stub.GetServerInfo(pb.GetServerInfoRequest(), self._timeout, self._metadata)
        prompt = np.frombuffer(request.prompt_token_ids, TOKEN_ID_DTYPE).tolist()
        groups = [self._indices] if stub.dialect.native_n else [[index] for index in self._indices]
        finals: asyncio.Queue = asyncio.Queue()
        version = stub.policy_version  # admitted now: sampled by the weights the engine serves now
        self._tasks = [asyncio.get_running_loop().create_task(self._sample(group, prompt, version, finals))
                       for group in groups]
        try:
            for _ in self._indices:
                async for item in self._waiting(finals.get()):
                    if not isinstance(item, _Done):
                        yield item
                message = item.value
                if message is not None:  # None: that engine request failed; the others' samples come first
                    yield message
            failures = [result for result in await asyncio.gather(*self._tasks, return_exceptions=True)
                        if isinstance(result, BaseException)]
            if failures:  # an error that is not a retryable gRPC status (e.g. a dead engine) wins
                raise min(failures, key=lambda error: isinstance(error, grpc.aio.AioRpcError))
        finally:
            self.cancel()

    async def _waiting(self, awaitable):
        """Awaits ``awaitable``, meanwhile yielding a heartbeat every ``heartbeat_s`` (none when 0) while the engine
        makes progress, admission is held, or the engine has streamed nothing yet (it may compile on first use);
        then yields ``_Done(result)``."""
        stub, task = self._stub, asyncio.ensure_future(awaitable)
        interval = max(self._request.heartbeat_s, 0.05) if self._request.heartbeat_s > 0 else None
        seen = stub.progress
        try:
            while not (await asyncio.wait({task}, timeout=interval))[0]:
                if stub.progress != seen or not stub._admission.is_set() or not stub.progress:
                    seen = stub.progress
                    yield pb.GenerateResponse(heartbeat=pb.Heartbeat(paused=not stub._admission.is_set()))
        finally:
            task.cancel()
        yield _Done(task.result())

    async def _sample(self, indices: list[int], prompt: list[int], version: int, finals: asyncio.Queue) -> None:
        """One engine request for ``indices`` (and one more per sample a publish interrupted, with
        ``continue_interrupted``); puts one final message per index on ``finals`` (None if it failed)."""
        stub, request = self._stub, self._request
        engine_id = f"{request.request_id}/{indices[0]}" if len(indices) == 1 else request.request_id
        sent = resolve_sampling(request.sampling, len(prompt), stub.model_info, n=len(indices))
        states = [_SampleState() for _ in indices]
        running = stub._in_flight.setdefault(request.request_id, set())
        started = time.monotonic()
        delivered = False
        try:
            await self._segment(engine_id, prompt, sent, version, states, running)
            if stub.continue_interrupted:
                await asyncio.gather(*(self._continue(f"{request.request_id}/{index}", prompt, sent, state, running)
                                       for index, state in zip(indices, states)))
            elapsed = time.monotonic() - started
            for index, state in zip(indices, states):
                finals.put_nowait(self._final(index, state, len(prompt), sent, elapsed))
            delivered = True
        finally:
            if not running:
                stub._in_flight.pop(request.request_id, None)
                stub._aborted.discard(request.request_id)
            if not delivered:
                for _ in indices:
                    finals.put_nowait(None)

    async def _segment(self, engine_id: str, prompt: list[int], sent: EngineSampling, version: int,
                       states: list[_SampleState], running: set[str]) -> None:
        """One engine request: its tokens are appended to ``states`` (one per index of ``sent.n``) as sampled by
        ``version``; a state whose stream ends without a final keeps finish reason None."""
        stub = self._stub
        running.add(engine_id)
        for state in states:
            state.start_segment(version, stub.holds)
        try:
            stub.engine_calls += 1
            message = stub.dialect.generate_request(engine_id, prompt, sent)
            if stub.dialect.adapter_id is not None:
                message.lora_id = stub.dialect.adapter_id(version)
            call = stub.engine.Generate(message, timeout=self._timeout, metadata=self._metadata)
            async for response in call:
                stub.progress += 1
                kind = response.WhichOneof("response")
                part = getattr(response, kind)
                if part.index >= len(states):
                    raise ProtocolError(f"Generate {engine_id}: response index {part.index}, but {len(states)} "
                                        "samples were asked")
                state = states[part.index]
                if kind == "chunk":
                    state.add(part, part.token_ids)
                    continue
                if stub.dialect.complete_repeats_chunks:
                    state.clear_segment()
                state.add(part, part.output_ids)
                state.finish_reason = part.finish_reason
        except grpc.aio.AioRpcError as error:
            stub._raise_if_dead(error)
            raise
        except asyncio.CancelledError:
            stub._abort_quietly([engine_id], self._metadata)
            raise
        finally:
            running.discard(engine_id)

    async def _continue(self, sample_id: str, prompt: list[int], sent: EngineSampling, state: _SampleState,
                        running: set[str]) -> None:
        """Continues ``state`` for as long as a publish (a `hold` since its segment began) interrupted it: one engine
        request of the prompt and its tokens so far, for the tokens left, sampled by the version served once
        admission is released. A sample that ended at a stop token or its length needs no more."""
        stub, request = self._stub, self._request
        while (state.finish_reason in (None, "abort") and stub.holds != state.holds
               and request.request_id not in stub._aborted):
            left = sent.max_new_tokens - len(state.token_ids)
            if state.token_ids and state.token_ids[-1] in sent.stop_token_ids:
                state.finish_reason = "stop"
            elif left <= 0:
                state.finish_reason = "length"
            else:
                await stub._admission.wait()
                stub.continuations += 1
                await self._segment(f"{sample_id}/{len(state.spans)}", prompt + state.token_ids,
                                    dataclasses.replace(sent, n=1, max_new_tokens=left), stub.policy_version, [state],
                                    running)

    def _final(self, index: int, state: _SampleState, prompt_tokens: int, sent: EngineSampling,
               elapsed: float) -> pb.GenerateResponse:
        """The sample as rollout.v1's final message (a version span per segment that sampled tokens); no final from
        the engine: ABORT with the tokens received."""
        count = len(state.token_ids)
        finish = pb.FINISH_REASON_ABORT if state.finish_reason is None else _FINISH_REASONS.get(
            state.finish_reason, pb.FINISH_REASON_UNSPECIFIED)
        spans = [pb.VersionSpan(start=start, end=end, policy_version=version) for start, end, version in state.spans
                 if end > start]
        return pb.GenerateResponse(sample_index=index, final=pb.SampleResult(
            token_ids=pack(np.asarray(state.token_ids, np.int64), TOKEN_ID_DTYPE),
            logprobs=pack(np.asarray(state.logprobs, np.float32), LOGPROB_DTYPE), version_spans=spans,
            finish_reason=finish, prompt_tokens=prompt_tokens, completion_tokens=count,
            timings=pb.Timings(queue_s=0.0, generate_s=elapsed),
            sampling=echoed_sampling(self._request.sampling, sent)))


@dataclasses.dataclass(frozen=True)
class _Done:
    """What `_FanOut._waiting` awaited, once done."""

    value: object


class SmgHealth:
    """``grpc.health.v1``'s Check, answered by the engine's own HealthCheck (``healthy``)."""

    def __init__(self, stub: SmgAdapter):
        self._stub = stub

    async def Check(self, request, timeout: float, wait_for_ready: bool = False) -> health_pb2.HealthCheckResponse:
        if self._stub.check_alive is not None:
            self._stub.check_alive()
        reply = await self._stub.engine.HealthCheck(self._stub.dialect.pb.HealthCheckRequest(), timeout=timeout,
                                                    wait_for_ready=wait_for_ready)
        status = health_pb2.HealthCheckResponse.SERVING if reply.healthy else health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)
