"""What differs between the engines' smg protos (``smg-grpc-proto``), as data: one `SmgDialect` per engine.

The data plane (`rollout_client.engines.smg.adapter`) is written once against what the protos share: a server-streaming
``Generate`` whose responses are a ``chunk`` (``token_ids``, ``output_logprobs.token_logprobs``, ``index``) or a
``complete`` (``output_ids``, ``output_logprobs``, ``finish_reason``, ``index``), ``Abort``, ``HealthCheck``
(``healthy``) and ``GetModelInfo`` (``vocab_size``, ``max_context_length``, ``eos_token_ids``, ``model_type``,
``architectures``). A dialect names the generated modules and service, builds the engine's ``GenerateRequest`` and
``AbortRequest``, and says whether the engine samples ``n`` completions per request.

An engine's sampling fields are always sent with explicit values (`EngineSampling`): in SGLang's proto a float left
at its proto3 zero is not the default, so nothing is left for the engine to resolve.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from types import ModuleType

from smg_grpc_proto import mlx_engine_pb2, mlx_engine_pb2_grpc

from rollout_client.sampling_params import LogprobMode

__all__ = ["EngineSampling", "MLX", "SmgDialect"]


@dataclasses.dataclass(frozen=True)
class EngineSampling:
    """A request's sampling with every value resolved (what the engine is sent).

    Attributes:
      temperature: > 0.
      top_k: 0: off.
      top_p: 1: off.
      min_p: 0: off.
      max_new_tokens: >= 1.
      stop_token_ids: the only tokens that end a sample (the engine's own eos ids are ignored unless listed).
      n: samples of this one engine request (1 where the engine has no ``n``: the client fans out).
      stop_strings: texts that end a sample (sent where the engine's proto has ``stop``: SGLang, vLLM; MLX's has
        none).
    """

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    n: int = 1
    stop_strings: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class SmgDialect:
    """One engine's smg proto.

    Attributes:
      name: the engine (``server.engine``).
      pb: its generated message module (``smg_grpc_proto.<engine>_pb2``).
      stub: its service stub class (``<engine>_pb2_grpc.<Service>Stub``).
      native_n: it samples ``n`` completions per request (``index`` tells them apart); False: one request each.
      logprob_modes: the distributions its logprobs can be of.
      generate_request: (engine request id, prompt token ids, sampling) -> its ``GenerateRequest`` (streamed,
        logprobs of the sampled tokens on).
      abort_requests: engine request ids -> the ``AbortRequest`` messages that abort them.
      complete_repeats_chunks: the final ``complete`` message of a streamed request repeats every token the chunks
        carried (then the chunks are dropped); False: it carries only tokens not streamed (often none).
      adapter_id: policy version -> the id (the engine's key, not a name) of the LoRA adapter that serves it, set as
        ``GenerateRequest.lora_id`` on the requests admitted at that version (SGLang's adapter publish); None: the
        engine's weights serve it.
    """

    name: str
    pb: ModuleType
    stub: type
    native_n: bool
    logprob_modes: frozenset[LogprobMode]
    generate_request: Callable[[str, Sequence[int], EngineSampling], object]
    abort_requests: Callable[[Sequence[str]], list]
    complete_repeats_chunks: bool = False
    adapter_id: Callable[[int], str] | None = None


def _mlx_generate_request(request_id: str, prompt: Sequence[int], sampling: EngineSampling):
    """The MLX servicer's request. ``ignore_eos`` with explicit ``stop_token_ids``: exactly the request's stops.
    The penalties' zero means off there. ``logprobs=1`` turns logprobs on (it also sends the top-1 alternative).
    No ``seed``: the servicer calls the process-wide ``mx.random.seed`` with it, which would re-seed every request
    in flight with the same stream (and a retried request would not redraw the same tokens anyway)."""
    return mlx_engine_pb2.GenerateRequest(
        request_id=request_id, tokenized=mlx_engine_pb2.TokenizedInput(input_ids=prompt), stream=True,
        sampling_params=mlx_engine_pb2.SamplingParams(
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, min_p=sampling.min_p,
            repetition_penalty=0.0, frequency_penalty=0.0, presence_penalty=0.0, max_tokens=sampling.max_new_tokens,
            stop_token_ids=sampling.stop_token_ids, ignore_eos=True, logprobs=1))


MLX = SmgDialect(
    name="mlx", pb=mlx_engine_pb2, stub=mlx_engine_pb2_grpc.MlxEngineStub, native_n=False,
    logprob_modes=frozenset({LogprobMode.RAW}), generate_request=_mlx_generate_request,
    abort_requests=lambda ids: [mlx_engine_pb2.AbortRequest(request_ids=list(ids))])
