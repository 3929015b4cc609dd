"""Checks each received sample so that no corrupt sample reaches a batch.

A sample with a problem is either dropped and counted (`on_invalid="drop"`) or
fails the call with `InvalidRolloutError` (`on_invalid="raise"`). The checks hold the
sample to its request (`Expected`): the sampler settings it asked for, its length and
stop limits, and the learner's vocabulary, not only the server's.
"""

import collections
import dataclasses
import math
from typing import Literal

import numpy as np

from rollout_client.protocol import pb
from rollout_client.samples import RawSample
from rollout_client.sampling_params import SamplingParams

PROBLEMS = (
    "bad_byte_length",
    "length_mismatch",
    "bad_version_spans",
    "empty_completion",
    "non_finite_logprobs",
    "positive_logprobs",
    "logprobs_below_floor",
    "token_out_of_vocab",
    "bad_finish_reason",
    "aborted",
    "invalid_sampling",
    "sampling_mismatch",
    "too_long",
    "tokens_after_stop",
    "version_below_floor",
    "duplicate_sample_index",
    # Faults of a reply rather than a sample (rollout_client.client): the samples of the call are dropped.
    "missing_final",  # the stream ended without the sample's final message
    "unknown_sample_index",  # a final message for a sample the call did not ask for
    "message_too_large",  # a message over gRPC's size limit ended the call: its samples still missing are lost
)

# A logprob is <= 0; float32 log_softmax of a near-certain token can round a little above 0 (about 1e-7), never
# near 1e-3, while +1e-3 already means a probability > 1 that would bias every importance ratio built on it.
LOGPROB_TOLERANCE = 1e-3

_ECHOED_FIELDS = ("temperature", "top_k", "top_p", "min_p", "max_new_tokens", "seed")


@dataclasses.dataclass(frozen=True)
class ValidationConfig:
    """What counts as invalid and what to do about it.

    Attributes:
      on_invalid: drop and count an invalid sample, or fail the call.
      vocab_size: the learner's vocabulary; token ids must lie below it (and below the server's). None: the
        server's only.
      min_logprob: logprobs below this are refused: no kept token of a real sampler is that unlikely, and a
        logprob of -1e30 or -3e38 overflows the learner's importance ratios.
    """

    on_invalid: Literal["drop", "raise"] = "drop"
    vocab_size: int | None = None
    min_logprob: float = -1e4

    def __post_init__(self):
        """Each error starts with the field's name.

        >>> ValidationConfig(vocab_size=0)
        Traceback (most recent call last):
        ...
        ValueError: vocab_size=0: must be >= 1
        """
        if self.on_invalid not in ("drop", "raise"):
            raise ValueError(f"on_invalid={self.on_invalid!r}: must be 'drop' or 'raise'")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"vocab_size={self.vocab_size!r}: must be >= 1")
        if not (math.isfinite(self.min_logprob) and self.min_logprob < 0):
            raise ValueError(f"min_logprob={self.min_logprob!r}: must be a finite number < 0")


@dataclasses.dataclass(frozen=True)
class Expected:
    """What every sample of one request must satisfy.

    Attributes:
      sampling: the request's sampling parameters as sent; each field it sets must be echoed unchanged.
      vocab_size: token ids must lie in [0, vocab_size) (the smaller of the server's and the learner's).
      version_floor: every token's policy version must be >= this, if set.
      min_logprob: logprobs must be >= this.
      abort_requested: the client asked for this request to be aborted, so an ABORT finish is expected.
    """

    sampling: pb.SamplingParams
    vocab_size: int
    version_floor: int | None = None
    min_logprob: float = ValidationConfig.min_logprob
    abort_requested: bool = False


def find_problem(raw: RawSample, expected: Expected) -> tuple[str, str] | None:
    """Returns (problem, detail) for the first problem found, or None."""
    if raw.wire_problem is not None:
        return raw.wire_problem
    tokens, logprobs, spans, final = raw.token_ids, raw.logprobs, raw.version_spans, raw.final
    if logprobs.size != tokens.size or final.completion_tokens != tokens.size:
        return "length_mismatch", (f"{tokens.size} token ids, {logprobs.size} logprobs, "
                                   f"completion_tokens={final.completion_tokens}")
    if tokens.size == 0:
        return "empty_completion", "no completion tokens"
    covered = 0
    for start, end, _ in spans:
        if start != covered or end <= start:
            break
        covered = end
    if covered != tokens.size:
        return "bad_version_spans", f"spans {spans} do not tile [0, {tokens.size})"
    if not np.isfinite(logprobs).all():
        return "non_finite_logprobs", f"{int((~np.isfinite(logprobs)).sum())} non-finite logprobs"
    if logprobs.max() > LOGPROB_TOLERANCE:
        return "positive_logprobs", f"largest logprob {logprobs.max()} > {LOGPROB_TOLERANCE}"
    if logprobs.min() < expected.min_logprob:
        return "logprobs_below_floor", f"smallest logprob {logprobs.min()} < min_logprob={expected.min_logprob}"
    if tokens.min() < 0 or tokens.max() >= expected.vocab_size:
        return "token_out_of_vocab", f"token ids in [{tokens.min()}, {tokens.max()}], vocab_size={expected.vocab_size}"
    if final.finish_reason not in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_ABORT):
        return "bad_finish_reason", f"finish_reason={final.finish_reason}"
    if final.finish_reason == pb.FINISH_REASON_ABORT and not expected.abort_requested:
        return "aborted", "finished with ABORT, which this client did not ask for"
    try:
        echoed = SamplingParams.from_proto(final.sampling)
    except ValueError as error:
        return "invalid_sampling", f"echoed sampling: {error}"
    mismatch = _echo_mismatch(expected.sampling, final.sampling)
    if mismatch is not None:
        return "sampling_mismatch", mismatch
    if echoed.max_new_tokens is not None and tokens.size > echoed.max_new_tokens:
        return "too_long", f"{tokens.size} tokens, max_new_tokens={echoed.max_new_tokens}"
    stops = np.isin(tokens[:-1], echoed.stop_token_ids or ())
    if stops.any():
        return "tokens_after_stop", (f"stop token {tokens[np.argmax(stops)]} at position {np.argmax(stops)} of "
                                     f"{tokens.size}")
    if expected.version_floor is not None and min(version for _, _, version in spans) < expected.version_floor:
        return "version_below_floor", (f"versions {sorted({v for _, _, v in spans})} below floor "
                                       f"{expected.version_floor}")
    return None


def _echo_mismatch(asked: pb.SamplingParams, echoed: pb.SamplingParams) -> str | None:
    """Which field the request set that the echo does not repeat exactly, or None.

    Both sides are wire values (float32), so an honest echo is bit-identical; fields the request left unset are
    the server's to resolve. max_new_tokens may come back smaller: the server caps it at the context left.
    """
    for name in _ECHOED_FIELDS:
        if not asked.HasField(name):
            continue
        differs = getattr(echoed, name) > asked.max_new_tokens if name == "max_new_tokens" else (
            getattr(echoed, name) != getattr(asked, name))
        if not echoed.HasField(name) or differs:
            shown = getattr(echoed, name) if echoed.HasField(name) else "unset"
            return f"{name}: asked {getattr(asked, name)}, echoed {shown}"
    if asked.HasField("stop_token_ids") and (not echoed.HasField("stop_token_ids") or list(
            echoed.stop_token_ids.token_ids) != list(asked.stop_token_ids.token_ids)):
        shown = list(echoed.stop_token_ids.token_ids) if echoed.HasField("stop_token_ids") else "unset"
        return f"stop_token_ids: asked {list(asked.stop_token_ids.token_ids)}, echoed {shown}"
    return None


class ValidationCounters:
    """Counts accepted and dropped samples, by problem."""

    def __init__(self):
        self.accepted = 0
        self.dropped: collections.Counter[str] = collections.Counter()

    def as_dict(self) -> dict[str, int]:
        """Flat metrics: ``samples/accepted`` and ``samples/dropped/<problem>``."""
        return {"samples/accepted": self.accepted,
                **{f"samples/dropped/{problem}": self.dropped[problem] for problem in PROBLEMS}}
