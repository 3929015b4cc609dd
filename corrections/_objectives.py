"""Per-token policy objectives: each returns ``(loss, aux)`` where ``aux`` maps a metric name to a per-token
indicator or value whose masked mean the pipeline reports (``pg_clipfrac``, ``ppo_kl``, ...).

Elementwise objectives work on any shape; GSPO needs one sequence ([T]) and is vmapped; clip-cov and kl-cov
select tokens across the whole batch ([B, T]). All log-ratios are clamped to [-20, 20] before ``exp``.
Behaviour weights from ``corrections.token_tis_weights`` and friends multiply the returned loss.

``OBJECTIVES`` registers each one under its ``Objective.name``: config validation, the pipeline's dispatch and
its input checks all read it, so adding an objective is one entry there.
"""

import dataclasses
import types
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from corrections._masked import SAFETY, clamp_log_ratio, masked_count, masked_mean, safe_exp

sg = jax.lax.stop_gradient

Loss = tuple[jax.Array, dict[str, jax.Array]]
"""What an objective returns: the per-token loss and its ``aux`` metrics, each per token too."""


def _f32(*arrays: jax.Array) -> list[jax.Array]:
    return [jnp.asarray(a, jnp.float32) for a in arrays]


def ppo_clip_loss(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array, clip_low: float = 0.2,
                  clip_high: float = 0.2, dual_clip: float | None = None) -> Loss:
    """PPO clip ``max(-r*A, -clip(r, 1-clip_low, 1+clip_high)*A)`` with optional dual clip for ``A < 0``.

    Dual clip (verl, SkyRL: c = 3.0) bounds the loss of negative-advantage tokens by ``-c*A``.

    >>> import numpy as np
    >>> loss, aux = ppo_clip_loss(np.log([1.5, 0.5]), np.log([1.0, 1.0]), np.array([1.0, -1.0]))
    >>> np.asarray(loss, float).round(4).tolist(), aux["pg_clipfrac"].tolist()
    ([-1.2, 0.8], [1.0, 1.0])
    """
    lp, old, adv = _f32(logprobs, old_logprobs, advantages)
    log_ratio = clamp_log_ratio(lp - old)
    ratio = jnp.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = jnp.maximum(unclipped, clipped)
    aux = {"pg_clipfrac": (clipped > unclipped).astype(jnp.float32), "ppo_kl": -log_ratio}
    if dual_clip is not None:
        lower = -adv * dual_clip
        aux["pg_clipfrac_lower"] = ((loss > lower) & (adv < 0)).astype(jnp.float32)
        loss = jnp.where(adv < 0, jnp.minimum(loss, lower), loss)
    return loss, aux


def reinforce_loss(logprobs: jax.Array, advantages: jax.Array, old_logprobs: jax.Array | None = None) -> Loss:
    """REINFORCE / pure IS base ``-A * lp``; behaviour weights multiply it (verl ``loss_type=reinforce``).
    With ``old_logprobs`` (in bypass mode the rollout's) ``ppo_kl`` is ``old - lp`` as verl reports it.

    >>> import numpy as np
    >>> loss, aux = reinforce_loss(np.log([0.5]), np.array([2.0]), np.log([0.25]))
    >>> np.asarray(loss, float).round(4).tolist(), np.asarray(aux["ppo_kl"], float).round(4).tolist()
    ([1.3863], [-0.6931])
    """
    lp, adv = _f32(logprobs, advantages)
    aux = {} if old_logprobs is None else {"ppo_kl": _f32(old_logprobs)[0] - lp}  # no exp: not clamped (verl)
    return -adv * lp, aux


def cispo_loss(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array, clip_low: float = 1.0,
               clip_high: float = 4.0) -> Loss:
    """CISPO (MiniMax-M1): ``-sg(clip(r, 1-clip_low, 1+clip_high)) * A * lp``; clipfrac counts ``clipped != r``.

    >>> import numpy as np
    >>> loss, aux = cispo_loss(np.log([6.0, 2.0]), np.log([1.0, 1.0]), np.array([1.0, 1.0]))
    >>> np.asarray(loss, float).round(4).tolist(), aux["pg_clipfrac"].tolist()
    ([-8.9588, -1.3863], [1.0, 0.0])
    """
    lp, old, adv = _f32(logprobs, old_logprobs, advantages)
    log_ratio = clamp_log_ratio(lp - old)
    ratio = jnp.exp(log_ratio)
    clipped = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    aux = {"pg_clipfrac": (clipped != ratio).astype(jnp.float32), "ppo_kl": -log_ratio,
           "cispo/ratio": ratio, "cispo/ratio_clamped": clipped}
    return -sg(clipped) * adv * lp, aux


def sapo_loss(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array, tau_pos: float = 1.0,
              tau_neg: float = 1.05) -> Loss:
    """SAPO soft gate: ``-gate*A``, ``gate = sigmoid(tau*(r-1)) * 4/tau``, tau by the sign of A.

    >>> import numpy as np
    >>> sapo_loss(np.log([1.0]), np.log([1.0]), np.array([1.0]))[0].tolist()
    [-2.0]
    """
    lp, old, adv = _f32(logprobs, old_logprobs, advantages)
    log_ratio = clamp_log_ratio(lp - old)
    tau = jnp.where(adv > 0, tau_pos, tau_neg)
    gate = jax.nn.sigmoid(tau * (jnp.exp(log_ratio) - 1.0)) * 4.0 / tau
    return -gate * adv, {"ppo_kl": -log_ratio}


def rollout_is_loss(logprobs: jax.Array, rollout_logprobs: jax.Array, advantages: jax.Array, clip_low: float = 0.2,
                    clip_high: float = 0.2) -> Loss:
    """GLM-5 rollout IS (SkyRL ``rollout_is``): ``-sg(where(1-lo < r < 1+hi, r, 0)) * A * lp``, ``r = exp(lp - roll)``.

    >>> import numpy as np
    >>> loss, aux = rollout_is_loss(np.log([0.55, 0.5]), np.log([0.5, 0.25]), np.array([1.0, 1.0]))
    >>> np.asarray(loss, float).round(4).tolist(), aux["pg_clipfrac"].tolist()
    ([0.6576, 0.0], [0.0, 1.0])
    """
    lp, roll, adv = _f32(logprobs, rollout_logprobs, advantages)
    ratio = safe_exp(lp - roll)
    inside = (ratio > 1.0 - clip_low) & (ratio < 1.0 + clip_high)
    weight = sg(jnp.where(inside, ratio, 0.0))
    return -weight * adv * lp, {"pg_clipfrac": (~inside).astype(jnp.float32)}


def cross_entropy_loss(logprobs: jax.Array) -> Loss:
    """Supervised cross entropy ``-lp``.

    >>> import numpy as np
    >>> np.asarray(cross_entropy_loss(np.log([0.5, 0.25]))[0], float).round(4).tolist()
    [0.6931, 1.3863]
    """
    (lp,) = _f32(logprobs)
    return -lp, {}


def gspo_loss(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array, mask: jax.Array,
              clip_low: float = 3e-4, clip_high: float = 4e-4, log_ratio_cap: float = 10.0,
              form: str = "token") -> Loss:
    """GSPO for ONE sequence. ``form="token"`` (GSPO-token, verl/SkyRL): ``log r_t = sg(mean_valid(lp - old)) +
    lp - sg(lp)``, capped at ``log_ratio_cap`` (and floored at -20), then PPO clip: its value is the sequence
    ratio, its gradient per token. ``form="sequence"`` (AReaL): ``log r = mean_valid(lp - old)`` with the gradient
    through the mean (spread evenly over the row) and the advantage replaced by its mean over ``mask``.

    >>> import numpy as np
    >>> loss, aux = gspo_loss(np.log([1.0, 1.0]), np.log([1.0, 1.0]), np.ones(2), np.array([1, 1]))
    >>> loss.tolist()
    [-1.0, -1.0]
    """
    lp, old, adv = _f32(logprobs, old_logprobs, advantages)
    if form == "sequence":
        adv = jnp.broadcast_to(masked_mean(adv, mask), adv.shape)
        log_ratio = jnp.clip(jnp.broadcast_to(masked_mean(lp - old, mask), lp.shape), -SAFETY, log_ratio_cap)
    else:
        log_ratio = jnp.clip(lp - sg(lp) + sg(masked_mean(lp - old, mask)), -SAFETY, log_ratio_cap)
    ratio = jnp.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    aux = {"pg_clipfrac": (clipped > unclipped).astype(jnp.float32), "ppo_kl": -clamp_log_ratio(lp - old)}
    return jnp.maximum(unclipped, clipped), aux


def _centered_covariance(advantages: jax.Array, logprobs: jax.Array, mask: jax.Array) -> jax.Array:
    lp = sg(logprobs)
    return (advantages - masked_mean(advantages, mask)) * (lp - masked_mean(lp, mask))


def _ranked_selection(score: jax.Array, eligible: jax.Array, count: jax.Array,
                      key: jax.Array | None = None) -> jax.Array:
    """Boolean [B, T] selecting the ``count`` eligible entries of highest score (random ones if key is given)."""
    if key is not None:
        score = jax.random.uniform(key, score.shape)
    flat = jnp.where(eligible, score, -jnp.inf).reshape(-1)
    rank = jnp.empty_like(flat, dtype=jnp.int32).at[jnp.argsort(-flat)].set(jnp.arange(flat.size, dtype=jnp.int32))
    return (rank < count).reshape(score.shape) & eligible


def clip_cov_loss(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array, mask: jax.Array, key: jax.Array,
                  clip_low: float = 0.2, clip_high: float = 0.2, clip_cov_ratio: float = 2e-4,
                  clip_cov_low: float = 1.0, clip_cov_high: float = 5.0) -> Loss:
    """Clip-Cov over a [B, T] batch (verl/SkyRL): PPO clip, then cut the gradient of
    ``max(int(ratio * n_valid), 1)`` random unclipped tokens whose centred covariance of A and lp lies strictly
    inside ``(clip_cov_low, clip_cov_high)``.

    >>> import jax, numpy as np
    >>> lp, old = np.log([[0.5, 0.5, 0.9, 0.1]]), np.log([[0.5, 0.4, 0.9, 0.1]])  # ratio 1.25 on token 1
    >>> loss, aux = clip_cov_loss(lp, old, np.array([[1.0, 2.0, -1.0, 0.5]]), np.ones((1, 4)), jax.random.key(0),
    ...                           clip_cov_ratio=0.25, clip_cov_low=-10.0, clip_cov_high=10.0)
    >>> round(float(loss[0, 1]), 4), float(aux["pg_clipfrac"].sum()), float(aux["pg_clipfrac"][0, 1])
    (-2.4, 1.0, 0.0)
    """
    lp, old, adv = _f32(logprobs, old_logprobs, advantages)
    valid = jnp.asarray(mask).astype(bool)
    ratio = safe_exp(lp - old)
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped_by_origin = (clipped > unclipped) & valid
    cov = _centered_covariance(adv, lp, valid)
    eligible = valid & ~clipped_by_origin & (cov > clip_cov_low) & (cov < clip_cov_high)
    count = jnp.maximum(jnp.floor(clip_cov_ratio * masked_count(valid)), 1.0)
    cut = _ranked_selection(cov, eligible, count, key)
    loss = jnp.maximum(unclipped, clipped) * jnp.where(cut, 0.0, 1.0)
    return loss, {"pg_clipfrac": cut.astype(jnp.float32), "ppo_kl": -clamp_log_ratio(lp - old)}


def kl_cov_loss(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array, mask: jax.Array,
                kl_cov_ratio: float = 2e-3, kl_cov_coef: float = 1.0) -> Loss:
    """KL-Cov over a [B, T] batch (verl/SkyRL): ``-A*r``, plus ``coef * |lp - old|`` on the
    ``max(1, int(n_valid * ratio))`` valid tokens of largest centred covariance of A and lp. Its ``ppo_kl`` is
    verl's for kl-cov: ``|lp - old|``.

    >>> import numpy as np
    >>> lp, old = np.log([[0.5, 0.5, 0.9, 0.1]]), np.log([[0.5, 0.4, 0.9, 0.1]])
    >>> loss, aux = kl_cov_loss(lp, old, np.array([[1.0, 2.0, -1.0, 0.5]]), np.ones((1, 4)), kl_cov_ratio=0.25)
    >>> np.asarray(loss, float).round(4).tolist(), aux["pg_clipfrac"].tolist()  # token 1: -2.5 + |log 0.5/0.4|
    ([[-1.0, -2.2769, 1.0, -0.5]], [[0.0, 1.0, 0.0, 0.0]])
    """
    lp, old, adv = _f32(logprobs, old_logprobs, advantages)
    valid = jnp.asarray(mask).astype(bool)
    log_ratio = clamp_log_ratio(lp - old)
    loss = -adv * jnp.exp(log_ratio)
    count = jnp.maximum(jnp.floor(masked_count(valid) * kl_cov_ratio), 1.0)
    chosen = _ranked_selection(_centered_covariance(adv, lp, valid), valid, count)
    loss = jnp.where(chosen, loss + kl_cov_coef * jnp.abs(lp - old), loss)
    return loss, {"pg_clipfrac": chosen.astype(jnp.float32), "ppo_kl": jnp.abs(log_ratio)}  # verl: mean |lp - old|


@dataclasses.dataclass(frozen=True)
class ObjectiveSpec:
    """One registered objective as the pipeline sees it: how to call its loss and which inputs it reads.

    ``loss(objective, *, lp, old, roll, adv, mask, key)`` takes the ``Objective`` config (its constants) and the
    cleaned float32 inputs: one sequence ([T], ``key`` None) or, if ``whole_batch``, the batch ([B, T]). It returns
    ``(per-token loss, aux)`` like the functions above; ``aux`` names the objective's ``actor/...`` metrics.

    >>> import corrections
    >>> [name for name, spec in corrections.OBJECTIVES.items() if spec.whole_batch]
    ['clip_cov', 'kl_cov']
    >>> corrections.OBJECTIVES["rollout_is"].reads_rollout, corrections.OBJECTIVES["reinforce"].reads_proximal
    (True, False)
    """

    loss: Callable[..., Loss]
    reads_proximal: bool = False  # reads ``old``: decoupled mode then requires proximal_logprobs.
    reads_rollout: bool = False  # reads ``roll``: rollout_logprobs are required in either mode.
    whole_batch: bool = False  # selects tokens across the [B, T] batch: runs once, before the per-sequence pass.
    # aux names reported over the ORIGINAL response mask as ``actor/{name}_{stat}`` for each stat in the tuple
    # ("mean", "max", "min"), SkyRL's convention, instead of ``actor/{name}``, the mean over the kept tokens.
    original_mask_metrics: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)


# Read-only; the order is the one error messages list the names in.
OBJECTIVES: Mapping[str, ObjectiveSpec] = types.MappingProxyType({
    "ppo": ObjectiveSpec(
        lambda o, lp, old, adv, **_: ppo_clip_loss(lp, old, adv, o.clip_low, o.clip_high, o.dual_clip),
        reads_proximal=True),
    "gspo": ObjectiveSpec(
        lambda o, lp, old, adv, mask, kept=None, **_: gspo_loss(
            lp, old, adv, kept if o.gspo_form == "sequence" and kept is not None else mask, o.clip_low, o.clip_high,
            o.log_ratio_cap, o.gspo_form),
        reads_proximal=True),
    "cispo": ObjectiveSpec(
        lambda o, lp, old, adv, **_: cispo_loss(lp, old, adv, o.clip_low, o.clip_high), reads_proximal=True,
        original_mask_metrics={"cispo/ratio": ("mean", "max", "min"), "cispo/ratio_clamped": ("mean",)}),
    "sapo": ObjectiveSpec(
        lambda o, lp, old, adv, **_: sapo_loss(lp, old, adv, o.tau_pos, o.tau_neg), reads_proximal=True),
    "reinforce": ObjectiveSpec(lambda o, lp, adv, old=None, **_: reinforce_loss(lp, adv, old)),
    "rollout_is": ObjectiveSpec(
        lambda o, lp, roll, adv, **_: rollout_is_loss(lp, roll, adv, o.clip_low, o.clip_high), reads_rollout=True),
    "clip_cov": ObjectiveSpec(
        lambda o, lp, old, adv, mask, key, **_: clip_cov_loss(
            lp, old, adv, mask, key, o.clip_low, o.clip_high, o.clip_cov_ratio, o.clip_cov_low, o.clip_cov_high),
        reads_proximal=True, whole_batch=True),
    "kl_cov": ObjectiveSpec(
        lambda o, lp, old, adv, mask, **_: kl_cov_loss(lp, old, adv, mask, o.kl_cov_ratio, o.kl_cov_coef),
        reads_proximal=True, whole_batch=True),
    "cross_entropy": ObjectiveSpec(lambda o, lp, **_: cross_entropy_loss(lp)),
})
