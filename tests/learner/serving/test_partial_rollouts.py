"""Partial rollouts on the reference server (``python -m learner.serving``, a real process on 127.0.0.1): a request
kept across a publish (Pause KEEP) decodes on with the new weights from the next step, each token stamped with the
version that drew it; its KV cache is recomputed under the new weights (exact) unless the pause said KEEP."""

import signal
import sys

import grpc
import numpy as np
import pytest
from flax import nnx

from learner.model import Transformer, model_config
from rollout_client import ClientConfig, KvCache, LogprobMode, PauseMode, RolloutClient, RolloutRequest, SamplingParams
from rollout_client.protocol import pb, pb_grpc
from rollout_client.samples import StreamAssembler, versions_per_token
from tests.learner.serving.test_model_server import learner_weights
from tests.rollout_client.conftest import ServerProcess

PROMPT = np.array([3, 17, 42, 5, 9, 8, 7, 6], np.int32)
MAX_NEW_TOKENS = 240  # the tiny model's 256 positions, less the prompt: the publish falls inside the request
CHUNK = 64  # the first streamed chunk says the request is running; the publish follows it
SAMPLING = SamplingParams(temperature=0.8, max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=(), seed=11)
# The kept request's post-publish tokens against a fresh request's: the same tokens (the same keys draw them) and
# logprobs equal to rounding, the caches of the two coming from prefills of different shapes.
LOGPROB_ATOL = 2e-4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One decode step per call: a request runs for ~170 calls after its first chunk."""
    process = ServerProcess([sys.executable, "-m", "learner.serving", "--max-batch-size", "2", "--max-seq-len", "256",
                             "--decode-steps-per-call", "1"], tmp_path_factory.mktemp("partial"))
    client = RolloutClient(ClientConfig(target=process.target, ready_timeout_s=60))
    yield process, client
    client.close()
    process.stop(signal.SIGKILL)


def weights_of(seed: int) -> dict[str, np.ndarray]:
    return learner_weights(Transformer(model_config("tiny"), rngs=nnx.Rngs(seed)))


def generate_across_publish(target: str, client: RolloutClient, version: int, kv_cache: KvCache):
    """Streams a long request, pauses the server (KEEP, ``kv_cache``) once its first chunk arrived, loads
    ``version`` and resumes; returns its tokens, logprobs, per-token versions and spans."""
    request = RolloutRequest(PROMPT, SAMPLING, logprob_mode=LogprobMode.PROCESSED, request_id=f"long-{version}",
                             stream_chunk_tokens=CHUNK)
    with grpc.insecure_channel(target) as channel:
        stream = pb_grpc.RolloutServiceStub(channel).Generate(request.to_proto(), timeout=120)
        assembler, raw = StreamAssembler(), None
        first = next(stream)
        assert first.WhichOneof("payload") == "chunk", "the request ended before its first chunk"
        assembler.add(first)
        client.pause(PauseMode.KEEP, kv_cache)  # one small call: the request is still running
        client.stream_weights(version, weights_of(version))
        client.resume()
        for response in stream:
            raw = assembler.add(response)
    assert raw.final.finish_reason == pb.FINISH_REASON_LENGTH
    return (np.asarray(raw.token_ids), np.asarray(raw.logprobs),
            versions_per_token(raw.version_spans, raw.token_ids.size), raw.version_spans)


def fresh_continuation(client: RolloutClient, prefix: np.ndarray):
    """The same sample (seed, index 0) asked afresh with ``prefix`` appended to the prompt."""
    sampling = SamplingParams(temperature=0.8, max_new_tokens=MAX_NEW_TOKENS - prefix.size, stop_token_ids=(),
                              seed=11)
    [sample] = client.generate(RolloutRequest(np.concatenate([PROMPT, prefix]), sampling,
                                              logprob_mode=LogprobMode.PROCESSED))
    return np.asarray(sample.completion_token_ids), np.asarray(sample.logprobs)


def test_kept_request_decodes_on_with_new_weights_exactly_as_a_fresh_request(server):
    process, client = server
    client.publish_weights(1, weights=weights_of(1))
    tokens, logprobs, versions, spans = generate_across_publish(process.target, client, 2, KvCache.RECOMPUTE)
    first_new = int(np.argmax(versions == 2))
    assert len(spans) == 2 and spans[0][2] == 1 and spans[1][2] == 2, spans
    assert CHUNK <= first_new < MAX_NEW_TOKENS, spans  # tokens of both versions
    fresh_tokens, fresh_logprobs = fresh_continuation(client, tokens[:first_new])
    np.testing.assert_array_equal(tokens[first_new:], fresh_tokens)
    np.testing.assert_allclose(logprobs[first_new:], fresh_logprobs, rtol=0, atol=LOGPROB_ATOL)


def test_kept_cache_is_the_old_weights_and_so_differs_from_a_fresh_request(server):
    """``partial_kv = "keep"``: the prefix's keys and values stay those of version 2, so version 3's tokens are not
    what version 3 draws afresh from the same prefix (the approximation the recompute removes)."""
    process, client = server
    if client.server_info().policy_version < 2:  # this test alone on its worker (pytest-xdist): no earlier publish
        client.publish_weights(2, weights=weights_of(2))
    tokens, logprobs, versions, spans = generate_across_publish(process.target, client, 3, KvCache.KEEP)
    first_new = int(np.argmax(versions == 3))
    assert [span[2] for span in spans] == [2, 3] and first_new >= CHUNK, spans
    fresh_tokens, fresh_logprobs = fresh_continuation(client, tokens[:first_new])
    same_tokens = np.array_equal(tokens[first_new:], fresh_tokens)
    assert not same_tokens or np.abs(logprobs[first_new:] - fresh_logprobs).max() > 100 * LOGPROB_ATOL
