"""The in-flight buffer (real server), batch collation and validation (in process)."""

import concurrent.futures
import itertools

import numpy as np
import pytest

from rollout_client import FinishReason, LogprobMode, RolloutBuffer, RolloutRequest, Sample, SamplingParams, collate
from rollout_client.protocol import pb
from rollout_client.samples import RawSample, StreamAssembler
from rollout_client.validation import Expected, find_problem

PARAMS = SamplingParams(max_new_tokens=20, stop_token_ids=())


def requests():
    for i in itertools.count():
        yield RolloutRequest([5, 6], PARAMS, num_samples=2, request_id=f"req-{i}")


def test_buffer_keeps_k_in_flight_and_returns_groups_in_order(client):
    buffer = RolloutBuffer(client, requests(), max_in_flight=3, max_staleness=1)
    assert buffer.in_flight == 3
    groups = [buffer.get(learner_version=0, timeout_s=10) for _ in range(4)]
    assert [group[0].request_id for group in groups] == ["req-0", "req-1", "req-2", "req-3"]
    assert [len(group) for group in groups] == [2, 2, 2, 2]
    assert buffer.in_flight == 3
    buffer.close()


def test_buffer_drops_samples_older_than_max_staleness(client):
    buffer = RolloutBuffer(client, requests(), max_in_flight=2, max_staleness=1)
    assert len(buffer.get(learner_version=1, timeout_s=10)) == 2  # Staleness 1 - 0 = 1: kept.
    assert buffer.get(learner_version=2, timeout_s=10) == []  # Staleness 2: dropped.
    assert buffer.metrics() == {"buffer/in_flight": 2, "buffer/stale_dropped": 2, "samples/dropped/version_ahead": 0}
    buffer.close()


def test_buffer_without_prefetch_issues_requests_only_when_asked(client):
    buffer = RolloutBuffer(client, requests(), max_in_flight=2, max_staleness=0, prefetch=False)
    assert buffer.in_flight == 0  # nothing is sampled before the first get (e.g. before weights are published)
    first = buffer.get(learner_version=0, timeout_s=10)
    assert buffer.in_flight == 1  # the second request of the pair, not refilled
    second = buffer.get(learner_version=0, timeout_s=10)
    assert buffer.in_flight == 0
    third = buffer.get(learner_version=0, timeout_s=10)
    assert [g[0].request_id for g in (first, second, third)] == ["req-0", "req-1", "req-2"]
    assert buffer.in_flight == 1
    buffer.close()


def test_buffer_wait_returns_when_every_request_has_finished(client):
    buffer = RolloutBuffer(client, requests(), max_in_flight=3, max_staleness=1)
    buffer.wait(timeout_s=30)
    assert all(future.done() for future in buffer._in_flight) and buffer.in_flight == 3
    buffer.close()


def make_sample(prompt, completion, versions, mode=LogprobMode.RAW) -> Sample:
    n = len(completion)
    return Sample(request_id="r", sample_index=0, prompt_token_ids=np.array(prompt, np.int32),
                  completion_token_ids=np.array(completion, np.int32),
                  logprobs=-np.arange(1, n + 1, dtype=np.float32), policy_versions=np.array(versions, np.int64),
                  finish_reason=FinishReason.STOP,
                  sampling=SamplingParams(temperature=0.5, top_k=0, top_p=1.0, min_p=0.0), logprob_mode=mode)


def test_collate_aligns_per_token_arrays_with_tokens():
    batch = collate([make_sample([1, 2], [3, 4, 5], [0, 0, 1]), make_sample([7], [8], [2])], pad_to_multiple=4)
    np.testing.assert_array_equal(batch.tokens, [[1, 2, 3, 4, 5, 0, 0, 0], [7, 8, 0, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(batch.loss_mask, [[0, 0, 1, 1, 1, 0, 0, 0], [0, 1, 0, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(batch.rollout_logprobs[0, :5], [0, 0, -1, -2, -3])
    np.testing.assert_array_equal(batch.policy_versions[0], [-1, -1, 0, 0, 1, -1, -1, -1])
    np.testing.assert_array_equal(batch.completion_lengths, [3, 1])
    np.testing.assert_array_equal(batch.temperature, [0.5, 0.5])
    assert batch.logprob_mode == LogprobMode.RAW


def test_collate_refuses_mixed_logprob_modes():
    with pytest.raises(ValueError, match="mixed logprob modes"):
        collate([make_sample([1], [2], [0]), make_sample([1], [2], [0], LogprobMode.PROCESSED)])


def raw(tokens, logprobs, spans, completion_tokens=None):
    final = pb.SampleResult(finish_reason=pb.FINISH_REASON_STOP,
                            completion_tokens=len(tokens) if completion_tokens is None else completion_tokens)
    return RawSample(np.array(tokens, np.int32), np.array(logprobs, np.float32), spans, final)


@pytest.mark.parametrize("sample, floor, problem", [
    (raw([1, 2], [-1.0, -1.0], [(0, 2, 0)]), None, None),
    (raw([1, 2], [-1.0], [(0, 2, 0)]), None, "length_mismatch"),
    (raw([], [], []), None, "empty_completion"),
    (raw([1, 2], [-1.0, -1.0], [(0, 1, 0)]), None, "bad_version_spans"),
    (raw([1, 2], [-1.0, np.inf], [(0, 2, 0)]), None, "non_finite_logprobs"),
    (raw([1, 10], [-1.0, -1.0], [(0, 2, 0)]), None, "token_out_of_vocab"),
    (raw([1, 2], [-1.0, -1.0], [(0, 1, 0), (1, 2, 1)]), 1, "version_below_floor"),
])
def test_find_problem(sample, floor, problem):
    found = find_problem(sample, Expected(pb.SamplingParams(), vocab_size=10, version_floor=floor))
    assert (found and found[0]) == problem


def packed(values, dtype: str) -> bytes:
    """Little-endian bytes of `values`; bytes pass through unchanged (to send malformed ones)."""
    return values if isinstance(values, bytes) else np.asarray(values, dtype).tobytes()


def message(kind, tokens, logprobs, **final_fields):
    """A GenerateResponse with one chunk or final part."""
    fields = dict(token_ids=packed(tokens, "<i4"), logprobs=packed(logprobs, "<f4"))
    part = pb.SampleChunk(**fields) if kind == "chunk" else pb.SampleResult(**fields, **final_fields)
    return pb.GenerateResponse(sample_index=0, **{kind: part})


def test_assembler_unpacks_little_endian_bytes_across_chunks():
    assembler = StreamAssembler()
    assert assembler.add(message("chunk", [3, 4], [-0.5, -1.5])) is None
    raw = assembler.add(message("final", [5], [-2.0], completion_tokens=3))
    assert raw.token_ids.tolist() == [3, 4, 5] and raw.token_ids.dtype == np.int32
    assert raw.logprobs.tolist() == [-0.5, -1.5, -2.0] and raw.logprobs.dtype == np.float32


@pytest.mark.parametrize("chunk, final, problem", [
    (None, ([1, 2], b"\0" * 7), "bad_byte_length"),
    (None, (b"\0" * 6, b"\0" * 6), "bad_byte_length"),
    (([1, 2], [-1.0]), ([3], [-1.0, -1.0]), "length_mismatch"),  # Equal totals, shifted tokens.
])
def test_assembler_reports_malformed_bytes_instead_of_decoding_them(chunk, final, problem):
    assembler = StreamAssembler()
    if chunk is not None:
        assembler.add(message("chunk", *chunk))
    raw = assembler.add(message("final", *final, completion_tokens=3, finish_reason=pb.FINISH_REASON_STOP))
    assert raw.token_ids.size == 0 and raw.logprobs.size == 0
    assert find_problem(raw, Expected(pb.SamplingParams(), vocab_size=10))[0] == problem


def test_batch_from_server_passes_corrections_checks(client):
    import corrections

    samples = client.generate(RolloutRequest([5, 6, 7], PARAMS, num_samples=4))
    batch = collate(samples)
    learner_version = 1
    policy_lag = np.where(batch.loss_mask == 1, learner_version - batch.policy_versions, 0).astype(np.float32)
    corrections.check_batch(batch.loss_mask, rollout_logprobs=batch.rollout_logprobs)
    result = corrections.compute(batch.rollout_logprobs, np.zeros(len(samples), np.float32), batch.loss_mask,
                                 proximal_logprobs=batch.rollout_logprobs, rollout_logprobs=batch.rollout_logprobs,
                                 policy_lag=policy_lag)
    assert np.isfinite(float(result.loss))
    np.testing.assert_array_equal(np.asarray(result.mask), batch.loss_mask)


class _DoneClient:
    """Answers each request at once with the samples given for it."""

    def __init__(self, answers):
        self.answers = iter(answers)

    def submit(self, request):
        future = concurrent.futures.Future()
        future.set_result(next(self.answers))
        return future


def mixed_sample(versions) -> Sample:
    """A sample of a partial rollout: its tokens drawn by the given versions."""
    count = len(versions)
    return Sample(request_id="r", sample_index=0, prompt_token_ids=np.array([5, 6], np.int32),
                  completion_token_ids=np.arange(count, dtype=np.int32), logprobs=np.full(count, -1.0, np.float32),
                  policy_versions=np.asarray(versions, np.int64), finish_reason=FinishReason.LENGTH, sampling=PARAMS,
                  logprob_mode=LogprobMode.PROCESSED)


def test_a_mixed_version_sample_is_as_stale_as_its_oldest_token():
    """Partial rollouts: the staleness limit applies per token, so the oldest token decides (a sample that began
    under version 3 and ended under 5 is 2 versions old at learner version 5, however new its last tokens)."""
    fresh, old = mixed_sample([4, 4, 5, 5]), mixed_sample([3, 3, 4, 5])
    buffer = RolloutBuffer(_DoneClient([[fresh, old]]), requests(), max_in_flight=1, max_staleness=1,
                           prefetch=False)
    (kept,) = buffer.get(learner_version=5)
    assert kept is fresh
    assert buffer.metrics()["buffer/stale_dropped"] == 1
