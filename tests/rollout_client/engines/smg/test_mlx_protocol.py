"""The MLX dialect of the smg data plane on the wire (protocol conformance: no engine runs here).

What the MLX servicer reads (``smg_grpc_servicer.mlx.servicer``): ``temperature`` (optional: unset would be its own
default), ``top_p``/``top_k``/``min_p``/penalties (zero is off), ``max_tokens`` (optional: unset is the context
left), ``logprobs`` (optional: unset returns no logprobs), ``stop_token_ids`` with ``ignore_eos``, ``seed`` (calls
the process-wide ``mx.random.seed``: never sent).
"""

import asyncio

import grpc
import pytest
from smg_grpc_proto import mlx_engine_pb2, mlx_engine_pb2_grpc

from rollout_client import ClientConfig, LogprobMode, RolloutRequest, SamplingParams
from rollout_client.engines.smg import MLX, AsyncSmgClient, EngineSampling
from rollout_client.engines.smg.adapter import echoed_sampling, resolve_sampling
from rollout_client.protocol import pb

SAMPLING = EngineSampling(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, max_new_tokens=12, stop_token_ids=(2, 7))


def test_every_sampling_field_is_explicit_on_the_wire_protocol_conformance():
    wire = MLX.generate_request("req/3", [1, 20, 3], SAMPLING).SerializeToString()
    request = mlx_engine_pb2.GenerateRequest.FromString(wire)
    params = request.sampling_params
    assert request.request_id == "req/3" and request.stream and list(request.tokenized.input_ids) == [1, 20, 3]
    assert params.HasField("temperature") and params.HasField("max_tokens") and params.HasField("logprobs")
    assert (params.temperature, params.top_k, params.max_tokens, params.logprobs) == (
        pb.SamplingParams(temperature=0.7).temperature, 5, 12, 1)  # float32 on both wires
    assert abs(params.top_p - 0.9) < 1e-7 and abs(params.min_p - 0.05) < 1e-7
    assert list(params.stop_token_ids) == [2, 7] and params.ignore_eos  # exactly the request's stops
    assert not params.HasField("seed")
    assert (params.repetition_penalty, params.frequency_penalty, params.presence_penalty) == (0.0, 0.0, 0.0)
    assert [list(m.request_ids) for m in MLX.abort_requests(["a/0", "a/1"])] == [["a/0", "a/1"]]


def test_unset_fields_resolve_to_tethers_defaults_and_are_echoed():
    info = mlx_engine_pb2.GetModelInfoResponse(vocab_size=128, max_context_length=256, eos_token_ids=[2])
    asked = pb.SamplingParams(top_k=500, seed=9)  # top_k beyond the vocabulary keeps every token
    sent = resolve_sampling(asked, prompt_tokens=6, model_info=info, n=1)
    assert sent == EngineSampling(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, max_new_tokens=250,
                                  stop_token_ids=(2,), n=1)
    echo = echoed_sampling(asked, sent)
    assert (echo.temperature, echo.top_k, echo.top_p, echo.min_p, echo.max_new_tokens, echo.seed) == (
        1.0, 500, 1.0, 0.0, 250, 9)
    assert echo.HasField("stop_token_ids") and list(echo.stop_token_ids.token_ids) == [2]


def test_a_request_that_never_stops_is_sent_without_stop_ids():
    info = mlx_engine_pb2.GetModelInfoResponse(vocab_size=128, max_context_length=256, eos_token_ids=[2])
    asked = pb.SamplingParams(max_new_tokens=4)
    asked.stop_token_ids.SetInParent()  # stop_token_ids=(): never stop (the engine's eos ids are ignored)
    sent = resolve_sampling(asked, prompt_tokens=6, model_info=info, n=1)
    assert sent.stop_token_ids == ()
    params = MLX.generate_request("r/0", [1], sent).sampling_params
    assert list(params.stop_token_ids) == [] and params.ignore_eos
    assert echoed_sampling(asked, sent).HasField("stop_token_ids")


class _SlowMlx(mlx_engine_pb2_grpc.MlxEngineServicer):
    """Streams one token every 10 ms like the MLX servicer (a chunk per token); records the aborts it receives.
    ``end_early``: the stream ends after 3 tokens without a complete message (what an engine that stops does)."""

    def __init__(self, end_early: bool = False):
        self.end_early = end_early
        self.streaming = asyncio.Event()
        self.aborted: list[str] = []

    async def Generate(self, request, context):
        for i in range(10_000):
            if i == 3:
                self.streaming.set()
                if self.end_early:
                    return
            yield mlx_engine_pb2.GenerateResponse(chunk=mlx_engine_pb2.GenerateStreamChunk(
                token_ids=[5], output_logprobs=mlx_engine_pb2.OutputLogProbs(token_logprobs=[-0.5], token_ids=[5])))
            await asyncio.sleep(0.01)

    async def Abort(self, request, context):
        self.aborted.extend(request.request_ids)
        return mlx_engine_pb2.AbortResponse()

    async def HealthCheck(self, request, context):
        return mlx_engine_pb2.HealthCheckResponse(healthy=True)

    async def GetModelInfo(self, request, context):
        return mlx_engine_pb2.GetModelInfoResponse(vocab_size=16, max_context_length=20_000, eos_token_ids=[2])


async def _serve(servicer):
    server = grpc.aio.server()
    mlx_engine_pb2_grpc.add_MlxEngineServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = AsyncSmgClient(ClientConfig(f"127.0.0.1:{port}", ready_timeout_s=60), MLX)
    await client.connect()
    return server, client


def _request(num_samples=1):
    return RolloutRequest([1, 2], SamplingParams(max_new_tokens=9_000), num_samples=num_samples,
                          logprob_mode=LogprobMode.RAW, request_id="req")


def test_a_cancelled_request_is_aborted_on_the_engine_protocol_conformance():
    async def scenario():
        servicer = _SlowMlx()
        server, client = await _serve(servicer)
        try:
            task = asyncio.create_task(client.generate(_request(num_samples=2)))
            await asyncio.wait_for(servicer.streaming.wait(), 60)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(600):  # both aborts are sent at once; 60 s is only a bound for a loaded machine
                if len(servicer.aborted) == 2:
                    break
                await asyncio.sleep(0.1)
            return sorted(servicer.aborted)
        finally:
            await client.close()
            await server.stop(0)

    assert asyncio.run(scenario()) == ["req/0", "req/1"]  # each fanned-out engine request


def test_a_stream_that_ends_without_its_complete_message_is_an_unrequested_abort_protocol_conformance():
    async def scenario():
        server, client = await _serve(_SlowMlx(end_early=True))
        try:
            samples = await client.generate(_request(num_samples=2))
            return samples, client.metrics()
        finally:
            await client.close()
            await server.stop(0)

    samples, metrics = asyncio.run(scenario())
    assert samples == [] and metrics["samples/dropped/aborted"] == 2  # counted, never trained on
