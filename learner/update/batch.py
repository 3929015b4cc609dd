"""The batch the update step trains on (`TrainBatch`): right-padded ``[B, T]`` arrays, aligned with the scored token.

Column ``t`` of every per-token field describes token ``tokens[:, t]``: ``rollout_logprobs[:, t]`` is the
logprob the server sampled it with, ``loss_mask[:, t]`` says whether it is trained on (completion tokens: 1;
prompt, padding and column 0: 0), and ``policy_version[:, t]`` is the policy version the server stamped on it.
This is the alignment of `learner.logprobs.chunked` (``logprobs[:, t] = log p(tokens[:, t] | tokens[:, :t])``).

``sampling`` holds each row's sampling parameters when the server returned PROCESSED logprobs
(`learner.update.logprob_mode.replay_params`): the update then replays that transform in every logprob pass, so its
ratios
are of the same distribution as the server's logprobs. None: RAW or temperature-only logprobs, computed at
`learner.update.UpdateConfig.temperature`.

``adapter`` says which LoRA adapter each row trains and is scored by when the model stacks several
(``model.lora.adapters``; `learner.model.lora.select_adapters`, `learner.update.adapter_loss`): an index into the
adapter names.
None: every row adapter 0 (the only one of a single-adapter or full fine-tuning run).
"""

from __future__ import annotations

import jax
from flax import struct

from learner.logprobs.sampler_replay import SamplerParams


@struct.dataclass
class TrainBatch:
    """One batch to train on (rollouts, or demonstrations in the warm-up); every field but ``sampling`` and
    ``adapter`` is ``[B, T]`` (host NumPy or device arrays)."""

    tokens: jax.Array  # int32 token ids, prompt then completion, right-padded.
    positions: jax.Array  # int32 RoPE positions, usually arange(T) per row.
    attention_mask: jax.Array  # bool / 0-1: real tokens (prompt and completion).
    loss_mask: jax.Array  # float32 0/1: tokens the loss trains on (sampled completion tokens).
    advantages: jax.Array  # float32 per-token advantages (a sequence's advantage broadcast over its tokens).
    rollout_logprobs: jax.Array  # float32 logprobs the inference server sampled each token with.
    policy_version: jax.Array  # int32 policy version that sampled each token (for staleness metrics).
    sampling: SamplerParams | None = None  # [B] per-row sampling parameters to replay (PROCESSED logprobs).
    adapter: jax.Array | None = None  # [B] int32 LoRA adapter of each row (several adapters); None: all 0.
