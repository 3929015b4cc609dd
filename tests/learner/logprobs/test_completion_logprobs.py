"""`completion_logprobs`: a float64 NumPy reference on the model's full logits, and the frequency with which the real
`ModelGenerator` samples a completion."""

import numpy as np
import pytest
from flax import nnx

from learner.logprobs.completions import completion_logprobs
from learner.model.transformer import Transformer, model_config
from learner.serving.model_generator import ModelGenerator
from rollout_client.sampling_params import LogprobMode
from rollout_client.server.generator import ResolvedSampling, SequenceSpec


@pytest.fixture(scope="module")
def model():
    return Transformer(model_config("tiny"), rngs=nnx.Rngs(3))


def reference(model, prompt, completion, temperature):
    """float64: the full logits of prompt + completion, log-softmax at the temperature, summed over the completion."""
    tokens = np.concatenate([prompt, completion])[None].astype(np.int32)
    positions = np.arange(tokens.shape[1])[None]
    logits = np.asarray(model.logits(model(tokens, positions, np.ones_like(tokens, bool))), np.float64)[0]
    scaled = logits / temperature
    logp = scaled - np.log(np.exp(scaled - scaled.max(-1, keepdims=True)).sum(-1, keepdims=True)) - scaled.max(
        -1, keepdims=True)
    return sum(logp[prompt.size - 1 + t, token] for t, token in enumerate(completion))


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_matches_a_float64_reference_across_lengths_and_batches(model, temperature):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 128, n) for n in (1, 5, 12, 30, 3)]
    completions = [rng.integers(3, 128, n) for n in (4, 1, 20, 9, 40)]
    # 2 rows per batch: three batches (the last one short), padded to 16, 32 and 64 tokens
    got = completion_logprobs(model, prompts, completions, temperature=temperature, batch_rows=2)
    want = [reference(model, p, c, temperature) for p, c in zip(prompts, completions)]
    # float32 logits and sums on the device: ~1e-6 relative per token, over up to 40 tokens
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_is_the_frequency_of_the_completion_among_real_samples(model):
    """The probability of a two-token completion at temperature 0.25 against how often the server's generator samples
    it (2,000 seeded samples; 5 standard errors)."""
    prompt = np.array([5, 17, 42, 9], np.int32)
    temperature, samples = 0.25, 2000
    generator = ModelGenerator(model, max_batch_size=16, max_seq_len=32, decode_steps_per_call=1)
    drawn = []
    for start in range(0, samples, 16):
        for index in range(start, start + 16):
            sampling = ResolvedSampling(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, max_new_tokens=2,
                                        stop_token_ids=(), seed=index)
            generator.add(index, SequenceSpec(prompt_token_ids=prompt, sampling=sampling, sample_index=0,
                                              logprob_mode=LogprobMode.PROCESSED))
        outputs = generator.step()  # the prefill's token, then one decoded token
        drawn += [tuple(outputs[index][0][:2]) for index in range(start, start + 16)]
        for index in range(start, start + 16):
            generator.remove(index)
    counts = {}
    for completion in drawn:
        counts[completion] = counts.get(completion, 0) + 1
    common = sorted(counts, key=counts.get, reverse=True)[:3]
    probability = np.exp(completion_logprobs(model, [prompt] * 3, [np.array(c) for c in common],
                                             temperature=temperature))
    frequency = np.array([counts[c] for c in common]) / samples
    assert probability[0] > 0.05  # a completion frequent enough to test
    error = np.sqrt(probability * (1 - probability) / samples)
    assert np.all(np.abs(frequency - probability) < 5 * error), (frequency, probability)


@pytest.mark.parametrize("prompts, completions, message", [
    ([[1, 2]], [[3], [4]], "1 prompts but 2 completions"),
    ([[1, 2]], [[]], "at least one token"),
    ([[1] * 200], [[2] * 57], "257 tokens: more than the model's context of 256"),
])
def test_rejects_bad_rows(model, prompts, completions, message):
    with pytest.raises(ValueError, match=message):
        completion_logprobs(model, prompts, completions)
