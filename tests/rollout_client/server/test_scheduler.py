"""Scheduler rules with an in-process scripted generator: stop tokens, length, chunks."""

import queue

import numpy as np

from rollout_client.sampling_params import FinishReason, LogprobMode
from rollout_client.server.generator import ResolvedSampling, SequenceSpec
from rollout_client.server.scheduler import Scheduler
from rollout_client.server.scripted import ScriptedGenerator


def run(stop_token_ids, max_new_tokens, chunk_tokens=0, tokens_per_step=7):
    generator = ScriptedGenerator(vocab_size=50, tokens_per_step=tokens_per_step, max_seq_len=512)
    scheduler = Scheduler(generator)
    outputs = queue.Queue()
    spec = SequenceSpec(np.array([3], np.int32), ResolvedSampling(1.0, 0, 1.0, 0.0, max_new_tokens,
                                                                  tuple(stop_token_ids), 0), 0, LogprobMode.RAW)
    scheduler.submit(spec, outputs.put, chunk_tokens)
    pieces = [outputs.get(timeout=10)]
    while pieces[-1].finish_reason is None:
        pieces.append(outputs.get(timeout=10))
    scheduler.close()
    return pieces


def test_stops_after_first_stop_token_and_includes_it():
    (free,) = run((), 100)
    stop = int(free.token_ids[10])
    (stopped,) = run((stop,), 100)
    first = int(np.flatnonzero(free.token_ids == stop)[0])
    assert stopped.finish_reason == FinishReason.STOP
    np.testing.assert_array_equal(stopped.token_ids, free.token_ids[:first + 1])


def test_length_limit_truncates_overshooting_steps():
    (final,) = run((), 10, tokens_per_step=7)
    assert final.finish_reason == FinishReason.LENGTH and final.token_ids.size == final.completion_tokens == 10
    assert final.version_spans == ((0, 10, 0),)


def test_chunks_concatenate_to_the_completion():
    (whole,) = run((), 200)
    pieces = run((), 200, chunk_tokens=64)
    assert all(piece.token_ids.size >= 64 for piece in pieces[:-1]) and len(pieces) > 2
    np.testing.assert_array_equal(np.concatenate([piece.token_ids for piece in pieces]), whole.token_ids)
