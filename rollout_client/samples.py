"""Samples as numpy arrays, assembled from a Generate stream.

A sample's messages (chunks, then one final) are collected by sample index; the
final message turns them into a `Sample` after `validation.find_problem` found
nothing wrong.
"""

import dataclasses

import numpy as np

from rollout_client.protocol import pb
from rollout_client.sampling_params import FinishReason
from rollout_client.sampling_params import LogprobMode
from rollout_client.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class Sample:
    """One completion with what the learner needs to train on it off-policy.

    Attributes:
      request_id: the request it answers.
      sample_index: its index within the request.
      prompt_token_ids: int32 [P].
      completion_token_ids: int32 [C], C >= 1.
      logprobs: float32 [C]; logprobs[i] is of completion_token_ids[i], in `logprob_mode`.
      policy_versions: int64 [C], the policy version that sampled each token.
      finish_reason: why it ended.
      sampling: the parameters the server resolved and used.
      logprob_mode: which distribution `logprobs` is of.
      queue_s: server-side wait before generation began.
      generate_s: server-side generation time.
    """

    request_id: str
    sample_index: int
    prompt_token_ids: np.ndarray
    completion_token_ids: np.ndarray
    logprobs: np.ndarray
    policy_versions: np.ndarray
    finish_reason: FinishReason
    sampling: SamplingParams
    logprob_mode: LogprobMode
    queue_s: float = 0.0
    generate_s: float = 0.0

    @property
    def oldest_version(self) -> int:
        """The lowest policy version among its tokens."""
        return int(self.policy_versions.min())


@dataclasses.dataclass
class RawSample:
    """A sample's fields as received, before validation."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    version_spans: list[tuple[int, int, int]]
    final: pb.SampleResult


class StreamAssembler:
    """Collects chunk and final messages per sample index."""

    def __init__(self):
        self._tokens: dict[int, list[np.ndarray]] = {}
        self._logprobs: dict[int, list[np.ndarray]] = {}

    def add(self, response: pb.GenerateResponse) -> RawSample | None:
        """Takes one message; returns the raw sample when it was the sample's final one."""
        index = response.sample_index
        part = response.chunk if response.HasField("chunk") else response.final
        tokens = np.array(part.token_ids, np.int32)
        logprobs = np.array(part.logprobs, np.float32)
        if response.HasField("chunk"):
            self._tokens.setdefault(index, []).append(tokens)
            self._logprobs.setdefault(index, []).append(logprobs)
            return None
        if index in self._tokens:
            tokens = np.concatenate(self._tokens.pop(index) + [tokens])
            logprobs = np.concatenate(self._logprobs.pop(index) + [logprobs])
        spans = [(span.start, span.end, span.policy_version) for span in part.version_spans]
        return RawSample(token_ids=tokens, logprobs=logprobs, version_spans=spans, final=part)


def versions_per_token(spans: list[tuple[int, int, int]], length: int) -> np.ndarray:
    """Expands version spans into one version per token.

    >>> versions_per_token([(0, 2, 3), (2, 5, 4)], 5).tolist()
    [3, 3, 4, 4, 4]
    """
    versions = np.empty(length, np.int64)
    for start, end, version in spans:
        versions[start:end] = version
    return versions


def build_sample(raw: RawSample, request_id: str, sample_index: int, prompt_token_ids: np.ndarray,
                 logprob_mode: LogprobMode) -> Sample:
    """The validated raw sample as a `Sample`."""
    return Sample(
        request_id=request_id,
        sample_index=sample_index,
        prompt_token_ids=prompt_token_ids,
        completion_token_ids=raw.token_ids,
        logprobs=raw.logprobs,
        policy_versions=versions_per_token(raw.version_spans, raw.token_ids.size),
        finish_reason=FinishReason(raw.final.finish_reason),
        sampling=SamplingParams.from_proto(raw.final.sampling),
        logprob_mode=logprob_mode,
        queue_s=raw.final.timings.queue_s,
        generate_s=raw.final.timings.generate_s,
    )
