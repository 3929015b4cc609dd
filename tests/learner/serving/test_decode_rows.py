"""The model generator decodes only its active rows, kept lowest in the cache: the scheduler with the real
`ModelGenerator` in process."""

import functools
import threading

import jax
import numpy as np
import pytest
from flax import nnx

from learner.model.transformer import Transformer, model_config
from learner.serving import model_generator
from learner.serving.model_generator import ModelGenerator
from rollout_client.sampling_params import LogprobMode, PauseMode
from rollout_client.server.generator import ResolvedSampling, SequenceSpec
from rollout_client.server.scheduler import Scheduler

STEPS_PER_CALL = 4
MAX_NEW_TOKENS = (4, 8, 12, 16, 40)  # finished after decode calls 1, 2, 3, 4, 10 (the prefill gives one token)


@pytest.fixture(scope="module")
def model():
    return Transformer(model_config("tiny"), rngs=nnx.Rngs(3))


def make_generator(model, max_batch_size=16):
    return ModelGenerator(model, max_batch_size=max_batch_size, max_seq_len=64, decode_steps_per_call=STEPS_PER_CALL)


def spec(index, max_new_tokens, temperature=0.8):
    prompt = np.array([3 + index, 17, 42, 5, 9][:2 + index % 4], np.int32)
    sampling = ResolvedSampling(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, max_new_tokens=max_new_tokens,
                                stop_token_ids=(), seed=11)
    return SequenceSpec(prompt_token_ids=prompt, sampling=sampling, sample_index=index,
                        logprob_mode=LogprobMode.PROCESSED)


def record_decode_rows(monkeypatch):
    """(active mask, leading rows decoded) of every decode call."""
    calls = []

    def recording(active):
        rows = original(active)
        calls.append((active.copy(), rows))
        return rows

    original = model_generator.decode_rows
    monkeypatch.setattr(model_generator, "decode_rows", recording)
    return calls


def run_scheduler(generator, specs):
    """Every spec through a `Scheduler`, all admitted before the first step; the final outputs by spec index."""
    scheduler = Scheduler(generator)
    outputs = {}
    finished = threading.Semaphore(0)

    def sink(output, index):  # every sequence's only output: no chunking asked
        outputs[index] = output
        finished.release()

    try:
        scheduler.pause(PauseMode.KEEP)
        for index, sequence in enumerate(specs):
            scheduler.submit(sequence, functools.partial(sink, index=index))
        scheduler.resume()
        for _ in specs:
            assert finished.acquire(timeout=600)
    finally:
        scheduler.close()
    return [outputs[index] for index in range(len(specs))]


def test_each_decode_runs_the_active_rows_padded_to_a_power_of_two(model, monkeypatch):
    calls = record_decode_rows(monkeypatch)
    generator = make_generator(model)
    outputs = run_scheduler(generator, [spec(i, n) for i, n in enumerate(MAX_NEW_TOKENS)])
    assert [len(output.token_ids) for output in outputs] == list(MAX_NEW_TOKENS)
    assert [active.sum() for active, _ in calls] == [5, 4, 3, 2] + [1] * 6
    assert [rows for _, rows in calls] == [8, 4, 4, 2] + [1] * 6  # of max_batch_size = 16
    for active, _ in calls:  # the first sequences to finish had the lowest rows: the live ones moved down
        assert np.flatnonzero(active).tolist() == list(range(active.sum()))


def test_outputs_equal_the_full_batch_decode(model, monkeypatch):
    """Same tokens, and logprobs to float32 rounding, as decoding every row of the cache (what the engine did
    before): each row's computation is its own, but XLA may sum a dot of 2 rows in another order than of 16."""
    specs = [spec(i, n, temperature=t) for i, (n, t) in enumerate(zip(MAX_NEW_TOKENS, (1.0, 0.7, 1.3, 1.0, 0.9)))]
    bucketed = run_scheduler(make_generator(model), specs)
    monkeypatch.setattr(model_generator, "decode_rows", lambda active: active.size)
    full = run_scheduler(make_generator(model), specs)
    for got, want in zip(bucketed, full):
        np.testing.assert_array_equal(got.token_ids, want.token_ids)
        np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-6)
        assert got.finish_reason == want.finish_reason


def test_decode_programs_stay_few(model):
    """Every active count from 1 to 8 compiles one decode program per power of two: 1, 2, 4, 8."""
    # The compiled programs of every jitted function share one LRU cache per process (8192 entries): after many tests
    # in this worker it would evict this test's programs mid-count. Start it empty.
    jax.clear_caches()
    generator = make_generator(model, max_batch_size=8)
    for index in range(8):
        generator.add(index, spec(index, 64))
        generator.step()
    for index in range(8):
        generator.remove(index)
        generator.step()
    assert generator._decode._cache_size() == 4


@pytest.mark.parametrize("max_batch_size, max_seq_len", [(16, 64), (12, 100), (1, 8)])
def test_compile_all_covers_every_prefill_length_and_decode_row_count_a_request_can_need(model, max_batch_size,
                                                                                          max_seq_len):
    generator = ModelGenerator(model, max_batch_size=max_batch_size, max_seq_len=max_seq_len)
    lengths, row_counts = generator.prefill_lengths(), generator.decode_row_counts()
    assert {model_generator.prefill_bucket(n, max_seq_len) for n in range(1, max_seq_len)} == set(lengths)
    rng = np.random.default_rng(0)
    masks = [rng.random(max_batch_size) < p for p in (0.1, 0.5, 1.0) for _ in range(50)]
    assert {model_generator.decode_rows(mask) for mask in masks} <= set(row_counts)
    assert row_counts[-1] == max_batch_size and all(b == 2 * a for a, b in zip(row_counts, row_counts[1:-1]))


def test_requests_after_compile_all_build_no_program(model):
    """What the server promises when it reports ready: requests (prefills of several lengths, decodes at several row
    counts, rows moved, each sample's key derived from its seed) run compile_all's programs and build none."""
    jax.clear_caches()  # programs built by earlier tests in this worker would hide a compile on first use
    generator = ModelGenerator(model, max_batch_size=4, max_seq_len=32, decode_steps_per_call=STEPS_PER_CALL)
    assert generator.compile_all() == generator.program_count()  # what the server announces before it compiles
    built = generator.compiled_programs
    for index in range(4):
        generator.add(index, spec(index, 8))
        generator.step()
    for index in (0, 2, 1, 3):
        generator.remove(index)
        generator.step()
    assert generator.compiled_programs == built


@pytest.mark.slow  # 21 s in a full default run on the 2-core machine (13 s alone): out of the default run's 15 minutes
def test_recompute_after_compile_all_with_recompute_builds_no_program(model):
    """Partial rollouts' server (``--partial``): each publish that keeps sequences recomputes their cache at a
    (rows, length) of `refill_shapes`; compile_all(recompute=True) built them all, so the publishes build none. The
    same calls on an engine without them (which compiles each on first use) give the same tokens and cache."""
    jax.clear_caches()

    def run(engine):
        tokens = []
        for index in range(2):
            engine.add(index, spec(index, 24))
            tokens.append(engine.step())
            engine.recompute_cache()  # 1 row, then 2, at length 16
        for _ in range(3):
            tokens.append(engine.step())
            engine.recompute_cache()  # the longest row passes 16 slots: the whole row (32)
        return tokens

    def make():
        return ModelGenerator(model, max_batch_size=2, max_seq_len=32, decode_steps_per_call=STEPS_PER_CALL)

    reference = make()  # first, without the refills: the count sees them compile on first use
    reference.compile_all()
    built = reference.compiled_programs
    reference_tokens = run(reference)
    assert reference.compiled_programs > built
    jax.clear_caches()
    generator = make()
    assert generator.refill_shapes() == [(1, 16), (1, 32), (2, 16), (2, 32)]
    assert generator.program_count(recompute=True) == 2 + 2 + 1 + 4  # prefills, decodes, the row move, the refills
    assert generator.compile_all(recompute=True) == 2 + 2 + 1 + 4
    built = generator.compiled_programs
    tokens = run(generator)
    assert generator.compiled_programs == built
    for got, want in zip(tokens, reference_tokens, strict=True):
        assert got.keys() == want.keys()
        for key in got:
            np.testing.assert_array_equal(got[key][0], want[key][0])
            np.testing.assert_allclose(got[key][1], want[key][1], rtol=1e-5, atol=1e-6)  # the same programs' math
    for kept, rebuilt in zip(jax.tree.leaves(generator._cache), jax.tree.leaves(reference._cache), strict=True):
        np.testing.assert_allclose(np.asarray(kept), np.asarray(rebuilt), rtol=1e-5, atol=1e-6)


def test_a_batch_invariant_generator_precompiles_its_one_decode_program(model):
    """batch_invariant decodes every row at every step: compile_all builds that one row count, and a step with one
    active row runs the program it built (no compile on first use)."""
    generator = ModelGenerator(model, max_batch_size=4, max_seq_len=32, batch_invariant=True)
    assert generator.decode_row_counts() == [4]
    built = generator.compile_all()
    assert built == len(generator.prefill_lengths()) + 1 + 1  # the prefills, the one decode, the row move
    generator.add(0, spec(0, 8))
    generator.step()
    assert generator._decode._cache_size() == 0  # the step ran compile_all's program, not the jitted function's
