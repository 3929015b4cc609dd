"""Advantage estimators over a batch of scalar rewards, and KL-to-reference estimators.

Group estimators take rewards [B] laid out as contiguous groups of ``group_size`` samples of one prompt.
"""

import jax
import jax.numpy as jnp

from corrections._masked import clamp_log_ratio, masked_count, masked_mean, masked_sum


def _groups(rewards: jax.Array, group_size: int) -> jax.Array:
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 1 or rewards.shape[0] % group_size:
        raise ValueError(f"rewards: shape {rewards.shape} is not [B] with B a multiple of group_size={group_size}.")
    return rewards.reshape(-1, group_size)


def grpo_advantages(rewards: jax.Array, group_size: int, normalize_std: bool = True, eps: float = 1e-6,
                    scored: jax.Array | None = None) -> jax.Array:
    """GRPO: ``(r - group mean) / (group std + eps)``; std is unbiased (ddof=1) as torch.std in verl and SkyRL.
    A group of one sample gets advantage 0. ``normalize_std=False`` is Dr. GRPO.

    ``scored`` (bool [B], optional): the samples that have a reward. The mean and std of a group are over its scored
    samples alone, as verl computes them over the samples left after a filter (its groups are the samples sharing a
    uid); an unscored sample (its reward ignored, NaN allowed) gets advantage 0, and so does a group with one scored
    sample.

    >>> import numpy as np
    >>> np.asarray(grpo_advantages([1.0, 0.0, 1.0, 1.0], group_size=2), float).round(4).tolist()
    [0.7071, -0.7071, 0.0, 0.0]
    >>> rewards, scored = [1.0, 0.0, float("nan"), 1.0, 0.0, 2.0], [True, True, False, True, False, False]
    >>> np.asarray(grpo_advantages(rewards, group_size=3, scored=scored), float).round(4).tolist()
    [0.7071, -0.7071, 0.0, 0.0, 0.0, 0.0]
    """
    groups = _groups(rewards, group_size)
    if scored is None:
        centered = groups - groups.mean(axis=1, keepdims=True)
        if normalize_std and group_size > 1:
            centered = centered / (groups.std(axis=1, ddof=1, keepdims=True) + eps)
        return centered.reshape(-1)
    scored = jnp.asarray(scored, bool).reshape(groups.shape)
    groups = jnp.where(scored, groups, 0.0)
    count = scored.sum(axis=1, keepdims=True)
    centered = jnp.where(scored, groups - groups.sum(axis=1, keepdims=True) / jnp.maximum(count, 1), 0.0)
    if normalize_std:
        std = jnp.sqrt((centered**2).sum(axis=1, keepdims=True) / jnp.maximum(count - 1, 1))
        centered = centered / (std + eps)
    return centered.reshape(-1)


def dr_grpo_advantages(rewards: jax.Array, group_size: int) -> jax.Array:
    """Dr. GRPO: ``r - group mean`` (no std division).

    >>> dr_grpo_advantages([1.0, 0.0, 0.5, 0.5], group_size=2).tolist()
    [0.5, -0.5, 0.0, 0.0]
    """
    return grpo_advantages(rewards, group_size, normalize_std=False)


def rloo_advantages(rewards: jax.Array, group_size: int) -> jax.Array:
    """RLOO: ``r - mean of the other samples of the group``; 0 for a group of one.

    >>> rloo_advantages([1.0, 0.0, 0.0], group_size=3).tolist()
    [1.0, -0.5, -0.5]
    """
    groups = _groups(rewards, group_size)
    if group_size == 1:
        return jnp.zeros(groups.size, jnp.float32)
    others = (groups.sum(axis=1, keepdims=True) - groups) / (group_size - 1)
    return (groups - others).reshape(-1)


def reinforce_pp_advantages(token_rewards: jax.Array, mask: jax.Array, gamma: float = 1.0,
                            eps: float = 1e-8) -> jax.Array:
    """REINFORCE++: discounted returns of per-token rewards [B, T], whitened over the batch's valid tokens
    (mean, unbiased variance, ``rsqrt(var + eps)``) as verl's ``masked_whiten``.

    >>> import numpy as np
    >>> np.asarray(reinforce_pp_advantages(np.array([[0.0, 1.0], [0.0, 0.0]]), np.ones((2, 2))),
    ...     float).round(4).tolist()
    [[0.866, 0.866], [-0.866, -0.866]]
    """
    rewards = jnp.where(jnp.asarray(mask).astype(bool), jnp.asarray(token_rewards, jnp.float32), 0.0)

    def step(carry: jax.Array, reward: jax.Array) -> tuple[jax.Array, jax.Array]:
        carry = reward + gamma * carry
        return carry, carry

    _, returns = jax.lax.scan(step, jnp.zeros(rewards.shape[0]), rewards.T, reverse=True)
    returns = returns.T
    mean = masked_mean(returns, mask)
    count = masked_count(mask)
    var = masked_sum((returns - mean) ** 2, mask) / jnp.maximum(count - 1.0, 1.0)
    return jnp.where(jnp.asarray(mask).astype(bool), (returns - mean) * jax.lax.rsqrt(var + eps), 0.0)


def broadcast_to_tokens(advantages: jax.Array, mask: jax.Array) -> jax.Array:
    """Sequence advantages [B] -> per-token [B, T], 0 at padding.

    >>> import numpy as np
    >>> broadcast_to_tokens(np.array([2.0, -1.0]), np.array([[1, 1, 0], [1, 0, 0]])).tolist()
    [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]
    """
    mask = jnp.asarray(mask)
    return jnp.where(mask.astype(bool), jnp.asarray(advantages, jnp.float32)[:, None], 0.0)


def kl_penalty(logprobs: jax.Array, ref_logprobs: jax.Array, estimator: str = "low_var_kl",
               importance_ratio: float | jax.Array | None = None) -> jax.Array:
    """Per-token KL(pi || ref) estimate with ``l = lp - ref``: k1 ``l``, k2 ``l^2/2``, k3 ``exp(-l) - 1 + l`` (``l``
    clamped to [-20, 20] before the exp, as verl, SkyRL and slime; k1 and k2 take no exp and are not clamped),
    low_var_kl the same as k3, the result clamped to [-10, 10] (verl). ``importance_ratio`` (slime's
    ``use_unbiased_kl``: ``pi / pi_old``) multiplies the estimate before low_var_kl's clamp, as slime does.

    >>> import numpy as np
    >>> np.asarray(kl_penalty(np.log([0.5]), np.log([0.25]), "k3"), float).round(4).tolist()
    [0.1931]
    >>> np.asarray(kl_penalty(np.log([0.5]), np.log([0.25]), "k3", importance_ratio=2.0), float).round(4).tolist()
    [0.3863]
    >>> kl_penalty(np.array([0.0]), np.array([-25.0]), "k2").tolist()
    [312.5]
    """
    l = jnp.asarray(logprobs, jnp.float32) - jnp.asarray(ref_logprobs, jnp.float32)
    if estimator == "k1":
        kl = l
    elif estimator == "k2":
        kl = 0.5 * l * l
    elif estimator in ("k3", "low_var_kl"):
        l = clamp_log_ratio(l)
        kl = jnp.expm1(-l) + l
    else:
        raise ValueError(f"kl estimator={estimator!r} is not an option; use k1, k2, k3 or low_var_kl.")
    if importance_ratio is not None:
        kl = importance_ratio * kl
    return jnp.clip(kl, -10.0, 10.0) if estimator == "low_var_kl" else kl
