"""Samples as numpy arrays, assembled from a Generate stream.

A sample's messages (chunks, then one final) are collected by sample index; the
final message turns them into a `Sample` after `validation.find_problem` found
nothing wrong. Token ids and logprobs are unpacked from the messages' bytes without
copying when the sample came in one message, so a `Sample`'s arrays are read-only.
"""

import dataclasses

import numpy as np

from rollout_client.packed_arrays import BYTES_PER_TOKEN, LOGPROB_DTYPE, TOKEN_ID_DTYPE
from rollout_client.protocol import pb
from rollout_client.sampling_params import FinishReason, LogprobMode, SamplingParams


@dataclasses.dataclass(frozen=True)
class Sample:
    """One completion with what the learner needs to train on it off-policy.

    Attributes:
      request_id: the request it answers.
      sample_index: its index within the request.
      prompt_token_ids: int32 [P].
      completion_token_ids: int32 [C], C >= 1 (read-only).
      logprobs: float32 [C] (read-only); logprobs[i] is of completion_token_ids[i], in `logprob_mode`.
      policy_versions: int64 [C], the policy version that sampled each token.
      finish_reason: why it ended.
      sampling: the parameters the server resolved and used.
      logprob_mode: which distribution `logprobs` is of.
      queue_s: server-side wait before generation began.
      generate_s: server-side generation time.
      completion_mask: float32 [C] or None; 1 on the tokens the policy sampled, 0 on tokens it did not (a
        multi-turn episode's observations); None: every completion token is the policy's. Masked tokens
        carry logprob 0 and the policy version of the policy token before them, so versions' min and max are the
        policy tokens' alone.
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
    completion_mask: np.ndarray | None = None

    @property
    def oldest_version(self) -> int:
        """The lowest policy version among its tokens."""
        return int(self.policy_versions.min())


@dataclasses.dataclass
class RawSample:
    """A sample's fields as received, before validation.

    `wire_problem` is (problem, detail) when the messages could not be decoded
    (then the arrays are empty); `validation.find_problem` reports it first.
    """

    token_ids: np.ndarray
    logprobs: np.ndarray
    version_spans: list[tuple[int, int, int]]
    final: pb.SampleResult
    wire_problem: tuple[str, str] | None = None


class StreamAssembler:
    """Collects chunk and final messages per sample index."""

    def __init__(self):
        self._chunks: dict[int, list[pb.SampleChunk]] = {}

    def add(self, response: pb.GenerateResponse) -> RawSample | None:
        """Takes one message; returns the raw sample when it was the sample's final one."""
        if response.WhichOneof("payload") == "chunk":
            self._chunks.setdefault(response.sample_index, []).append(response.chunk)
            return None
        final = response.final
        parts = self._chunks.pop(response.sample_index, []) + [final]
        spans = [(span.start, span.end, span.policy_version) for span in final.version_spans]
        token_bytes = [part.token_ids for part in parts]
        logprob_bytes = [part.logprobs for part in parts]
        problem = _byte_length_problem(token_bytes, logprob_bytes)
        if problem is not None:
            return RawSample(token_ids=np.zeros(0, TOKEN_ID_DTYPE), logprobs=np.zeros(0, LOGPROB_DTYPE),
                             version_spans=spans, final=final, wire_problem=problem)
        return RawSample(token_ids=np.frombuffer(b"".join(token_bytes), TOKEN_ID_DTYPE),
                         logprobs=np.frombuffer(b"".join(logprob_bytes), LOGPROB_DTYPE), version_spans=spans,
                         final=final)


def _byte_length_problem(token_bytes: list[bytes], logprob_bytes: list[bytes]) -> tuple[str, str] | None:
    """(problem, detail) for the first message with a bad byte length or unequal counts, else None.

    Checked per message, so that a short chunk cannot shift the tokens of the next one.
    """
    for index, (tokens, logprobs) in enumerate(zip(token_bytes, logprob_bytes)):
        if len(tokens) % BYTES_PER_TOKEN or len(logprobs) % BYTES_PER_TOKEN:
            return "bad_byte_length", (f"message {index}: token_ids has {len(tokens)} bytes, logprobs "
                                       f"{len(logprobs)}; both must be multiples of {BYTES_PER_TOKEN}")
        if len(tokens) != len(logprobs):
            return "length_mismatch", (f"message {index}: {len(tokens) // BYTES_PER_TOKEN} token ids, "
                                       f"{len(logprobs) // BYTES_PER_TOKEN} logprobs")
    return None


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
