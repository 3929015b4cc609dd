"""The real MLX engine (``smg_grpc_servicer.mlx.server`` on 127.0.0.1) against the learner's own numbers.

Tolerance 1e-5 on logprobs: MLX and XLA compute the same float32 forward with their own kernels and reduction
orders; on this tiny model they agree to a few 1e-7 (the value asserted is what the learner trains on).
"""

import os
import signal
import time

import numpy as np
import pytest

from rollout_client import (
    EngineExitedError,
    FinishReason,
    LogprobMode,
    RequestRefusedError,
    RolloutRequest,
    SamplingParams,
)
from tests.rollout_client.engines.conftest import (
    EOS_ID,
    MODEL_CONFIG,
    host_weights,
    learner_logits,
    learner_logprobs,
    make_model,
    start_engine,
)

TOLERANCE = 1e-5
PROMPT = [1, *range(20, 30), 3]  # bos, ten characters, separator


def raw_request(num_samples: int = 4, **sampling) -> RolloutRequest:
    sampling = {"max_new_tokens": 12, "stop_token_ids": (EOS_ID,), **sampling}
    return RolloutRequest(PROMPT, SamplingParams(**sampling), num_samples=num_samples, logprob_mode=LogprobMode.RAW)


def assert_learner_logprobs(model, samples, temperature=1.0):
    for sample in samples:
        expected = learner_logprobs(model, sample.prompt_token_ids, sample.completion_token_ids, temperature)
        np.testing.assert_allclose(sample.logprobs, expected, rtol=0, atol=TOLERANCE)


def test_fanned_out_samples_have_the_learners_logprobs_at_temperature_1(mlx):
    before = mlx.engine.metrics()["generate/engine_calls"]
    samples = mlx.engine.submit(raw_request(num_samples=4)).result()
    assert [sample.sample_index for sample in samples] == [0, 1, 2, 3]
    assert mlx.engine.metrics()["generate/engine_calls"] - before == 4  # no n in the MLX proto: one request each
    assert len({tuple(sample.completion_token_ids) for sample in samples}) > 1  # independent draws
    for sample in samples:
        assert sample.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        assert sample.policy_versions.tolist() == [mlx.engine.policy_version] * sample.completion_token_ids.size
        assert sample.sampling.temperature == 1.0 and sample.sampling.top_k == 0  # resolved values, sent explicitly
    assert_learner_logprobs(mlx.model, samples)


def test_raw_logprobs_at_temperature_0_7_are_the_temperature_1_logprobs(mlx):
    samples = mlx.engine.submit(raw_request(temperature=0.7)).result()
    assert_learner_logprobs(mlx.model, samples, temperature=1.0)
    tempered = learner_logprobs(mlx.model, PROMPT, samples[0].completion_token_ids, temperature=0.7)
    assert np.abs(samples[0].logprobs - tempered).max() > 100 * TOLERANCE  # RAW: not the sampling distribution


def test_top_k_samples_only_the_k_most_likely_and_logprobs_stay_raw(mlx):
    samples = mlx.engine.submit(raw_request(num_samples=3, top_k=3, temperature=0.7, max_new_tokens=16)).result()
    assert_learner_logprobs(mlx.model, samples, temperature=1.0)
    for sample in samples:
        logits = learner_logits(mlx.model, PROMPT, sample.completion_token_ids)
        rank = (logits > logits[np.arange(len(logits)), sample.completion_token_ids][:, None]).sum(axis=1)
        assert rank.max() < 3, rank  # each sampled token is among the learner's three most likely


def test_restart_publish_moves_the_version_and_serves_the_new_weights(mlx):
    old_model, new_model = mlx.model, make_model(seed=1)
    version = mlx.engine.policy_version + 1
    assert mlx.engine.publish(version, host_weights(new_model)) == version
    mlx.model = new_model
    assert mlx.engine.info().policy_version == version
    metrics = mlx.engine.metrics()
    assert metrics["publish/megabytes"] == pytest.approx(sum(a.nbytes for a in host_weights(new_model).values()) / 1e6)
    samples = mlx.engine.submit(raw_request()).result()
    assert all(sample.policy_versions.tolist() == [version] * sample.completion_token_ids.size for sample in samples)
    assert_learner_logprobs(new_model, samples)
    stale = learner_logprobs(old_model, PROMPT, samples[0].completion_token_ids)
    assert np.abs(samples[0].logprobs - stale).max() > 100 * TOLERANCE
    # keep_weight_versions = 2: the served directory and the one before it; an older one is deleted
    assert mlx.engine.publish(version + 1, host_weights(new_model)) == version + 1
    kept = sorted(path.name for path in mlx.engine.weights_dir.iterdir())
    assert kept == [f"v{version:012d}", f"v{version + 1:012d}"] and mlx.engine.served_dir.name == kept[-1]


def test_an_abort_keeps_the_streamed_tokens(mlx):
    # The tiny model streams hundreds of tokens a second; 2036 take a few seconds, so an abort after 0.5 s finds the
    # sample streaming. On a machine so loaded that it finished (or had not started), the next attempt waits longer.
    for wait_s in (0.5, 1.0, 0.25, 2.0):
        request = raw_request(num_samples=1, max_new_tokens=2036, stop_token_ids=())
        future = mlx.engine.submit(request)
        time.sleep(wait_s)
        aborted = mlx.engine.client.abort([request.request_id])
        samples = future.result()
        if aborted and samples:
            break
    assert aborted == [request.request_id]
    [sample] = samples
    assert sample.finish_reason == FinishReason.ABORT
    assert 1 <= sample.completion_token_ids.size < 2036
    assert_learner_logprobs(mlx.model, [sample])


@pytest.mark.parametrize("prompt, field", [
    ([1, MODEL_CONFIG.vocab_size], "prompt_token_ids[1]=128 is outside the vocabulary [0, 128)"),
    ([1, -1], "prompt_token_ids[1]=-1 is outside the vocabulary"),
    ([], "prompt_token_ids has shape (0,)"),
])
def test_a_bad_prompt_is_refused_before_it_reaches_the_engine(mlx, prompt, field):
    before = mlx.engine.metrics()["generate/engine_calls"]
    with pytest.raises(RequestRefusedError, match=field.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        mlx.engine.submit(RolloutRequest(prompt, SamplingParams(max_new_tokens=4), logprob_mode=LogprobMode.RAW))
    assert mlx.engine.metrics()["generate/engine_calls"] == before
    assert mlx.engine.process.returncode is None  # the engine never saw it


def test_a_prompt_beyond_the_context_is_refused(mlx):
    with pytest.raises(RequestRefusedError, match="12 prompt tokens \\+ max_new_tokens=2037 exceed the engine's "
                                                  "context of 2048 tokens"):
        mlx.engine.submit(raw_request(max_new_tokens=2037))


def test_the_engine_reports_the_learners_model(mlx):
    identity = mlx.engine.model_identity()
    assert (identity.vocab_size, identity.model_type, identity.architectures) == (128, "qwen2", ("Qwen2ForCausalLM",))
    assert identity.shapes["hidden_size"] == MODEL_CONFIG.hidden_size
    info = mlx.engine.info()
    assert (info.vocab_size, info.eos_token_ids, info.max_seq_len) == (128, (EOS_ID,), 2048)


def test_a_killed_engine_is_a_clear_error_naming_address_log_and_exit_code(tmp_path):
    engine = start_engine(tmp_path, make_model(seed=2))
    try:
        os.kill(engine.process.pid, signal.SIGKILL)
        with pytest.raises(EngineExitedError) as caught:
            engine.submit(raw_request(num_samples=2)).result()
        message = str(caught.value)
        assert engine.address in message and str(tmp_path / "engine.log") in message and "exit code -9" in message
        assert "smg_grpc_servicer.mlx.server" in message
    finally:
        engine.close()
