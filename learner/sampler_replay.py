"""The learner's replay of the server's sampling transform on one chunk of logits.

With PROCESSED logprobs the server reports log-probabilities of its sampling distribution (temperature, top-k,
top-p, min-p, renormalised). The learner's logprobs must be of the same distribution, replayed per sequence from
the parameters recorded with each rollout, or every importance ratio is biased by the log of the kept mass.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from learner.sampling_transform import descending
from learner.sampling_transform import kept_threshold
from learner.sampling_transform import top_candidates


class SamplerParams(NamedTuple):
    """Per-sequence sampling parameters, ``[B]`` arrays (a pytree: pass it through `jax.jit`).

    Attributes:
      temperature: float32, > 0.
      top_k: int32, 0 = off.
      top_p: float32, 1 = off.
      min_p: float32, 0 = off.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array

    @classmethod
    def from_batch(cls, batch) -> "SamplerParams":
        """The parameters a `rollout_client.RolloutBatch` echoes (any object with the four ``[B]`` fields)."""
        return cls(temperature=jnp.asarray(batch.temperature, jnp.float32), top_k=jnp.asarray(batch.top_k, jnp.int32),
                   top_p=jnp.asarray(batch.top_p, jnp.float32), min_p=jnp.asarray(batch.min_p, jnp.float32))

    def pad_rows(self, rows: int) -> "SamplerParams":
        """Host NumPy copy padded to ``rows`` rows with neutral ones: temperature 1, no truncation.

        Padding rows are fully masked, but their logprobs are still computed (and differentiated): a temperature
        of 0 there would put NaN into the gradient.

        >>> SamplerParams(np.array([0.7]), np.array([5]), np.array([0.9]), np.array([0.05])).pad_rows(2).top_k
        array([5, 0])
        """
        return SamplerParams(*(np.pad(np.asarray(x), (0, rows - np.shape(x)[0]), constant_values=neutral)
                               for x, neutral in zip(self, NEUTRAL)))


NEUTRAL = SamplerParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)  # plain softmax: replays no transform.


def truncates(top_k, top_p, min_p) -> bool:
    """Whether any row (scalars or ``[B]`` arrays) samples from a truncated distribution: top-k, top-p or min-p on.

    >>> truncates(0, 1.0, 0.0), truncates(np.array([0, 5]), np.array([1.0, 1.0]), np.array([0.0, 0.0]))
    (False, True)
    """
    return bool(np.any(np.asarray(top_k) > 0) or np.any(np.asarray(top_p) < 1) or np.any(np.asarray(min_p) > 0))


def transforms(temperature, top_k, top_p, min_p) -> bool:
    """Whether any row's sampler differs from the plain softmax: a temperature other than 1, or truncation.

    >>> transforms(1.0, 0, 1.0, 0.0), transforms(np.array([1.0, 0.7]), 0, 1.0, 0.0)
    (False, True)
    """
    return bool(np.any(np.asarray(temperature) != 1)) or truncates(top_k, top_p, min_p)


def replayed_thresholds(scaled: jax.Array, log_normalizer: jax.Array, sampling: SamplerParams) -> jax.Array:
    """Kept-set thresholds ``[B, C]`` of scaled logits ``[B, C, V]`` (no gradient).

    Uses the candidates of `top_candidates`; if any position of the chunk needs more (a wide top-p or top-k), the
    whole chunk is recomputed from the fully sorted vocabulary, so the result is always exact. For a vocabulary of
    at most the candidate count the candidates are the fully sorted vocabulary.
    """
    scaled, log_normalizer = jax.lax.stop_gradient((scaled, log_normalizer))
    params = tuple(x[:, None] for x in (sampling.top_k, sampling.top_p, sampling.min_p))
    candidates = top_candidates(scaled)
    threshold, determined = kept_threshold(candidates, log_normalizer, *params)
    if candidates.shape[0] == scaled.shape[-1]:
        return threshold
    return jax.lax.cond(jnp.all(determined), lambda: threshold,
                        lambda: kept_threshold(descending(scaled), log_normalizer, *params)[0])


def replayed_token_stats(logits: jax.Array, targets: jax.Array, sampling: SamplerParams, with_entropy: bool = False
                         ) -> dict[str, jax.Array]:
    """Logprob of each target under the replayed sampling distribution, for one chunk.

    The target always stays in the support: under bf16 jitter the sampled token can fall just outside the
    learner's kept set, and its logprob must not become -inf.

    Args:
      logits: float32 ``[B, C, V]`` model logits.
      targets: int ``[B, C]`` the scored (sampled) tokens.
      sampling: ``[B]`` per-sequence parameters.
      with_entropy: also return the entropy of the replayed distribution.

    Returns:
      ``logprobs`` ``[B, C]``, ``log_kept_mass`` ``[B, C]`` (log of the kept probability mass under the
      temperature-scaled distribution, <= 0), and ``entropy`` when asked.
    """
    scaled = logits / sampling.temperature[:, None, None]
    largest = jax.lax.stop_gradient(jnp.max(scaled, axis=-1, keepdims=True))  # always kept: threshold <= largest
    exp_scaled = jnp.exp(scaled - largest)
    log_normalizer = jnp.log(jnp.sum(exp_scaled, axis=-1)) + largest[..., 0]
    threshold = replayed_thresholds(scaled, log_normalizer, sampling)
    vocab = jnp.arange(scaled.shape[-1])
    kept = (scaled >= threshold[..., None]) | (vocab == targets[..., None])
    kept_scaled = jnp.where(kept, scaled, -jnp.inf)
    log_kept_normalizer = jnp.log(jnp.sum(jnp.where(kept, exp_scaled, 0.0), axis=-1)) + largest[..., 0]
    target_scaled = jnp.take_along_axis(scaled, targets[..., None], axis=-1)[..., 0]
    stats = {"logprobs": target_scaled - log_kept_normalizer,
             "log_kept_mass": jax.lax.stop_gradient(log_kept_normalizer - log_normalizer)}
    if with_entropy:
        probs = jnp.exp(kept_scaled - log_kept_normalizer[..., None])
        stats["entropy"] = log_kept_normalizer - jnp.sum(jnp.where(kept, probs * scaled, 0.0), axis=-1)
    return stats
