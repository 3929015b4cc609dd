"""What the model generator's decode loop asks of the device per generated token: one program dispatch, one upload and
one wait (host sync) per `ModelGenerator.step` call of ``decode_steps_per_call`` tokens a row, and no program built
after `ModelGenerator.compile_all`. Counted on the real engine in process: its compiled programs wrapped in
counters, `jax.device_put` / `jax.device_get` counted, and every step run under ``jax.transfer_guard("disallow")``
so that an implicit transfer (a NumPy array passed to a program, ``np.asarray`` of a device array on an
accelerator) fails instead of hiding from the counts (on XLA:CPU a device array is host memory, so the guard
catches the host-to-device direction only; on a GPU both)."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from learner.model.transformer import Transformer, model_config
from learner.reporting.compiles import compile_stats
from learner.serving.model_generator import ModelGenerator
from learner.serving.sampling import sample_rows, sample_token
from rollout_client.sampling_params import LogprobMode
from rollout_client.server.generator import ResolvedSampling, SequenceSpec

STEPS_PER_CALL = 4
ROWS = 3
CALLS = 3


@pytest.fixture(scope="module")
def generator():
    model = Transformer(model_config("tiny"), rngs=nnx.Rngs(5))
    generator = ModelGenerator(model, max_batch_size=4, max_seq_len=32, decode_steps_per_call=STEPS_PER_CALL)
    generator.compile_all()
    return generator


def spec(index, top_p=1.0):
    sampling = ResolvedSampling(temperature=0.9, top_k=0, top_p=top_p, min_p=0.0, max_new_tokens=64,
                                stop_token_ids=(), seed=7)
    return SequenceSpec(prompt_token_ids=np.array([5, 9, 2 + index], np.int32), sampling=sampling,
                        sample_index=index, logprob_mode=LogprobMode.PROCESSED)


def counted(generator, monkeypatch):
    """Counts of each compiled program's calls (by its key) and of `jax.device_put` / `jax.device_get` calls."""
    counts = collections.Counter()

    def counting(name, function):
        def call(*args, **kwargs):
            counts[name] += 1
            return function(*args, **kwargs)
        return call

    for key, program in list(generator._compiled.items()):
        monkeypatch.setitem(generator._compiled, key, counting(key, program))
    monkeypatch.setattr(jax, "device_put", counting("device_put", jax.device_put))
    monkeypatch.setattr(jax, "device_get", counting("device_get", jax.device_get))
    return counts


def test_each_decode_call_is_one_dispatch_one_upload_and_one_host_sync_for_every_row_and_step(generator,
                                                                                               monkeypatch):
    for index in range(ROWS):
        generator.add(index, spec(index))
    built = compile_stats()["compile/programs"]
    counts = counted(generator, monkeypatch)
    tokens = collections.Counter()
    with jax.transfer_guard("disallow"):
        for _ in range(CALLS):
            for sequence_id, (token_ids, _) in generator.step().items():
                tokens[sequence_id] += len(token_ids)
    decode_key = ("decode", 4)  # 3 active rows decode as the first 4 (`decode_rows`)
    assert counts == {decode_key: CALLS, "device_put": CALLS, "device_get": CALLS}
    for index in range(ROWS):
        generator.remove(index)
    # every row gets STEPS_PER_CALL tokens a call (+ the prefill's first token): per generated token,
    # 1 / (rows x steps) dispatches and host syncs
    assert tokens == {index: 1 + CALLS * STEPS_PER_CALL for index in range(ROWS)}
    assert compile_stats()["compile/programs"] == built  # no program built after compile_all


def test_an_add_is_one_prefill_dispatch_and_one_host_sync_and_builds_no_program(generator, monkeypatch):
    built = compile_stats()["compile/programs"]
    counts = counted(generator, monkeypatch)
    generator.add(0, spec(0))
    generator.add(1, spec(1, top_p=0.8))
    generator.step()
    generator.remove(0)  # row 1 moves down: the row-move program
    generator.remove(1)
    assert counts[("prefill", 16)] == 2 and counts[("decode", 2)] == 1 and counts[("move",)] == 1
    assert counts["device_get"] == 2 + 1  # one per add, one per step
    assert compile_stats()["compile/programs"] == built


@pytest.mark.parametrize("vocab", [7, 300])
def test_rows_without_a_cut_sample_the_same_tokens_and_logprobs_as_the_full_sampler(vocab):
    """`sample_rows` skips the vocabulary sort when no row has top-k, top-p or min-p: bit for bit the same numbers,
    including -inf logits; with one row cutting, every row goes through the full sampler."""
    rows = 5
    logits = jax.random.normal(jax.random.PRNGKey(vocab), (rows, vocab)) * 3
    logits = logits.at[:, 1].set(-jnp.inf)
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(1), i))(jnp.arange(rows))
    temperature = jnp.array([1.0, 0.7, 1.3, 1.0, 0.5])
    processed = jnp.array([True, False, True, True, False])
    top_k, min_p = jnp.zeros(rows, jnp.int32), jnp.zeros(rows)
    for top_p in (jnp.ones(rows), jnp.array([1.0, 1.0, 0.6, 1.0, 1.0])):
        arguments = (logits, keys, temperature, top_k, top_p, min_p, processed)
        fast = jax.jit(sample_rows)(*arguments)
        full = jax.jit(jax.vmap(sample_token))(*arguments)
        np.testing.assert_array_equal(np.asarray(fast[0]), np.asarray(full[0]))
        np.testing.assert_array_equal(np.asarray(fast[1]), np.asarray(full[1]))
    assert np.all(np.asarray(fast[1])[processed] > -np.inf)
