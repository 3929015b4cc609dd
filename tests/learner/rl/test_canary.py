"""The publish canary (`learner.rl.canary`): the per-token learner logprobs against a float64 NumPy reference, the
comparison, when it runs, its config keys, and `PublishCanary.verify` against an engine stand-in that answers with
the float64 reference's logprobs (a protocol-level check; the real engines: tests/e2e/test_canary_run.py)."""

import concurrent.futures

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from learner.logprobs.completions import completion_logprobs, completion_token_logprobs
from learner.model.transformer import Transformer, model_config
from learner.rl import load_config
from learner.rl.canary import (
    CANARY_NEW_TOKENS,
    CANARY_PROMPT_TOKENS,
    CANARY_PROMPTS,
    DEFAULT_TOLERANCES,
    CanaryMismatchError,
    PublishCanary,
    canary_prompts,
    coarser_dtype,
    compare,
    default_tolerance,
    learner_scorer,
)
from rollout_client import FinishReason, LogprobMode, SamplingParams
from rollout_client.samples import Sample


@pytest.fixture(scope="module")
def model():
    return Transformer(model_config("tiny"), rngs=nnx.Rngs(7))


REFERENCE_WIDTH = 64  # every reference forward pass is padded to this (causal: padding after a token changes nothing)


@nnx.jit
def _logits(model, tokens):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return model.logits(model(tokens, positions, jnp.ones_like(tokens, bool)))


def reference_logprobs(model, tokens: np.ndarray) -> np.ndarray:
    """float64 ``[T, V]``: log-softmax of the model's full logits (float32) at each position of ``tokens``."""
    padded = np.zeros((1, REFERENCE_WIDTH), np.int32)
    padded[0, :len(tokens)] = tokens
    logits = np.asarray(_logits(model, padded), np.float64)[0, :len(tokens)]
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


def reference_token_logprobs(model, prompt, completion) -> np.ndarray:
    logp = reference_logprobs(model, np.concatenate([prompt, completion]))
    return np.array([logp[prompt.size - 1 + t, token] for t, token in enumerate(completion)])


def test_completion_token_logprobs_match_a_float64_reference_and_sum_to_completion_logprobs(model):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 128, n) for n in (12, 1, 30, 5)]
    completions = [rng.integers(3, 128, n) for n in (8, 3, 17, 1)]
    got = completion_token_logprobs(model, prompts, completions, batch_rows=3)  # two batches, the second short
    for prompt, completion, row in zip(prompts, completions, got):
        assert row.shape == completion.shape
        np.testing.assert_allclose(row, reference_token_logprobs(model, prompt, completion), rtol=0, atol=2e-5)
    np.testing.assert_allclose([row.astype(np.float64).sum() for row in got],
                               completion_logprobs(model, prompts, completions, batch_rows=3), rtol=1e-6, atol=1e-4)


def test_compare_is_the_largest_and_mean_absolute_difference_and_nan_fails():
    result = compare([np.array([-1.0, -2.0]), np.array([-0.5])], [np.array([-1.0, -2.25]), np.array([-0.625])])
    assert (result.max_abs_diff, result.mean_abs_diff, result.tokens) == (0.25, 0.125, 3)
    nan = compare([np.array([np.nan, -1.0])], [np.array([-1.0, -1.0])])
    assert nan.max_abs_diff == nan.mean_abs_diff == np.inf
    with pytest.raises(ValueError, match="row 0: 2 engine logprobs but 1 learner"):
        compare([np.zeros(2)], [np.zeros(1)])
    with pytest.raises(ValueError, match="no token"):
        compare([np.zeros(0)], [np.zeros(0)])


def test_canary_prompts_are_fixed_and_inside_the_vocabulary():
    prompts = canary_prompts(50)
    assert len(prompts) == CANARY_PROMPTS and all(p.shape == (CANARY_PROMPT_TOKENS,) for p in prompts)
    assert all(p.max() < 50 and p.min() >= 0 for p in prompts)
    np.testing.assert_array_equal(np.stack(prompts), np.stack(canary_prompts(50)))


def test_tolerance_is_the_engines_and_the_coarser_dtypes():
    assert coarser_dtype("float32", "bfloat16", "float32") == "bfloat16"
    assert coarser_dtype("float32", "float16") == "float16"
    assert default_tolerance("tether", "float32") == DEFAULT_TOLERANCES["float32"]
    assert default_tolerance("mlx", "bfloat16") == DEFAULT_TOLERANCES["bfloat16"]


def test_due_at_the_start_the_first_step_then_every_n_and_never_when_off():
    canary = PublishCanary("tether", "float32", 5, None, LogprobMode.RAW, 128, 64, lambda p, c: [], lambda t, s: t)
    assert [step for step in range(0, 16) if canary.due(step, first_step=1)] == [0, 1, 5, 10, 15]
    resumed = [step for step in range(20, 31) if canary.due(step, first_step=21)]
    assert resumed == [20, 21, 25, 30]
    off = PublishCanary("tether", "float32", 0, None, LogprobMode.RAW, 128, 64, lambda p, c: [], lambda t, s: t)
    assert not any(off.due(step, first_step=1) for step in range(10))
    assert "off" in off.describe()


@pytest.mark.parametrize(("key", "value", "message"), [("canary.every", -1, "canary.every=-1: must be >= 0"),
                                                       ("canary.tolerance", 0, "canary.tolerance=0: must be > 0")])
def test_config_keys_are_validated_naming_the_key(key, value, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [f"{key}={value}"])
    assert load_config(None).canary.every == 50 and load_config(None).canary.tolerance is None


class ReferenceEngine:
    """An engine stand-in (protocol level): samples each canary request's tokens from the float64 reference of
    ``model`` and returns their logprobs plus ``offset``, stamped ``version``; the first ``older`` tokens of each
    sample are stamped ``version - 1`` and their logprobs are off by 0.5 (drawn before a publish)."""

    def __init__(self, model, version: int, offset: float = 0.0, older: int = 0):
        self.model, self.version, self.offset, self.older = model, version, offset, older
        self.requests = []

    def submit(self, request) -> concurrent.futures.Future:
        self.requests.append(request)
        rng = np.random.default_rng(request.sampling.seed)
        prompt, tokens, logprobs = np.asarray(request.prompt_token_ids), [], []
        for _ in range(request.sampling.max_new_tokens):
            logp = reference_logprobs(self.model, np.concatenate([prompt, tokens]).astype(np.int32))[-1]
            token = int(rng.choice(logp.size, p=np.exp(logp) / np.exp(logp).sum()))
            tokens.append(token)
            logprobs.append(logp[token] + self.offset + (0.5 if len(tokens) <= self.older else 0.0))
        versions = np.where(np.arange(len(tokens)) < self.older, self.version - 1, self.version)
        future = concurrent.futures.Future()
        future.set_result([Sample(request.request_id, 0, prompt, np.array(tokens, np.int32),
                                  np.array(logprobs, np.float32), versions,
                                  FinishReason.LENGTH, SamplingParams(), request.logprob_mode)])
        return future


def canary_of(model) -> PublishCanary:
    return PublishCanary("tether", "float32", 1, None, LogprobMode.PROCESSED, model.config.vocab_size,
                         CANARY_PROMPT_TOKENS + CANARY_NEW_TOKENS, learner_scorer(lambda: model),
                         lambda tree, is_source: tree)


def test_verify_passes_an_engine_serving_the_learners_weights(model):
    engine = ReferenceEngine(model, version=3)
    metrics = canary_of(model).verify(engine, policy_version=3, leader=True)
    assert metrics["canary/tokens"] == CANARY_PROMPTS * CANARY_NEW_TOKENS
    assert metrics["canary/max_abs_diff"] < 2e-5  # float32 learner vs float64 reference
    assert metrics["canary/mean_abs_diff"] <= metrics["canary/max_abs_diff"]
    assert metrics["perf/canary_s"] > 0
    request = engine.requests[0]  # never truncated or stopped: RAW = PROCESSED at temperature 1
    assert (request.sampling.temperature, request.sampling.top_k, request.sampling.top_p, request.sampling.min_p,
            request.sampling.stop_token_ids) == (1.0, 0, 1.0, 0.0, ())


@pytest.mark.parametrize("offset", [1e-3, -1e-3])
def test_verify_stops_on_a_difference_beyond_the_tolerance_naming_engine_version_and_difference(model, offset):
    with pytest.raises(CanaryMismatchError) as caught:
        canary_of(model).verify(ReferenceEngine(model, version=3, offset=offset), policy_version=3, leader=True)
    message = str(caught.value)
    assert "\n" not in message
    assert "the tether engine at policy version 3 serves other weights" in message
    assert "differ from the learner's by 0.001 on average (max 0.001; tolerance 0.0001 for float32" in message


def test_verify_scores_whole_samples_and_compares_only_the_tokens_of_the_published_version(model):
    metrics = canary_of(model).verify(ReferenceEngine(model, version=3, older=2), policy_version=3, leader=True)
    assert metrics["canary/tokens"] == CANARY_PROMPTS * (CANARY_NEW_TOKENS - 2)
    assert metrics["canary/max_abs_diff"] < 2e-5  # the later tokens scored after the earlier ones, in place
    with pytest.raises(CanaryMismatchError, match="no canary token of policy version 4"):
        canary_of(model).verify(ReferenceEngine(model, version=3), policy_version=4, leader=True)


class DroppingEngine:
    """An engine stand-in (protocol level) whose every sample the client dropped (a NaN-logprob server's)."""

    def submit(self, request) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        future.set_result([])
        return future

    def metrics(self) -> dict[str, float]:
        return {"samples/accepted": 0, "samples/dropped/non_finite_logprobs": CANARY_PROMPTS,
                "samples/dropped/bad_token_ids": 0}


def test_verify_names_the_drops_when_the_engine_returned_no_valid_sample(model):
    with pytest.raises(CanaryMismatchError) as caught:
        canary_of(model).verify(DroppingEngine(), policy_version=2, leader=True)
    assert str(caught.value) == (f"publish canary: the tether engine returned no valid canary sample at policy version "
                                 f"2: the client dropped every one ({{'samples/dropped/non_finite_logprobs': "
                                 f"{CANARY_PROMPTS}}}); it serves invalid samples")
