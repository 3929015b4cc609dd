"""A generator that replays a precomputed token stream instead of running a model.

It stands in for the model where only the transport matters: the transport
benchmark (whole 1024-token samples in one step) and protocol tests (one token per
step with a delay, so that pauses and aborts land mid-generation). Its single
"weight", `logprob_scale`, multiplies the returned logprobs, which makes weight
updates observable.
"""

import time
from collections.abc import Mapping

import numpy as np

from rollout_client.server.generator import Generator, GeneratorInfo, SequenceSpec, WeightSpec, check_weights_match

_WEIGHT_SPEC = {"logprob_scale": ((), np.dtype("float32"))}


class ScriptedGenerator(Generator):
    """Sample i of a request gets the precomputed stream rotated by a seed-dependent offset.

    Args:
      vocab_size: tokens are drawn from [2, vocab_size); ids 0 and 1 are left free
        to serve as stop tokens.
      tokens_per_step: tokens each step returns per sequence.
      step_delay_s: time each step sleeps, standing in for the model.
      max_seq_len: the context limit reported to clients.
      max_batch_size: how many sequences are active at once.
      eos_token_ids: default stop tokens.
    """

    def __init__(self, vocab_size: int = 1024, tokens_per_step: int = 1, step_delay_s: float = 0.0,
                 max_seq_len: int = 4096, max_batch_size: int = 64, eos_token_ids: tuple[int, ...] = (1,)):
        rng = np.random.default_rng(0)
        self._stream_tokens = rng.integers(2, vocab_size, size=2 * max_seq_len, dtype=np.int32)
        self._stream_logprobs = -rng.exponential(size=2 * max_seq_len).astype(np.float32)
        self._tokens_per_step = tokens_per_step
        self._step_delay_s = step_delay_s
        self._scale = np.float32(1.0)
        self._positions: dict[int, int] = {}
        self._info = GeneratorInfo(
            vocab_size=vocab_size,
            eos_token_ids=tuple(eos_token_ids),
            model_config_hash="scripted",
            dtype="float32",
            max_seq_len=max_seq_len,
            max_batch_size=max_batch_size,
        )

    @property
    def info(self) -> GeneratorInfo:
        return self._info

    def add(self, sequence_id: int, spec: SequenceSpec) -> None:
        offset = (spec.sampling.seed * 7919 + spec.sample_index * 104_729) % self._info.max_seq_len
        self._positions[sequence_id] = offset

    def remove(self, sequence_id: int) -> None:
        self._positions.pop(sequence_id, None)

    def step(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        if self._step_delay_s:
            time.sleep(self._step_delay_s)
        outputs = {}
        for sequence_id, position in self._positions.items():
            end = position + self._tokens_per_step
            logprobs = self._stream_logprobs[position:end]
            outputs[sequence_id] = (self._stream_tokens[position:end],
                                    logprobs if self._scale == 1 else logprobs * self._scale)
            self._positions[sequence_id] = end % self._info.max_seq_len
        return outputs

    @property
    def weight_spec(self) -> WeightSpec:
        return _WEIGHT_SPEC

    def load_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        check_weights_match(_WEIGHT_SPEC, weights)
        self._scale = np.float32(weights["logprob_scale"])
