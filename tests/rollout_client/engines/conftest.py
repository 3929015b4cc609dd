"""The real MLX engine on 127.0.0.1, serving a tiny Tether model exported with the digit tasks' tokenizer.

One engine per test module (starting one costs a few seconds); `MlxHarness` knows which learner weights it serves, so
tests compare the engine's logprobs with the learner's own for exactly those weights.
"""

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from learner.checkpoints.hf_checkpoint import write_hf_checkpoint
from learner.logprobs.chunked import token_logprobs
from learner.model.param_paths import named_leaves
from learner.model.transformer import Transformer, model_config
from learner.tasks import CharTokenizer
from rollout_client import ClientConfig, MlxEngine, ValidationConfig

# The tiny model with a context long enough that a sample can still be streaming when the abort test aborts it.
MODEL_CONFIG = model_config("tiny", max_seq_len=2048)
EOS_ID = CharTokenizer.eos_id


def make_model(seed: int) -> Transformer:
    return Transformer(MODEL_CONFIG, rngs=nnx.Rngs(seed))


def host_weights(model: Transformer) -> dict[str, np.ndarray]:
    """The learner's weights as the trainer publishes them (`Trainer.host_weights`: parameter path -> array)."""
    return {path: np.asarray(leaf) for path, leaf in named_leaves(nnx.state(model, nnx.Param)).items()}


def checkpoint_writer():
    """What `learner.rl.rollout_engines` hands the MLX engine: an atomic HF checkpoint with the task's tokenizer."""
    return functools.partial(write_hf_checkpoint, config=MODEL_CONFIG, tokenizer=CharTokenizer(),
                             eos_token_ids=(EOS_ID,), overwrite=True)


def start_engine(tmp_path, model: Transformer, version: int = 0, **kwargs) -> MlxEngine:
    config = ClientConfig("127.0.0.1:0", ready_timeout_s=180.0,
                          validation=ValidationConfig(vocab_size=MODEL_CONFIG.vocab_size))
    return MlxEngine(config, checkpoint_writer(), tmp_path / "weights", version, host_weights(model),
                     log_path=tmp_path / "engine.log", **kwargs)


@functools.partial(nnx.jit, static_argnames="length")
def _padded_logits_and_logprobs(model: Transformer, tokens, temperature, length: int):
    positions = jnp.arange(length, dtype=jnp.int32)[None]
    mask = jnp.arange(length)[None] < jnp.count_nonzero(tokens >= 0)
    tokens = jnp.maximum(tokens, 0)
    logprobs = token_logprobs(model, tokens, positions, mask, temperature=temperature)
    return model.logits(model(tokens, positions, mask)), logprobs


def _learner_outputs(model: Transformer, prompt, completion, temperature: float = 1.0):
    """The learner's logits before, and logprobs of, each completion token; padded to 64 or 2048 tokens (one compile
    each)."""
    tokens = np.concatenate([np.asarray(prompt), np.asarray(completion)]).astype(np.int32)
    length = 64 if tokens.size <= 64 else MODEL_CONFIG.max_seq_len
    padded = np.full((1, length), -1, np.int32)
    padded[0, :tokens.size] = tokens
    logits, logprobs = _padded_logits_and_logprobs(model, jnp.asarray(padded), jnp.float32(temperature), length)
    start, end = len(prompt), tokens.size
    return np.asarray(logits)[0, start - 1:end - 1], np.asarray(logprobs)[0, start:end]


def learner_logprobs(model: Transformer, prompt, completion, temperature: float = 1.0) -> np.ndarray:
    """float32 [C]: the learner's logprobs of ``completion`` after ``prompt`` (`learner.logprobs.token_logprobs`)."""
    return _learner_outputs(model, prompt, completion, temperature)[1]


def learner_logits(model: Transformer, prompt, completion) -> np.ndarray:
    """float32 [C, V]: the logits the learner's model gives before each completion token."""
    return _learner_outputs(model, prompt, completion)[0]


@dataclasses.dataclass
class MlxHarness:
    """The module's engine and the learner model whose weights it serves now."""

    engine: MlxEngine
    model: Transformer


@pytest.fixture(scope="module")
def mlx(tmp_path_factory):
    model = make_model(seed=0)
    engine = start_engine(tmp_path_factory.mktemp("mlx"), model)
    yield MlxHarness(engine, model)
    engine.close()
