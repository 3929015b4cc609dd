"""NumPy float64 port of AReaL's decoupled PPO actor loss (three generations of the code).

Sources read (via the code index):
- inclusionAI/AReaL areal/utils/functional.py @ 072480e26a1dc2ac1692164e504315d7e508478b
  -> ``ppo_actor_loss_fn`` (``behav_imp_weight_cap``: a MASK ``w <= cap``, not a clamp)
- AReaL areal/utils/functional.py, intermediate version with ``behave_imp_weight_mode`` (index id 52915931901;
  repo/commit not returned by the index) -> ``compute_behave_imp_weight``, ``ppo_actor_loss_fn_mode``,
  ``_compute_sequence_level_ratio_and_advantages``. Config default (test excerpt): mode "token_mask", cap 5.0.
- re-checked against inclusionAI/AReaL @ 4aef98d8 (areal/utils/functional/functional.py): the sequence-level
  (GSPO) advantages are summed over the MASK there, and ``behave_approx_kl`` = prox - old on ``behave_mask``
  (weight > 0 and kept), logged as its mean over those tokens (areal/trainer/ppo/actor.py).
- inclusionAI/AReaL areal/utils/functional/functional.py @ 2274616c3d28d2120de3beb0831d08b6b6d243ea
  -> ``apply_rejection_sampling``, ``ppo_actor_loss_fn_rs`` (RejectionSamplingConfig replaces cap/mode;
  RejectionSamplingConfig defaults and KLEstimator._compute_approx_kl were NOT read: the kl_k1/k2/k3 metrics
  below are FROM THE SPEC (k1 = lp - base, k2 = l^2/2, k3 = exp(-l) - 1 + l, no clamp), marked as such).

Only the 2-D padded path is ported. Quirks kept: exp() is never clamped; the loss denominator is the ORIGINAL
``loss_mask.count_nonzero() or 1`` even when tokens are rejected; dual clip is min(loss, c*|A|) on all tokens.
Masks are boolean in AReaL (torch.where(loss_mask, ...)); pass 0/1 arrays, they are cast to bool.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

_ERR = dict(over="ignore", invalid="ignore")


def _count(loss_mask):
    return int(np.count_nonzero(loss_mask)) or 1


def _clip_core(ratio, advantages, eps_clip, eps_clip_higher, c_clip):
    A = np.asarray(advantages, dtype=np.float64)
    cr = np.clip(ratio, 1.0 - eps_clip, 1.0 + (eps_clip if eps_clip_higher is None else eps_clip_higher))
    l1, l2 = -A * ratio, -A * cr
    clip_mask = l1 < l2
    pg = np.maximum(l1, l2)
    if c_clip is not None:
        assert c_clip > 1.0, c_clip
        l3 = np.sign(A) * c_clip * A
        dual = l3 < pg
        pg = np.minimum(pg, l3)
    else:
        dual = np.zeros_like(clip_mask)
    return pg, clip_mask, dual


def ppo_actor_loss_fn(logprobs, proximal_logprobs, old_logprobs, advantages, eps_clip, loss_mask,
                      eps_clip_higher=None, c_clip=None, behav_imp_weight_cap=None):
    """Port of functional.ppo_actor_loss_fn @ 072480e2 (decoupled PPO).

    ratio = exp(lp - prox) on mask; w = exp(prox - old) kept where w <= cap (mask) else 0; loss = sum(pg*w)/N_orig.
    """
    lm = np.asarray(loss_mask).astype(bool)
    n = _count(lm)
    with np.errstate(**_ERR):
        ratio = np.where(lm, np.exp(np.asarray(logprobs) - np.asarray(proximal_logprobs)), 0.0)
        pg, clip_mask, dual = _clip_core(ratio, advantages, eps_clip, eps_clip_higher, c_clip)
        bkl = np.asarray(proximal_logprobs) - np.asarray(old_logprobs)
        bw = np.exp(bkl)
    bmask = (bw <= behav_imp_weight_cap) & lm if behav_imp_weight_cap is not None else lm
    bkl, bw = np.where(bmask, bkl, 0.0), np.where(bmask, bw, 0.0)
    pg = pg * bw
    loss = np.where(lm, pg, 0.0).sum() / n
    return loss, dict(loss=pg, importance_weight=ratio, clip_mask=clip_mask & lm, dual_clip_mask=dual & lm,
                      behave_imp_weight=bw, behave_approx_kl=bkl, behave_mask=bmask)


def _compute_sequence_level_ratio_and_advantages(log_ratio, advantages, loss_mask, cu_seqlens=None):
    """Port of functional._compute_sequence_level_ratio_and_advantages @ 4aef98d8 (2-D path): ratio =
    exp(masked mean log_ratio) on mask (0 elsewhere); advantages = MASKED row sum / clamp(n, 1) on mask.
    (Older AReaL summed the advantages unmasked.)"""
    lm = np.asarray(loss_mask).astype(bool)
    n = np.maximum(lm.sum(-1), 1)
    seq = np.where(lm, log_ratio, 0.0).sum(1) / n
    with np.errstate(**_ERR):
        ratio = np.where(lm, np.exp(np.broadcast_to(seq[:, None], lm.shape)), 0.0)
    adv = np.where(lm, np.asarray(advantages), 0.0).sum(-1) / n
    return ratio, np.where(lm, np.broadcast_to(adv[:, None], lm.shape), 0.0)


def compute_behave_imp_weight(proximal_logprobs, old_logprobs, loss_mask, cu_seqlens, behave_imp_weight_mode,
                              behave_imp_weight_cap):
    """Port of functional.compute_behave_imp_weight (intermediate): modes token_/sequence_ x truncate/mask.

    truncate: clamp [0, cap]; mask: w > cap -> 0 (STRICT, so w == cap kept). Sequence level: geometric mean.
    """
    if behave_imp_weight_mode == "disabled":
        raise ValueError("compute_behave_imp_weight should not be called with mode='disabled'.")
    lm = np.asarray(loss_mask).astype(bool)
    bkl = np.asarray(proximal_logprobs, dtype=np.float64) - np.asarray(old_logprobs, dtype=np.float64)
    with np.errstate(**_ERR):
        if "sequence" in behave_imp_weight_mode:
            w, _ = _compute_sequence_level_ratio_and_advantages(bkl, np.zeros_like(bkl), lm, cu_seqlens)
        else:
            w = np.exp(bkl)
    if behave_imp_weight_cap is not None:
        if "truncate" in behave_imp_weight_mode:
            w = np.clip(w, 0.0, behave_imp_weight_cap)
        else:
            w = np.where(w > behave_imp_weight_cap, 0.0, w)
    w = np.where(lm, w, 0.0)
    bmask = (w > 0) & lm
    return w, np.where(bmask, bkl, 0.0), bmask


def ppo_actor_loss_fn_mode(logprobs, proximal_logprobs, old_logprobs, advantages, eps_clip, loss_mask,
                           eps_clip_higher=None, c_clip=None, behave_imp_weight_cap=None,
                           importance_sampling_level="token", cu_seqlens=None, behave_imp_weight_mode="token_mask"):
    """Port of the intermediate functional.ppo_actor_loss_fn (behave_imp_weight_mode; GSPO via
    importance_sampling_level='sequence')."""
    lm = np.asarray(loss_mask).astype(bool)
    n = _count(lm)
    A = np.asarray(advantages, dtype=np.float64)
    lr = np.asarray(logprobs, dtype=np.float64) - np.asarray(proximal_logprobs, dtype=np.float64)
    with np.errstate(**_ERR):
        if importance_sampling_level == "sequence":
            ratio, A = _compute_sequence_level_ratio_and_advantages(lr, A, lm, cu_seqlens)
        elif importance_sampling_level == "token":
            ratio = np.where(lm, np.exp(lr), 0.0)
        else:
            raise ValueError(f"Invalid importance_sampling_level: {importance_sampling_level}")
        pg, clip_mask, dual = _clip_core(ratio, A, eps_clip, eps_clip_higher, c_clip)
    stat: dict[str, Any] = dict(importance_weight=ratio, clip_mask=clip_mask & lm, dual_clip_mask=dual & lm)
    if behave_imp_weight_mode != "disabled":
        w, bkl, bmask = compute_behave_imp_weight(proximal_logprobs, old_logprobs, lm, cu_seqlens,
                                                  behave_imp_weight_mode, behave_imp_weight_cap)
        pg = pg * w
        stat.update(behave_imp_weight=w, behave_approx_kl=bkl, behave_mask=bmask)
    stat["loss"] = pg
    return np.where(lm, pg, 0.0).sum() / n, stat


def apply_rejection_sampling(proximal_logprobs, old_logprobs, loss_mask, cu_seqlens=None, *, metric="ratio",
                             level="token", agg="mean", action="mask", upper=5.0, lower=None):
    """Port of functional.apply_rejection_sampling (newest, 2-D path) -> (loss_mask, behave_imp_weight, frac).
    Re-checked for issue 30 against areal/utils/functional/functional.py:347-420 at 4aef98d8 (the ``agg == "max"``
    branch; ``behave_imp_weight = torch.where(updated_mask.bool(), behave_imp_weight, 0.0)``).

    metric ratio: aggregated in LOG space (sequence 'mean' = geometric mean, and the sequence weight becomes the
    geometric mean); kl_k*: FROM THE SPEC (KLEstimator not read). Bounds inclusive: lower <= x <= upper.
    Defaults of upper/lower/agg are not from source (RejectionSamplingConfig not read).
    """
    lm = np.asarray(loss_mask).astype(bool)
    lp, old = np.asarray(proximal_logprobs, dtype=np.float64), np.asarray(old_logprobs, dtype=np.float64)
    with np.errstate(**_ERR):
        lr = lp - old
        lr = np.where(np.isfinite(lr), lr, 0.0)
        if metric == "ratio":
            mval = np.exp(lr)
        elif metric == "kl_k1":
            mval = lp - old
        elif metric == "kl_k2":
            mval = 0.5 * (lp - old) ** 2
        elif metric == "kl_k3":
            mval = np.exp(-(lp - old)) - 1 + (lp - old)
        else:
            raise ValueError(f"Unknown metric: {metric}")
        w = np.exp(lr)
    orig_w = w

    def check(x):
        return (x >= lower) & (x <= upper) if lower is not None else x <= upper

    use_log = metric == "ratio"
    if level == "sequence":
        aggv = lr if use_log else mval
        masked = np.where(lm, aggv, 0.0)
        cnt = np.maximum(lm.sum(-1, keepdims=True), 1)
        if use_log:
            w = np.broadcast_to(np.exp(masked.sum(-1, keepdims=True) / cnt), lr.shape)
            orig_w = w
        if agg == "sum":
            s = masked.sum(-1, keepdims=True)
        elif agg == "mean":
            s = masked.sum(-1, keepdims=True) / cnt
        elif agg == "max":
            s = np.where(lm, aggv, -np.inf).max(-1, keepdims=True)
            s = np.where(lm.sum(-1, keepdims=True) == 0, 0.0, s)
        else:
            raise ValueError(f"Unknown agg method: {agg}")
        with np.errstate(**_ERR):
            sm = np.exp(s) if use_log else s
        if action == "mask":
            inb = np.broadcast_to(check(sm), lm.shape)
        else:
            oob = np.broadcast_to(~check(sm), lm.shape)
            w = np.where(oob, np.clip(w, lower if lower is not None else 0.0, upper), w)
    else:
        if action == "mask":
            inb = check(mval)
        else:
            w = np.clip(w, lower if lower is not None else 0.0, upper)
    if action == "mask":
        new_mask = lm & inb
        frac = (lm & ~inb).sum() / max(lm.sum(), 1)
    else:
        new_mask = lm
        frac = (lm & (orig_w != w)).sum() / max(lm.sum(), 1)
    return new_mask, np.where(new_mask, w, 0.0), float(frac)


def ppo_actor_loss_fn_rs(logprobs, proximal_logprobs, old_logprobs, advantages, eps_clip, loss_mask,
                         eps_clip_higher=None, c_clip=None, rejection_sampling=None, importance_sampling_level="token",
                         cu_seqlens=None):
    """Port of the newest functional.ppo_actor_loss_fn (rejection_sampling dict = apply_rejection_sampling kwargs).

    Denominator = ORIGINAL count (saved before rejection); rejected tokens are dropped from the numerator.
    """
    n = _count(np.asarray(loss_mask).astype(bool))
    lm = np.asarray(loss_mask).astype(bool)
    A = np.asarray(advantages, dtype=np.float64)
    stat: dict[str, Any] = {}
    if rejection_sampling is not None:
        lm, bw, frac = apply_rejection_sampling(proximal_logprobs, old_logprobs, lm, cu_seqlens,
                                                **rejection_sampling)
        stat["filtered_fraction"] = frac
    lr = np.asarray(logprobs, dtype=np.float64) - np.asarray(proximal_logprobs, dtype=np.float64)
    with np.errstate(**_ERR):
        if importance_sampling_level == "sequence":
            ratio, A = _compute_sequence_level_ratio_and_advantages(lr, A, lm, cu_seqlens)
        elif importance_sampling_level == "token":
            ratio = np.where(lm, np.exp(lr), 0.0)
        else:
            raise ValueError(f"Invalid importance_sampling_level: {importance_sampling_level}")
        pg, clip_mask, dual = _clip_core(ratio, A, eps_clip, eps_clip_higher, c_clip)
    if rejection_sampling is not None:
        pg = pg * bw
        behave_mask = (bw > 0) & lm
        bkl = np.asarray(proximal_logprobs, dtype=np.float64) - np.asarray(old_logprobs, dtype=np.float64)
        stat.update(behave_imp_weight=bw, behave_mask=behave_mask, behave_approx_kl=np.where(behave_mask, bkl, 0.0))
    stat.update(loss=pg, importance_weight=ratio, clip_mask=clip_mask & lm, dual_clip_mask=dual & lm)
    return np.where(lm, pg, 0.0).sum() / n, stat


def masked_normalization(x, mask=None, dim=None, unbiased=False, eps=1e-5):
    """Port of functional.masked_normalization (single process): (x - mean) / (std + eps), x zeroed off-mask."""
    x = np.asarray(x, dtype=np.float64)
    dim = tuple(range(x.ndim)) if dim is None else dim
    if mask is None:
        factor = float(np.prod([x.shape[d] for d in np.atleast_1d(dim)]))
    else:
        mask = np.asarray(mask, dtype=np.float64)
        x = x * mask
        factor = mask.sum(dim, keepdims=True)
    mean = x.sum(dim, keepdims=True) / factor
    var = (x ** 2).sum(dim, keepdims=True) / factor - mean ** 2
    if unbiased:
        var = var * factor / (factor - 1)
    return (x - mean) / (np.sqrt(var) + eps)
