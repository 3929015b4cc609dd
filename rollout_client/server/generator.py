"""The pluggable generation engine behind the reference server.

A `Generator` advances a batch of sequences; everything else (queueing, batching
of concurrent requests, stop and length rules, pause / resume, policy-version
stamping, streaming) is the `Scheduler`'s, which asks the generator to rebuild
kept sequences' caches after a weight update (`Generator.recompute_cache`). The model generator, the benchmark's
precomputed stream and the tests' scripted engines all implement this interface.
"""

import abc
import dataclasses
from collections.abc import Mapping

import numpy as np

from rollout_client.protocol import pb
from rollout_client.sampling_params import FinishReason, LogprobMode
from rollout_client.server.weights_io import WeightReaders, read_safetensors

# Parameter path -> (shape, dtype): the weights an engine accepts.
WeightSpec = Mapping[str, tuple[tuple[int, ...], np.dtype]]


class PreconditionError(Exception):
    """The server is not in a state that allows the call (FAILED_PRECONDITION)."""


@dataclasses.dataclass(frozen=True)
class ResolvedSampling:
    """Sampling parameters with every default filled in; echoed to the client."""

    temperature: float
    top_k: int  # 0 disables.
    top_p: float
    min_p: float
    max_new_tokens: int  # Already clipped to the server's context.
    stop_token_ids: tuple[int, ...]
    seed: int

    def to_proto(self) -> pb.SamplingParams:
        """The wire message with every field set."""
        message = pb.SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            max_new_tokens=self.max_new_tokens,
            seed=self.seed,
        )
        message.stop_token_ids.token_ids.extend(self.stop_token_ids)
        return message


@dataclasses.dataclass(frozen=True)
class SequenceSpec:
    """One sample to generate."""

    prompt_token_ids: np.ndarray  # int32 [P], P >= 1.
    sampling: ResolvedSampling
    sample_index: int
    logprob_mode: LogprobMode


@dataclasses.dataclass(frozen=True)
class SequenceOutput:
    """What the scheduler delivers for a sequence: a chunk, or the final piece.

    Version spans are (start, end, policy_version) over the whole completion; the
    final piece lists all of them, a chunk those that overlap its tokens.
    """

    token_ids: np.ndarray
    logprobs: np.ndarray
    version_spans: tuple[tuple[int, int, int], ...]
    finish_reason: FinishReason | None = None  # None for a chunk.
    prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_s: float = 0.0
    generate_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class GeneratorInfo:
    """What the server reports about the model."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    model_config_hash: str
    dtype: str
    max_seq_len: int
    max_batch_size: int


class Generator(abc.ABC):
    """Advances sequences; called from the scheduler's thread only, never concurrently."""

    @property
    @abc.abstractmethod
    def info(self) -> GeneratorInfo:
        """Static facts about the served model."""

    @abc.abstractmethod
    def add(self, sequence_id: int, spec: SequenceSpec) -> None:
        """Admits a sequence; at most `info.max_batch_size` are active at once."""

    @abc.abstractmethod
    def remove(self, sequence_id: int) -> None:
        """Frees a finished or aborted sequence."""

    @abc.abstractmethod
    def step(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Advances every active sequence by one or more tokens.

        Returns:
          For each active sequence, its new token ids (int32) and their logprobs
          (float32) in the sequence's logprob mode. The scheduler truncates at stop
          tokens and length limits, so a generator may overshoot.
        """

    def recompute_cache(self) -> None:  # noqa: B027
        """Rebuilds every active sequence's cached state (its KV cache) from its tokens under the current weights,
        so that a sequence kept across a weight update decodes on exactly as a fresh request with the same tokens
        would (partial rollouts). Called after `load_weights`, before the next `step`. Nothing by default: right for
        an engine that caches nothing computed by the weights."""

    @property
    @abc.abstractmethod
    def weight_spec(self) -> WeightSpec:
        """Name -> (shape, dtype) of the weights `load_weights` accepts; StreamWeights takes no more bytes."""

    @property
    def compiled_programs(self) -> int:
        """Programs the engine has built so far (reported by GetServerInfo); 0: it does not count."""
        return 0

    @property
    def weight_readers(self) -> WeightReaders:
        """The on-disk formats ``UpdateWeights(path)`` accepts for this engine, and how each is read."""
        return {pb.WEIGHTS_FORMAT_SAFETENSORS: read_safetensors}

    @abc.abstractmethod
    def load_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        """Replaces the weights, all or nothing. The arrays may be views of a file that the client rewrites once
        this returns (`rollout_client.server.weights_io.read_safetensors`): copy what you keep.

        Raises:
          ValueError: naming the first tensor whose name, shape or dtype is wrong;
            the old weights keep serving.
        """


def check_weights_match(expected: WeightSpec,
                        weights: Mapping[str, np.ndarray]) -> None:
    """Raises ValueError unless `weights` has exactly the expected names, shapes and dtypes.

    >>> check_weights_match({"w": ((2,), np.dtype("float32"))}, {"w": np.zeros(3, np.float32)})
    Traceback (most recent call last):
    ...
    ValueError: weights['w']: shape (3,) != expected (2,)
    """
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise ValueError(f"weights: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, array in weights.items():
        check_tensor_layout(expected, name, array.shape, array.dtype)


def check_tensor_layout(expected: WeightSpec, name: str,
                        shape: tuple[int, ...], dtype: np.dtype) -> None:
    """Raises ValueError unless `expected` has a tensor `name` of this shape and dtype."""
    if name not in expected:
        raise ValueError(f"weights: unexpected {name!r}")
    expected_shape, expected_dtype = expected[name]
    if tuple(shape) != tuple(expected_shape):
        raise ValueError(f"weights[{name!r}]: shape {tuple(shape)} != expected {tuple(expected_shape)}")
    if np.dtype(dtype) != np.dtype(expected_dtype):
        raise ValueError(f"weights[{name!r}]: dtype {np.dtype(dtype)} != expected {np.dtype(expected_dtype)}")


def spec_bytes(spec: WeightSpec) -> int:
    """The bytes of weights that match `spec`.

    >>> spec_bytes({"w": ((2, 3), np.dtype("float32")), "b": ((), np.dtype("bfloat16"))})
    26
    """
    return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in spec.values())
