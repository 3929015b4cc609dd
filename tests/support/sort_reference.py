"""The full-sort references of the sampler tests, jitted: eagerly, every op of the bitonic network compiles on its own
for each new vocabulary."""

import jax

from learner.logprobs.sampling_transform import descending, kept_threshold

descending_jitted = jax.jit(descending)


@jax.jit
def full_sort_cut(scaled, log_normalizer, top_k, top_p, min_p):
    """`kept_threshold` of the whole vocabulary in descending order (the full-sort path)."""
    return kept_threshold(descending(scaled), log_normalizer, top_k, top_p, min_p)
