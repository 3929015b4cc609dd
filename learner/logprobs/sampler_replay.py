"""The learner's replay of the engine's sampling transform on one chunk of logits.

The engine samples from its sampling distribution (temperature, top-k, top-p, min-p, renormalised). The learner's
logprobs must be of the same distribution, replayed per sequence from the parameters recorded with each rollout
and in the engine's order (`rollout_client.sampling_params.SamplerOrder`), or every importance ratio is biased by
the log of the kept mass. With PROCESSED logprobs the engine reports logprobs of that distribution; with RAW ones
the learner rebuilds them (`learner.update.logprob_mode.rebuilt_rollout_logprobs`).

Orders: temperature-first (Tether, SGLang) cuts the temperature-scaled distribution, top-p within the top-k set;
temperature-last (mlx-lm) cuts the temperature-1 distribution, top-p over the whole vocabulary, breaks ties at a
cut by token id as mlx-lm does (`learner.logprobs.sampling_transform.kept_by_rank`), then applies the temperature to the
kept set.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from learner.logprobs.sampling_transform import (
    Cut,
    descending,
    kept_by_rank,
    kept_threshold,
    splits_ties,
    top_candidates,
)
from rollout_client.sampling_params import SamplerOrder


class SamplerParams(NamedTuple):
    """Per-sequence sampling parameters, ``[B]`` arrays (a pytree: pass it through `jax.jit`).

    Attributes:
      temperature: float32, > 0.
      top_k: int32, 0 = off.
      top_p: float32, 1 = off.
      min_p: float32, 0 = off.
      order: int32 `SamplerOrder` codes; None: every row temperature-first (no per-row selection is compiled).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    order: jax.Array | None = None

    @classmethod
    def from_batch(cls, batch, order: SamplerOrder = SamplerOrder.TEMPERATURE_FIRST) -> "SamplerParams":
        """The parameters a `rollout_client.RolloutBatch` echoes (any object with the four ``[B]`` fields), sampled
        in ``order`` (the engine's `rollout_client.EngineCapabilities.replayed_order`)."""
        temperature = jnp.asarray(batch.temperature, jnp.float32)
        return cls(temperature=temperature, top_k=jnp.asarray(batch.top_k, jnp.int32),
                   top_p=jnp.asarray(batch.top_p, jnp.float32), min_p=jnp.asarray(batch.min_p, jnp.float32),
                   order=None if order == SamplerOrder.TEMPERATURE_FIRST else jnp.full(temperature.shape, order,
                                                                                       jnp.int32))

    def pad_rows(self, rows: int) -> "SamplerParams":
        """Host NumPy copy padded to ``rows`` rows with neutral ones: temperature 1, no truncation.

        Padding rows are fully masked, but their logprobs are still computed (and differentiated): a temperature
        of 0 there would put NaN into the gradient.

        >>> SamplerParams(np.array([0.7]), np.array([5]), np.array([0.9]), np.array([0.05])).pad_rows(2).top_k
        array([5, 0])
        """
        return SamplerParams(*(None if x is None else np.pad(np.asarray(x), (0, rows - np.shape(x)[0]),
                                                             constant_values=neutral)
                               for x, neutral in zip(self, NEUTRAL)))


NEUTRAL = SamplerParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                        order=int(SamplerOrder.TEMPERATURE_FIRST))  # plain softmax: replays no transform.


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
    """Kept-set thresholds ``[B, C]`` of scaled logits ``[B, C, V]`` in the temperature-first order (no gradient).

    Uses the candidates of `top_candidates`; if any position of the chunk needs more (a wide top-p or top-k), the
    whole chunk is recomputed from the fully sorted vocabulary, so the result is always exact. For a vocabulary of
    at most the candidate count the candidates are the fully sorted vocabulary.
    """
    scaled, log_normalizer = jax.lax.stop_gradient((scaled, log_normalizer))
    params = tuple(x[:, None] for x in (sampling.top_k, sampling.top_p, sampling.min_p))
    candidates = top_candidates(scaled)
    cut = kept_threshold(candidates, log_normalizer, *params)
    if candidates.shape[0] == scaled.shape[-1]:
        return cut.threshold
    return jax.lax.cond(jnp.all(cut.determined), lambda: cut.threshold,
                        lambda: kept_threshold(descending(scaled), log_normalizer, *params).threshold)


def replayed_kept(logits: jax.Array, scaled: jax.Array, log_normalizer: jax.Array, sampling: SamplerParams
                  ) -> jax.Array:
    """The kept set ``[B, C, V]`` (bool, no gradient) of each row's sampler in its order.

    Args:
      logits: ``[B, C, V]`` temperature-1 logits.
      scaled: ``logits / temperature``.
      log_normalizer: ``[B, C]`` logsumexp of ``scaled``.
      sampling: ``[B]`` per-row parameters; with ``order`` None every row is temperature-first (`replayed_thresholds`).

    Temperature-last rows cut the temperature-1 logits, top-p over the whole vocabulary, with ties at the cut broken
    by token id (only computed when a position's cut splits a tied group).
    """
    if sampling.order is None:
        return scaled >= replayed_thresholds(scaled, log_normalizer, sampling)[..., None]
    logits, scaled, log_normalizer = jax.lax.stop_gradient((logits, scaled, log_normalizer))
    last = (sampling.order == SamplerOrder.TEMPERATURE_LAST)[:, None]
    cut_on = jnp.where(last[..., None], logits, scaled)  # the scale each row's cut sees
    cut_normalizer = jnp.where(last, jax.nn.logsumexp(logits, axis=-1), log_normalizer)
    params = tuple(x[:, None] for x in (sampling.top_k, sampling.top_p, sampling.min_p))

    def cut_of(desc: jax.Array) -> tuple[Cut, jax.Array]:
        cut = kept_threshold(desc, cut_normalizer, *params, top_p_after_top_k=~last)
        return cut, last & splits_ties(desc, cut)

    candidates = top_candidates(cut_on)
    cut, split = cut_of(candidates)
    if candidates.shape[0] < cut_on.shape[-1]:
        cut, split = jax.lax.cond(jnp.all(cut.determined), lambda: (cut, split),
                                  lambda: cut_of(descending(cut_on)))
    by_value = cut_on >= cut.threshold[..., None]
    return jax.lax.cond(jnp.any(split), lambda: jnp.where(split[..., None], kept_by_rank(cut_on, cut), by_value),
                        lambda: by_value)


def replayed_token_stats(logits: jax.Array, targets: jax.Array, sampling: SamplerParams, with_entropy: bool = False,
                         with_raw: bool = False) -> dict[str, jax.Array]:
    """Logprob of each target under the replayed sampling distribution, for one chunk.

    The target always stays in the support: under bf16 jitter the sampled token can fall just outside the
    learner's kept set, and its logprob must not become -inf.

    Args:
      logits: float32 ``[B, C, V]`` model logits.
      targets: int ``[B, C]`` the scored (sampled) tokens.
      sampling: ``[B]`` per-sequence parameters.
      with_entropy: also return the entropy of the replayed distribution.
      with_raw: also return ``raw_logprobs``, the targets' logprobs at temperature 1 without truncation.

    Returns:
      ``logprobs`` ``[B, C]``, ``log_kept_mass`` ``[B, C]`` (log of the kept probability mass under the
      temperature-scaled distribution, <= 0), and ``entropy`` / ``raw_logprobs`` when asked.
    """
    scaled = logits / sampling.temperature[:, None, None]
    largest = jax.lax.stop_gradient(jnp.max(scaled, axis=-1, keepdims=True))  # always kept: threshold <= largest
    exp_scaled = jnp.exp(scaled - largest)
    log_normalizer = jnp.log(jnp.sum(exp_scaled, axis=-1)) + largest[..., 0]
    vocab = jnp.arange(scaled.shape[-1])
    kept = replayed_kept(logits, scaled, log_normalizer, sampling) | (vocab == targets[..., None])
    kept_scaled = jnp.where(kept, scaled, -jnp.inf)
    log_kept_normalizer = jnp.log(jnp.sum(jnp.where(kept, exp_scaled, 0.0), axis=-1)) + largest[..., 0]
    target_scaled = jnp.take_along_axis(scaled, targets[..., None], axis=-1)[..., 0]
    stats = {"logprobs": target_scaled - log_kept_normalizer,
             "log_kept_mass": jax.lax.stop_gradient(log_kept_normalizer - log_normalizer)}
    if with_entropy:
        probs = jnp.exp(kept_scaled - log_kept_normalizer[..., None])
        stats["entropy"] = log_kept_normalizer - jnp.sum(jnp.where(kept, probs * scaled, 0.0), axis=-1)
    if with_raw:
        target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        stats["raw_logprobs"] = target_logits - jax.nn.logsumexp(logits, axis=-1)
    return stats
