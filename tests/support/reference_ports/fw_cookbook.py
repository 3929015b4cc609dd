"""NumPy float64 port of the fw-ai cookbook's importance-sampling correction and GRPO loss.

Source read: fw-ai/cookbook @ 227d25a2 (training/utils/rl/importance_sampling.py ``compute_tis_weight``,
training/utils/rl/grpo.py ``make_grpo_loss_fn``). The cookbook works on one response at a time (a 1-D tensor, no
padding inside it); this port takes one response per call too. Quirks kept: the per-token log-ratio is clamped to
[-20, 20] BEFORE the sequence-level geometric mean; the KL penalty term uses the detached current logprobs (it
changes the loss value, never the gradient); the loss is a token SUM; ``ppo_clip_frac`` counts ``clip(r) != r``.
"""

from __future__ import annotations

import numpy as np

SAFETY_CLAMP = 20.0


def compute_tis_weight(resp_prox, resp_inf, tis_cap=5.0, tis_level="token"):
    """Port of importance_sampling.compute_tis_weight -> (weight, metrics)."""
    tis_log = np.clip(np.asarray(resp_prox, np.float64) - np.asarray(resp_inf, np.float64), -SAFETY_CLAMP,
                      SAFETY_CLAMP)
    if tis_level == "sequence":
        tis_raw = np.broadcast_to(np.exp(tis_log.mean()), tis_log.shape)
    else:
        tis_raw = np.exp(tis_log)
    tis_weight = np.clip(tis_raw, 0.0, tis_cap)
    metrics = {"tis/weight_mean": float(tis_weight.mean()), "tis/clip_frac": float(np.mean(tis_weight != tis_raw))}
    if tis_level == "sequence":
        metrics["tis/seq_ratio"] = float(tis_raw[0]) if tis_raw.size else 1.0
    return tis_weight, metrics


def grpo_response_loss(resp_pi, resp_prox, resp_inf, adv, eps_clip=0.2, eps_clip_high=None, tis_cap=5.0,
                       tis_level="token"):
    """One response's contribution to make_grpo_loss_fn's total (kl_beta 0): sum of
    max(-r*A, -clip(r)*A) * tis_weight with r = exp(clamp(pi - prox)); returns (loss, ppo clip fraction)."""
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = np.exp(np.clip(np.asarray(resp_pi, np.float64) - np.asarray(resp_prox, np.float64), -SAFETY_CLAMP,
                           SAFETY_CLAMP))
    clipped = np.clip(ratio, 1.0 - eps_clip, 1.0 + eps_high)
    weight, _ = compute_tis_weight(resp_prox, resp_inf, tis_cap, tis_level)
    per_token = np.maximum(-ratio * adv, -clipped * adv) * weight
    return float(per_token.sum()), float(np.mean(clipped != ratio))
