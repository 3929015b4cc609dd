"""Token logprobs: chunked over tokens (never [B, T, V] in float32), the sampler's transforms and their replay.

`learner.logprobs` re-exports `learner.logprobs.chunked`; `sampling_transform`, `sampler_replay`,
`truncation_bias` and `completions` (the log-likelihood of given completions) are imported by name.
"""

from learner.logprobs.chunked import logprobs_from_hidden
from learner.logprobs.chunked import map_token_chunks
from learner.logprobs.chunked import scored_window_first
from learner.logprobs.chunked import token_logprobs

__all__ = [
    "logprobs_from_hidden",
    "map_token_chunks",
    "scored_window_first",
    "token_logprobs",
]
