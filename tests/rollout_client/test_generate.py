"""Generate against a real scripted-engine server: samples, chunks, errors, abort, deadlines."""

import dataclasses
import threading
import time

import grpc
import numpy as np
import pytest

from rollout_client import (
    ClientConfig,
    FinishReason,
    LogprobMode,
    PauseMode,
    RolloutClient,
    RolloutDeadlineError,
    RolloutRequest,
    SamplingParams,
    ServerNotReadyError,
)

PROMPT = [5, 6, 7]


def test_samples_have_requested_length_and_echo_resolved_sampling(client):
    request = RolloutRequest(PROMPT, SamplingParams(max_new_tokens=20, top_k=7, stop_token_ids=(), seed=3),
                             num_samples=3, logprob_mode=LogprobMode.RAW)
    samples = client.generate(request)
    assert [s.sample_index for s in samples] == [0, 1, 2]
    for sample in samples:
        assert sample.completion_token_ids.shape == (20,) and sample.completion_token_ids.dtype == np.int32
        assert sample.logprobs.shape == (20,) and sample.logprobs.dtype == np.float32
        assert (sample.logprobs < 0).all()
        assert sample.policy_versions.tolist() == [0] * 20
        assert sample.finish_reason == FinishReason.LENGTH
        assert sample.prompt_token_ids.tolist() == PROMPT
        assert sample.sampling == SamplingParams(temperature=1.0, top_k=7, top_p=1.0, min_p=0.0, max_new_tokens=20,
                                                 stop_token_ids=(), seed=3)
    assert len({s.completion_token_ids.tobytes() for s in samples}) == 3
    assert client.metrics()["samples/accepted"] == 3


def test_chunked_stream_equals_single_message(client):
    params = SamplingParams(max_new_tokens=150, stop_token_ids=(), seed=11)
    whole = client.generate(RolloutRequest(PROMPT, params, num_samples=2))
    chunked = client.generate(RolloutRequest(PROMPT, params, num_samples=2, stream_chunk_tokens=64))
    for a, b in zip(whole, chunked, strict=True):
        np.testing.assert_array_equal(a.completion_token_ids, b.completion_token_ids)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)


def test_default_stop_tokens_are_the_servers_eos(client):
    (sample,) = client.generate(RolloutRequest(PROMPT, SamplingParams(max_new_tokens=5)))
    assert sample.sampling.stop_token_ids == tuple(client.info.eos_token_ids) == (1,)


def test_eos_ids_flag_sets_server_info_and_stops_generation(start_server):
    server = start_server("--engine", "scripted", "--vocab-size", "10", "--eos-ids", "1", "7")
    with RolloutClient(ClientConfig(target=server.target)) as eos_client:
        assert list(eos_client.info.eos_token_ids) == [1, 7]
        (sample,) = eos_client.generate(RolloutRequest(PROMPT, SamplingParams(max_new_tokens=200, seed=2)))
    assert sample.sampling.stop_token_ids == (1, 7)
    assert sample.finish_reason == FinishReason.STOP and sample.completion_token_ids[-1] == 7
    assert 7 not in sample.completion_token_ids[:-1]


class _Unchecked(SamplingParams):
    """Sent as given: SamplingParams refuses these values itself, but the server must refuse them too."""

    def __post_init__(self):
        pass


@pytest.mark.parametrize("request_kwargs, field", [
    (dict(logprob_mode=0), "logprob_mode"),
    (dict(stream_chunk_tokens=10), "stream_chunk_tokens"),
    (dict(prompt_token_ids=[5, 5000]), "prompt_token_ids"),
    (dict(sampling=_Unchecked(temperature=0.0)), "sampling.temperature"),
    (dict(sampling=_Unchecked(top_p=1.5)), "sampling.top_p"),
])
def test_invalid_request_is_invalid_argument_naming_the_field(client, request_kwargs, field):
    request = RolloutRequest(**{"prompt_token_ids": PROMPT, **request_kwargs})
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        client.generate(request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(field + ":")


def test_min_policy_version_above_server_is_failed_precondition(client):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        client.generate(RolloutRequest(PROMPT, min_policy_version=1))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "min_policy_version" in caught.value.details()


def long_request(**kwargs) -> RolloutRequest:
    return RolloutRequest(PROMPT, SamplingParams(max_new_tokens=3000, stop_token_ids=(), seed=1), **kwargs)


def test_abort_returns_partial_samples_with_abort_reason(client):
    request = long_request(num_samples=2)
    future = client.submit(request)
    time.sleep(0.3)
    assert client.abort([request.request_id, "unknown"]) == [request.request_id]
    samples = future.result(timeout=10)
    assert [s.finish_reason for s in samples] == [FinishReason.ABORT] * 2
    assert all(0 < s.completion_token_ids.size < 3000 for s in samples)


def test_pause_abort_ends_active_requests(client):
    future = client.submit(long_request())
    time.sleep(0.3)
    client.pause(PauseMode.ABORT)
    (sample,) = future.result(timeout=10)
    assert sample.finish_reason == FinishReason.ABORT
    assert client.server_info().paused
    client.resume()
    assert not client.server_info().paused


def test_pause_wait_returns_after_active_requests_finish(client):
    future = client.submit(RolloutRequest(PROMPT, SamplingParams(max_new_tokens=150, stop_token_ids=())))
    time.sleep(0.05)
    client.pause(PauseMode.WAIT)
    (sample,) = future.result(timeout=5)  # Completes while the server stays paused.
    assert sample.finish_reason == FinishReason.LENGTH and sample.completion_token_ids.size == 150
    assert client.server_info().paused
    client.resume()


def test_pause_wait_times_out_after_the_configured_time_and_stays_unpaused(start_server):
    server = start_server("--engine", "scripted", "--step-delay-s", "0.002", "--pause-wait-timeout-s", "0.2")
    with RolloutClient(ClientConfig(target=server.target)) as rollout_client:
        request = long_request()
        future = rollout_client.submit(request)
        time.sleep(0.1)
        start = time.monotonic()
        with pytest.raises(RolloutDeadlineError, match=r"pause\(WAIT\): 1 sequences still active"):
            rollout_client.pause(PauseMode.WAIT)
        assert time.monotonic() - start < 5
        assert not rollout_client.server_info().paused
        rollout_client.abort([request.request_id])
        (sample,) = future.result(timeout=10)
    assert sample.finish_reason == FinishReason.ABORT and sample.completion_token_ids.size > 0


def test_deadline_exceeded_is_retried_then_raises_deadline_error(scripted_server):
    config = ClientConfig(target=scripted_server.target, deadline_base_s=0.3, deadline_per_token_s=0.0,
                          max_attempts=2, initial_backoff_s=0.01)
    with RolloutClient(config) as short_deadline_client:
        start = time.monotonic()
        with pytest.raises(RolloutDeadlineError, match=r"no result in 2 attempts, the last within 0.6s"):
            short_deadline_client.generate(long_request())
        assert time.monotonic() - start >= 0.3 + 0.6  # the second attempt waits twice as long (deadline_growth)
        assert short_deadline_client.metrics()["generate/retries"] == 1


def test_a_slow_server_finishes_on_a_retry_with_a_longer_deadline(start_server):
    """A server slower than the first deadline (a loaded machine), not hung: 100 steps of 20 ms take ~2 s against a
    first deadline of 1 s. Each retry restarts the sample, so with the same deadline every attempt misses it; with
    the deadline growing 4x per missed attempt, the second one (4 s) finishes it. Each step is mostly sleep, so a
    loaded machine stretches it little: 2 s of slack."""
    server = start_server("--engine", "scripted", "--step-delay-s", "0.02")
    request = RolloutRequest([5, 6], SamplingParams(max_new_tokens=100, stop_token_ids=(), seed=1))
    patient = ClientConfig(target=server.target, deadline_base_s=1.0, deadline_per_token_s=0.0, max_attempts=2,
                           initial_backoff_s=0.01, deadline_growth=4.0)
    with RolloutClient(patient) as rollout_client:
        (sample,) = rollout_client.generate(request)
        assert sample.completion_token_ids.size == 100
        assert rollout_client.metrics()["generate/retries"] == 1
    with RolloutClient(dataclasses.replace(patient, deadline_growth=1.0)) as rollout_client:
        with pytest.raises(RolloutDeadlineError, match=r"no result in 2 attempts, the last within 1.0s"):
            rollout_client.generate(request)


def test_deadline_after_some_samples_retries_only_the_missing_ones(start_server):
    """Two KV rows, four 200-token samples of ~4 s each: the first attempt's deadline (6 s) passes with samples
    0 and 1 done and 2 and 3 half way; the retry asks for 2 and 3 only and gets the same draws (same seed).

    Each sample is mostly sleep (20 ms a step), so a loaded machine stretches it little: 2 s of slack either side.
    The expected draws come from the same engine without the delay (the scripted draws do not depend on timing).
    """
    server = start_server("--engine", "scripted", "--step-delay-s", "0.02", "--max-batch-size", "2")
    undelayed = start_server("--engine", "scripted", "--max-batch-size", "2")
    request = RolloutRequest([5, 6], SamplingParams(max_new_tokens=200, stop_token_ids=(), seed=4), num_samples=4)
    config = ClientConfig(target=server.target, deadline_base_s=6.0, deadline_per_token_s=0.0, max_attempts=2)
    with RolloutClient(config) as rollout_client:
        samples = rollout_client.generate(request)
        assert rollout_client.metrics()["generate/retries"] == 1
    with RolloutClient(ClientConfig(target=undelayed.target)) as fresh_client:
        expected = fresh_client.generate(request)
    assert [s.sample_index for s in samples] == [0, 1, 2, 3]
    for got, want in zip(samples, expected, strict=True):
        np.testing.assert_array_equal(got.completion_token_ids, want.completion_token_ids)


def test_wait_ready_times_out_with_clear_error():
    start = time.monotonic()
    with pytest.raises(ServerNotReadyError, match=r"127.0.0.1:1 not SERVING after 0.5s"):
        RolloutClient(ClientConfig(target="127.0.0.1:1", ready_timeout_s=0.5))
    assert time.monotonic() - start < 5


def test_concurrent_requests_are_batched(client):
    requests = [RolloutRequest(PROMPT, SamplingParams(max_new_tokens=100, stop_token_ids=())) for _ in range(8)]
    start = time.monotonic()
    futures = [client.submit(request) for request in requests]
    results = [future.result(timeout=30) for future in futures]
    elapsed = time.monotonic() - start
    assert [len(samples) for samples in results] == [1] * 8
    # 100 steps of 2 ms each when batched; 8x that if run one after another.
    assert elapsed < 8 * 100 * 0.002


def test_sigterm_drains_active_requests(start_server):
    server = start_server("--engine", "scripted", "--step-delay-s", "0.002", "--drain-grace-s", "10")
    with RolloutClient(ClientConfig(target=server.target)) as rollout_client:
        future = rollout_client.submit(RolloutRequest(PROMPT, SamplingParams(max_new_tokens=400,
                                                                             stop_token_ids=())))
        time.sleep(0.2)
        exit_thread = threading.Thread(target=server.stop)
        exit_thread.start()
        (sample,) = future.result(timeout=15)
        exit_thread.join(timeout=20)
    assert sample.finish_reason == FinishReason.LENGTH and sample.completion_token_ids.size == 400
    assert server.process.returncode == 0
    assert "draining" in server.output()
