"""Checks each received sample so that no corrupt sample reaches a batch.

A sample with a problem is either dropped and counted (`on_invalid="drop"`) or
fails the call with `InvalidRolloutError` (`on_invalid="raise"`).
"""

import collections
import dataclasses
from typing import Literal

import numpy as np

from rollout_client.protocol import pb
from rollout_client.samples import RawSample

PROBLEMS = (
    "bad_byte_length",
    "length_mismatch",
    "bad_version_spans",
    "empty_completion",
    "non_finite_logprobs",
    "token_out_of_vocab",
    "bad_finish_reason",
    "version_below_floor",
)


@dataclasses.dataclass(frozen=True)
class ValidationConfig:
    """What counts as invalid and what to do about it."""

    on_invalid: Literal["drop", "raise"] = "drop"


def find_problem(raw: RawSample, vocab_size: int, version_floor: int | None) -> tuple[str, str] | None:
    """Returns (problem, detail) for the first problem found, or None.

    Args:
      raw: the received sample.
      vocab_size: token ids must lie in [0, vocab_size).
      version_floor: every token's policy version must be >= this, if set.
    """
    if raw.wire_problem is not None:
        return raw.wire_problem
    tokens, logprobs, spans = raw.token_ids, raw.logprobs, raw.version_spans
    if logprobs.size != tokens.size or raw.final.completion_tokens != tokens.size:
        return "length_mismatch", (f"{tokens.size} token ids, {logprobs.size} logprobs, "
                                   f"completion_tokens={raw.final.completion_tokens}")
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
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        return "token_out_of_vocab", f"token ids in [{tokens.min()}, {tokens.max()}], vocab_size={vocab_size}"
    if raw.final.finish_reason not in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_ABORT):
        return "bad_finish_reason", f"finish_reason={raw.final.finish_reason}"
    if version_floor is not None and min(version for _, _, version in spans) < version_floor:
        return "version_below_floor", f"versions {sorted({v for _, _, v in spans})} below floor {version_floor}"
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
