"""Issue #15: a hostile rollout.v1 server's bad samples are counted drops, never trained on, never a crash.

One hostile server process (tests/support/hostile_server.py) serves every fault: the request id names the fault,
which corrupts sample 0. Each test asserts that exactly sample 0 is dropped, counted under its own metric, and
that samples 1 and 2 come back as an honest request returns them.
"""

import itertools
import sys
import time

import numpy as np
import pytest

from rollout_client import ClientConfig, RolloutBuffer, RolloutClient, RolloutRequest, SamplingParams, ValidationConfig
from rollout_client.protocol import pb
from rollout_client.samples import RawSample
from rollout_client.validation import Expected, find_problem
from tests.rollout_client.conftest import ServerProcess
from tests.support.hostile_server import STOP_TOKEN

LEARNER_VOCAB_SIZE = 128
PARAMS = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, max_new_tokens=30,
                        stop_token_ids=(STOP_TOKEN,), seed=9)
_ids = itertools.count()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    argv = [sys.executable, "-m", "tests.support.hostile_server", "--engine", "scripted",
            "--vocab-size", str(LEARNER_VOCAB_SIZE), "--step-delay-s", "0.002"]
    process = ServerProcess(argv, tmp_path_factory.mktemp("hostile"))
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server):
    config = ClientConfig(target=server.target, validation=ValidationConfig(vocab_size=LEARNER_VOCAB_SIZE))
    with RolloutClient(config) as rollout_client:
        yield rollout_client


def request(fault: str, sampling: SamplingParams = PARAMS) -> RolloutRequest:
    return RolloutRequest([5], sampling, num_samples=3, request_id=f"{fault}/{next(_ids)}")


def dropped(client: RolloutClient) -> dict[str, int]:
    return {name: count for name, count in client.metrics().items() if name.startswith("samples/dropped/")}


def assert_only_sample_0_dropped(client, fault, problem, sampling=PARAMS):
    honest = client.generate(request("honest", sampling))
    before = dropped(client)
    samples = client.generate(request(fault, sampling))
    after = dropped(client)
    assert {name: after[name] - before[name] for name in after if after[name] != before[name]} == {
        f"samples/dropped/{problem}": 1}
    assert [s.sample_index for s in samples] == [1, 2]
    for got, want in zip(samples, honest[1:], strict=True):
        np.testing.assert_array_equal(got.completion_token_ids, want.completion_token_ids)
        np.testing.assert_array_equal(got.logprobs, want.logprobs)
        np.testing.assert_array_equal(got.policy_versions, want.policy_versions)


@pytest.mark.parametrize("fault, problem", [
    ("logprob_plus_3", "positive_logprobs"),
    ("logprob_minus_1e30", "logprobs_below_floor"),
    ("logprob_minus_3e38", "logprobs_below_floor"),
    ("token_after_stop", "tokens_after_stop"),
    ("abort", "aborted"),
    ("echo_temperature", "sampling_mismatch"),
    ("echo_top_k", "sampling_mismatch"),
    ("echo_top_p", "sampling_mismatch"),
    ("echo_min_p", "sampling_mismatch"),
    ("echo_max_new_tokens", "sampling_mismatch"),
    ("echo_stop_token_ids", "sampling_mismatch"),
    ("echo_seed", "sampling_mismatch"),
    ("too_long", "too_long"),
    ("out_of_learner_vocab", "token_out_of_vocab"),
])
def test_bad_sample_is_dropped_and_counted(client, fault, problem):
    assert_only_sample_0_dropped(client, fault, problem)


def test_invalid_echo_for_an_unset_field_is_dropped_not_raised(client):
    assert_only_sample_0_dropped(client, "echo_temperature_inf", "invalid_sampling",
                                 SamplingParams(max_new_tokens=30, stop_token_ids=(STOP_TOKEN,), seed=9))


def test_duplicate_final_message_is_dropped_and_counted_and_the_first_kept(client):
    honest = client.generate(request("honest"))
    before = client.metrics()["samples/dropped/duplicate_sample_index"]
    samples = client.generate(request("duplicate"))
    assert client.metrics()["samples/dropped/duplicate_sample_index"] == before + 1
    assert [s.sample_index for s in samples] == [0, 1, 2]
    for got, want in zip(samples, honest, strict=True):
        np.testing.assert_array_equal(got.completion_token_ids, want.completion_token_ids)


def test_server_vocabulary_applies_when_the_learner_sets_none(server):
    with RolloutClient(ClientConfig(target=server.target)) as permissive:
        assert len(permissive.generate(request("out_of_learner_vocab"))) == 3  # 5000 < the advertised 10000.


def test_abort_this_client_asked_for_is_returned(client):
    long = request("honest", SamplingParams(max_new_tokens=3000, stop_token_ids=(), seed=1))
    future = client.submit(long)
    time.sleep(0.3)  # Some tokens are out, most are not.
    assert client.abort([long.request_id]) == [long.request_id]
    assert [s.finish_reason for s in future.result(timeout=10)] == [pb.FINISH_REASON_ABORT] * 3


def test_buffer_drops_and_counts_versions_ahead_of_the_learner(client):
    requests = iter([request("version_ahead")])
    buffer = RolloutBuffer(client, requests, max_in_flight=1, max_staleness=0)
    assert [s.sample_index for s in buffer.get(learner_version=0, timeout_s=30)] == [1, 2]
    assert buffer.metrics()["samples/dropped/version_ahead"] == 1
    assert buffer.metrics()["buffer/stale_dropped"] == 0


def raw(tokens, logprobs=None, finish_reason=pb.FINISH_REASON_STOP, **echo) -> RawSample:
    """A hand-made sample of `PARAMS`, its echo changed by `echo`."""
    logprobs = [-1.0] * len(tokens) if logprobs is None else logprobs
    sampling = PARAMS.to_proto()
    for name, value in echo.items():
        setattr(sampling, name, value)
    final = pb.SampleResult(finish_reason=finish_reason, completion_tokens=len(tokens), sampling=sampling)
    return RawSample(np.array(tokens, np.int32), np.array(logprobs, np.float32), [(0, len(tokens), 0)], final)


EXPECTED = Expected(sampling=PARAMS.to_proto(), vocab_size=LEARNER_VOCAB_SIZE)


@pytest.mark.parametrize("sample, problem", [
    (raw([2, 3]), None),
    (raw([2, STOP_TOKEN]), None),
    (raw([2, 3], [-1.0, 1e-4]), None),
    (raw([2, 3], [-1.0, 3.0]), "positive_logprobs"),
    (raw([2, 3], [-1.0, -1e30]), "logprobs_below_floor"),
    (raw([2, 3], [-1.0, -3e38]), "logprobs_below_floor"),
    (raw([2, 5000]), "token_out_of_vocab"),
    (raw([2, 3], finish_reason=pb.FINISH_REASON_ABORT), "aborted"),
    (raw([2, 3], temperature=0.5), "sampling_mismatch"),
    (raw([2, 3], top_k=3), "sampling_mismatch"),
    (raw([2, 3], top_p=0.5), "sampling_mismatch"),
    (raw([2, 3], min_p=0.1), "sampling_mismatch"),
    (raw([2, 3], max_new_tokens=31), "sampling_mismatch"),
    (raw([2, 3], max_new_tokens=20), None),  # Capped at the context left.
    (raw([2, 3], seed=10), "sampling_mismatch"),
    (raw([2, 3], temperature=float("inf")), "invalid_sampling"),
    (raw([2, 3], top_p=0.0), "invalid_sampling"),
    (raw([2] * 31), "too_long"),
    (raw([2] * 21, max_new_tokens=20), "too_long"),  # The server may cap max_new_tokens, then keeps to it.
    (raw([2, STOP_TOKEN, 3]), "tokens_after_stop"),
])
def test_find_problem(sample, problem):
    found = find_problem(sample, EXPECTED)
    assert (found and found[0]) == problem


def test_find_problem_echoed_stop_ids_must_match_and_an_asked_abort_is_accepted():
    sample = raw([2, 3])
    sample.final.sampling.stop_token_ids.token_ids[:] = [0]
    assert find_problem(sample, EXPECTED)[0] == "sampling_mismatch"
    aborted = raw([2, 3], finish_reason=pb.FINISH_REASON_ABORT)
    assert find_problem(aborted, Expected(PARAMS.to_proto(), LEARNER_VOCAB_SIZE, abort_requested=True)) is None


def test_find_problem_uses_the_echoed_limits_for_fields_the_request_left_to_the_server():
    sample = raw([2, 0, 3])
    sample.final.sampling.stop_token_ids.token_ids[:] = [0]
    assert find_problem(sample, Expected(pb.SamplingParams(), LEARNER_VOCAB_SIZE))[0] == "tokens_after_stop"
