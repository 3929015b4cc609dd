"""Samples -> one right-padded batch of numpy arrays for the learner."""

import dataclasses
from collections.abc import Sequence

import numpy as np

from rollout_client.samples import Sample
from rollout_client.sampling_params import LogprobMode


@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    """B sequences of T positions; every per-token array is aligned to `tokens`.

    Position t of a row holds token t of prompt+completion; `rollout_logprobs[b, t]`
    is the log-probability the server gave `tokens[b, t]` after `tokens[b, :t]`.
    The learner's own logprobs for the same tokens come from logits at t - 1.

    Attributes:
      tokens: int32 [B, T], padded with `pad_token_id`.
      loss_mask: float32 [B, T], 1 on completion tokens the policy sampled, 0 on prompt, padding and a sample's
        masked tokens (`Sample.completion_mask`).
      rollout_logprobs: float32 [B, T], 0 where loss_mask is 0.
      policy_versions: int32 [B, T], -1 where loss_mask is 0.
      prompt_lengths: int32 [B].
      completion_lengths: int32 [B].
      finish_reasons: int32 [B], `FinishReason` values.
      temperature, top_p, min_p: float32 [B], as the server resolved them.
      top_k: int32 [B], 0 when disabled.
      logprob_mode: the mode of every sample in the batch.
      request_ids: per row, the request it came from (groups share one).
      sample_indices: int32 [B].
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    rollout_logprobs: np.ndarray
    policy_versions: np.ndarray
    prompt_lengths: np.ndarray
    completion_lengths: np.ndarray
    finish_reasons: np.ndarray
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    logprob_mode: LogprobMode
    request_ids: tuple[str, ...]
    sample_indices: np.ndarray


def collate(samples: Sequence[Sample], pad_to_multiple: int = 64, pad_token_id: int = 0) -> RolloutBatch:
    """Pads samples to a common length, a multiple of `pad_to_multiple` (few compiled shapes).

    Raises:
      ValueError: no samples, or samples of different logprob modes.
    """
    if not samples:
        raise ValueError("samples: cannot collate an empty list")
    modes = {sample.logprob_mode for sample in samples}
    if len(modes) != 1:
        raise ValueError(f"samples: mixed logprob modes {sorted(m.name for m in modes)}")
    prompt_lengths = np.array([s.prompt_token_ids.size for s in samples], np.int32)
    completion_lengths = np.array([s.completion_token_ids.size for s in samples], np.int32)
    longest = int((prompt_lengths + completion_lengths).max())
    length = -(-longest // pad_to_multiple) * pad_to_multiple
    shape = (len(samples), length)
    tokens = np.full(shape, pad_token_id, np.int32)
    loss_mask = np.zeros(shape, np.float32)
    logprobs = np.zeros(shape, np.float32)
    versions = np.full(shape, -1, np.int32)
    for row, (sample, start) in enumerate(zip(samples, prompt_lengths)):
        end = start + sample.completion_token_ids.size
        tokens[row, :start] = sample.prompt_token_ids
        tokens[row, start:end] = sample.completion_token_ids
        policy = 1.0 if sample.completion_mask is None else sample.completion_mask
        loss_mask[row, start:end] = policy
        logprobs[row, start:end] = np.where(policy != 0, sample.logprobs, 0.0)
        versions[row, start:end] = np.where(policy != 0, sample.policy_versions, -1)
    return RolloutBatch(
        tokens=tokens,
        loss_mask=loss_mask,
        rollout_logprobs=logprobs,
        policy_versions=versions,
        prompt_lengths=prompt_lengths,
        completion_lengths=completion_lengths,
        finish_reasons=np.array([s.finish_reason for s in samples], np.int32),
        temperature=np.array([s.sampling.temperature for s in samples], np.float32),
        top_k=np.array([s.sampling.top_k or 0 for s in samples], np.int32),
        top_p=np.array([s.sampling.top_p for s in samples], np.float32),
        min_p=np.array([s.sampling.min_p for s in samples], np.float32),
        logprob_mode=modes.pop(),
        request_ids=tuple(s.request_id for s in samples),
        sample_indices=np.array([s.sample_index for s in samples], np.int32),
    )
