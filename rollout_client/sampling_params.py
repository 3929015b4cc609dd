"""Sampling parameters as the learner sees them, and their wire form.

Every field is optional: `None` means the server default, which the server
resolves and echoes back with every sample so the learner can replay it.
"""

import dataclasses
import enum
import math

import numpy as np

from rollout_client.protocol import pb


class LogprobMode(enum.IntEnum):
    """Which distribution the returned logprobs are of."""

    RAW = pb.LOGPROB_MODE_RAW  # log_softmax of the model's logits.
    PROCESSED = pb.LOGPROB_MODE_PROCESSED  # Of the sampling distribution.


class SamplerOrder(enum.IntEnum):
    """The orders of the sampler's steps that the learner replays exactly (the values are its per-row order codes).

    Ties at a cut: TEMPERATURE_FIRST keeps or drops tied tokens together; TEMPERATURE_LAST breaks them by token id
    as mlx-lm does on its CPU backend (its sorts order equal values by index).
    """

    TEMPERATURE_FIRST = 0  # temperature, then top-k, top-p, min-p, each on the renormalised result (Tether, SGLang)
    TEMPERATURE_LAST = 1  # top-p (whole vocabulary), min-p, top-k on the temperature-1 logprobs, then temperature

    @property
    def steps(self) -> tuple[str, ...]:
        """The steps in the order applied.

        >>> SamplerOrder.TEMPERATURE_LAST.steps
        ('top_p', 'min_p', 'top_k', 'temperature')
        """
        if self == SamplerOrder.TEMPERATURE_FIRST:
            return ("temperature", "top_k", "top_p", "min_p")
        return ("top_p", "min_p", "top_k", "temperature")


class FinishReason(enum.IntEnum):
    """Why a sample ended (values equal the wire enum)."""

    STOP = pb.FINISH_REASON_STOP
    LENGTH = pb.FINISH_REASON_LENGTH
    ABORT = pb.FINISH_REASON_ABORT


class PauseMode(enum.IntEnum):
    """What a pause does to active requests."""

    ABORT = pb.PAUSE_MODE_ABORT
    WAIT = pb.PAUSE_MODE_WAIT
    KEEP = pb.PAUSE_MODE_KEEP


class KvCache(enum.IntEnum):
    """What a KEEP pause does with its kept requests' KV cache when new weights load (partial rollouts)."""

    RECOMPUTE = pb.KV_CACHE_RECOMPUTE  # rebuilt under the new weights: the next tokens are drawn exactly by them.
    KEEP = pb.KV_CACHE_KEEP  # the old weights' keys and values stay: cheaper, the next tokens' policy approximate.


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters; Tether's server applies temperature, top-k, top-p, min-p in this order (other engines:
    `rollout_client.EngineCapabilities.sampler_order`).

    Attributes:
      temperature: divides the logits; > 0.
      top_k: keeps the k largest logits; None or 0 disables.
      top_p: keeps the smallest prefix (by probability) whose mass reaches top_p.
      min_p: keeps tokens whose probability is >= min_p times the largest.
      max_new_tokens: completion length limit; None means the server's limit.
      stop_token_ids: None means the server's eos ids; () means never stop.
      seed: sample i of a request is drawn with a key derived from (seed, i).
      stop_strings: texts that end a sample where the engine can detect them (SGLang, vLLM); others ignore them
        (the caller cuts at them itself: `learner.rl.episodes`).
    """

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    max_new_tokens: int | None = None
    stop_token_ids: tuple[int, ...] | None = None
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self):
        """Refuses values no sampler can honour; each error starts with the field's name.

        >>> SamplingParams(min_p=1.0)
        Traceback (most recent call last):
        ...
        ValueError: min_p=1.0: must be in [0, 1) (1 keeps only the most likely token: use top_k=1)
        """
        checks = {
            "temperature": (lambda v: math.isfinite(v) and v > 0, "must be a finite number > 0"),
            "top_k": (lambda v: v >= 0, "must be >= 0 (0: off)"),
            "top_p": (lambda v: 0 < v <= 1, "must be in (0, 1] (1: off)"),
            "min_p": (lambda v: 0 <= v < 1, "must be in [0, 1) (1 keeps only the most likely token: use top_k=1)"),
            "max_new_tokens": (lambda v: v >= 1, "must be >= 1"),
        }
        for name, (valid, requirement) in checks.items():
            value = getattr(self, name)
            if value is not None and not valid(value):
                raise ValueError(f"{name}={value!r}: {requirement}")

    def to_proto(self) -> pb.SamplingParams:
        """The wire message; unset fields stay unset."""
        message = pb.SamplingParams()
        for name in ("temperature", "top_k", "top_p", "min_p", "max_new_tokens", "seed"):
            value = getattr(self, name)
            if value is not None:
                setattr(message, name, value)
        if self.stop_token_ids is not None:
            message.stop_token_ids.token_ids.extend(self.stop_token_ids)
        message.stop_strings.extend(self.stop_strings)
        return message

    @classmethod
    def from_proto(cls, message: pb.SamplingParams) -> "SamplingParams":
        """Inverse of `to_proto`.

        >>> SamplingParams.from_proto(SamplingParams(top_k=5, stop_token_ids=()).to_proto())
        SamplingParams(temperature=None, top_k=5, top_p=None, min_p=None, max_new_tokens=None, stop_token_ids=(),
        seed=None, stop_strings=())
        """
        values = {
            name: getattr(message, name) if message.HasField(name) else None
            for name in ("temperature", "top_k", "top_p", "min_p", "max_new_tokens", "seed")
        }
        stop = tuple(message.stop_token_ids.token_ids) if message.HasField("stop_token_ids") else None
        return cls(stop_token_ids=stop, stop_strings=tuple(message.stop_strings), **values)


def derived_seed(seed: int, *path: int) -> int:
    """A 63-bit sampling seed for one part of a seeded whole (request ``path`` of a run, turn ``path`` of an
    episode): the same inputs give the same seed, other paths independent ones (`numpy.random.SeedSequence`).

    >>> derived_seed(0, 1, 2) == derived_seed(0, 1, 2) != derived_seed(0, 2, 1)
    True
    """
    return int(np.random.SeedSequence([seed, *path]).generate_state(1, np.uint64)[0] >> np.uint64(1))
