"""Partial rollouts on SGLang and vLLM, protocol conformance only (neither runs on this CPU): with ``partial=True`` a
publish pauses with ABORT and every sample it interrupts is continued, once the new weights serve, by one more
engine request whose prompt is the prompt and the exact token ids received so far, for the tokens left; the
continued tokens carry the new version. Driven against `tests.support.conformance_servers` (smg's
servicer base classes and each engine's HTTP control endpoints), whose fake model's tokens are computed here
independently."""

import numpy as np
import pytest

from rollout_client import ClientConfig, FinishReason, LogprobMode, RolloutRequest, SamplingParams, ValidationConfig
from rollout_client.engines.sglang import SGLangEngine
from rollout_client.engines.vllm import VllmEngine
from tests.support.conformance_servers import (
    VOCAB,
    logprob,
    sglang_servers,
    token,
    vllm_servers,
    write_fake_checkpoint,
)

PROMPT = [3, 1, 4, 1, 5]
HOLD_AFTER = 5  # the engine streams this many tokens of a sample, then holds it until the publish aborts it
MAX_NEW_TOKENS = 20
BACKENDS = {"sglang": (sglang_servers, SGLangEngine, "/pause_generation"), "vllm": (vllm_servers, VllmEngine, "/pause")}


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def backend(request):
    make_servers, engine_class, pause_path = BACKENDS[request.param]
    servers = make_servers()
    yield servers, engine_class, pause_path
    servers.stop()


@pytest.fixture
def partial_engine(backend, tmp_path):
    servers, engine_class, _ = backend
    servers.reset()
    engine = engine_class(ClientConfig(servers.target, ready_timeout_s=30.0, validation=ValidationConfig(
        vocab_size=VOCAB)), servers.http.url, write_fake_checkpoint, tmp_path / "weights",
        logprob_mode=LogprobMode.PROCESSED, partial=True)
    yield engine
    engine.close()


def max_new_tokens(request) -> int:
    """SGLang's ``max_new_tokens``, vLLM's ``max_tokens``."""
    params = request.sampling_params
    return getattr(params, "max_new_tokens" if "max_new_tokens" in params.DESCRIPTOR.fields_by_name else "max_tokens")


def running(servers, engine, request: RolloutRequest):
    """Publishes version 1 (offset 0) and submits ``request``; returns its future once the engine streamed the first
    HOLD_AFTER tokens of a sample and holds it (the sample is running)."""
    engine.publish(1, {"offset": np.array(0)})
    servers.engine.hold_after = HOLD_AFTER
    future = engine.submit(request)
    assert servers.engine.holding.wait(timeout=30)
    return future


def test_interrupted_sample_continues_from_its_tokens_under_the_new_version_protocol_conformance(backend,
                                                                                                partial_engine):
    servers, _, pause_path = backend
    engine = partial_engine
    request = RolloutRequest(PROMPT, SamplingParams(max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=()))
    future = running(servers, engine, request)
    servers.engine.hold_after = None
    engine.publish(2, {"offset": np.array(3)})  # pause ABORT -> load -> resume; the sample is continued
    (sample,) = future.result(timeout=30)

    first = [token(sum(PROMPT), step, 0, 0) for step in range(HOLD_AFTER)]
    continued_prompt = PROMPT + first
    rest = [token(sum(continued_prompt), step, 0, 3) for step in range(MAX_NEW_TOKENS - HOLD_AFTER)]
    assert sample.completion_token_ids.tolist() == first + rest
    np.testing.assert_array_equal(sample.logprobs, np.float32(
        [logprob(step, 0) for step in range(HOLD_AFTER)] + [logprob(step, 0) for step in range(len(rest))]))
    assert sample.policy_versions.tolist() == [1] * HOLD_AFTER + [2] * len(rest)
    assert sample.finish_reason == FinishReason.LENGTH

    first_request, continuation = servers.engine.generate_requests
    assert list(first_request.tokenized.input_ids) == PROMPT
    assert list(continuation.tokenized.input_ids) == continued_prompt  # token in: the exact ids, no re-tokenising
    assert max_new_tokens(continuation) == MAX_NEW_TOKENS - HOLD_AFTER
    assert continuation.request_id.startswith(f"{request.request_id}/0/")
    assert ("POST", pause_path) in [(method, path) for method, path, _, _ in servers.engine.http_calls]
    assert engine.metrics()["generate/continuations"] == 1


def test_sample_interrupted_before_its_first_token_is_drawn_by_the_new_version_protocol_conformance(
        backend, partial_engine):
    """Two samples: the engine holds the first after HOLD_AFTER tokens; the second, not started when the publish
    aborts the request (SGLang: one request with n = 2; vLLM: the same), has no token of the old version."""
    servers, _, _ = backend
    engine = partial_engine
    future = running(servers, engine, RolloutRequest(PROMPT, SamplingParams(max_new_tokens=8, stop_token_ids=()),
                                                     num_samples=2))
    servers.engine.hold_after = None
    engine.publish(2, {"offset": np.array(1)})
    first, second = future.result(timeout=30)
    assert first.policy_versions.tolist() == [1] * HOLD_AFTER + [2] * 3
    assert second.policy_versions.tolist() == [2] * 8
    assert second.completion_token_ids.tolist() == [token(sum(PROMPT), step, 0, 1) for step in range(8)]


def test_a_sample_aborted_by_the_client_is_not_continued_protocol_conformance(backend, partial_engine):
    servers, _, _ = backend
    engine = partial_engine
    request = RolloutRequest(PROMPT, SamplingParams(max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=()))
    future = running(servers, engine, request)
    assert engine.client.abort([request.request_id]) == [request.request_id]
    (sample,) = future.result(timeout=30)
    assert sample.finish_reason == FinishReason.ABORT and len(sample.completion_token_ids) == HOLD_AFTER
    assert len(servers.engine.generate_requests) == 1
