"""``batch_invariant``: a sample's tokens and logprobs do not depend on the other sequences of the decode batch
(the real `ModelGenerator` in process; what ``loop.deterministic`` relies on)."""

import numpy as np
import pytest
from flax import nnx

from learner.model import Transformer, model_config
from learner.serving.model_generator import ModelGenerator
from rollout_client.sampling_params import LogprobMode
from rollout_client.server.generator import ResolvedSampling, SequenceSpec

ROWS = 32  # max_batch_size: 20 other sequences make the default decode run 32 rows instead of 1


@pytest.fixture(scope="module")
def model():
    return Transformer(model_config("tiny"), rngs=nnx.Rngs(5))


def spec(prompt, seed):
    sampling = ResolvedSampling(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, max_new_tokens=16,
                                stop_token_ids=(), seed=seed)
    return SequenceSpec(prompt_token_ids=np.asarray(prompt, np.int32), sampling=sampling, sample_index=0,
                        logprob_mode=LogprobMode.PROCESSED)


def decode(generator, specs, target, calls=4, remove_after_first=()):
    """Adds each spec in order (ids 0, 1, ...), runs ``calls`` decode calls, removes every sequence; returns the
    tokens and logprobs of id ``target``."""
    for sequence_id, sequence in enumerate(specs):
        generator.add(sequence_id, sequence)
    tokens, logprobs = [], []
    for call in range(calls):
        new_tokens, new_logprobs = generator.step()[target]
        tokens.append(new_tokens)
        logprobs.append(new_logprobs)
        if call == 0:
            for sequence_id in remove_after_first:  # the highest rows move down into the freed ones
                generator.remove(sequence_id)
    for sequence_id in set(range(len(specs))) - set(remove_after_first):
        generator.remove(sequence_id)
    return np.concatenate(tokens), np.concatenate(logprobs)


def test_a_sample_is_the_same_alone_and_among_others_only_when_batch_invariant(model):
    rng = np.random.default_rng(0)
    first = spec(rng.integers(3, 100, 7), seed=123)
    others = [spec(rng.integers(3, 100, rng.integers(3, 12)), seed=1000 + i) for i in range(20)]
    invariant = ModelGenerator(model, max_batch_size=ROWS, max_seq_len=64, decode_steps_per_call=4,
                               batch_invariant=True)
    alone = decode(invariant, [first], target=0)
    for together in (decode(invariant, [first, *others], target=0),
                     decode(invariant, [*others[:10], first, *others[10:]], target=10, remove_after_first=range(5))):
        # bit for bit: the same program, and row data that does not mix with other rows
        np.testing.assert_array_equal(together[0], alone[0])
        np.testing.assert_array_equal(together[1], alone[1])
    # Without it a decode runs as many rows as the live sequences need, and XLA may round a 32-row decode
    # differently from a 1-row one (measured here: ~1e-6): that difference is what the flag removes.
    bucketed = ModelGenerator(model, max_batch_size=ROWS, max_seq_len=64, decode_steps_per_call=4)
    np.testing.assert_allclose(decode(bucketed, [first, *others], target=0)[1], decode(bucketed, [first], target=0)[1],
                               rtol=1e-5, atol=1e-5)
