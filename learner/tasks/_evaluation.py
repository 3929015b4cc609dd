"""Evaluation metrics of scored completions: mean rewards and pass@k over groups of samples per prompt."""

from __future__ import annotations

import numpy as np

from learner.tasks._rewards import RewardScores


def pass_at_k(correct, k: int) -> float:
    """The unbiased pass@k estimate (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"), averaged
    over prompts: for each prompt, the probability that at least one of ``k`` samples drawn without replacement from
    its ``n`` samples is correct, ``1 - C(n - c, k) / C(n, k)`` with ``c`` of them correct.

    Args:
      correct: bool ``[prompts, n]``: whether each sample is correct; ``n >= k``.
      k: samples per attempt.

    >>> pass_at_k([[True, False, False, False], [False] * 4], k=1)  # (1/4 + 0) / 2
    0.125
    >>> pass_at_k([[True, False, False, False], [False] * 4], k=4)
    0.5
    """
    correct = np.asarray(correct, bool)
    if correct.ndim != 2 or not 1 <= k <= correct.shape[1]:
        raise ValueError(f"pass_at_k: need correct of shape [prompts, n] with n >= k={k}, got {correct.shape}")
    n, c = correct.shape[1], correct.sum(axis=1)
    # C(n - c, k) / C(n, k) = prod_{i = n - c + 1}^{n} (1 - k / i): no large binomials.
    fail = [np.prod(1.0 - k / np.arange(n - ci + 1, n + 1)) if n - ci >= k else 0.0 for ci in c]
    return float(np.mean(1.0 - np.asarray(fail)))


def evaluation_metrics(scores: RewardScores, num_samples: int, success_threshold: float = 1.0,
                       prefix: str = "eval") -> dict[str, float]:
    """Metrics of ``num_samples`` consecutive samples per prompt (``scores`` of ``prompts * num_samples``):

    ``{prefix}/reward_mean`` (over scored samples), ``{prefix}/{label}/mean`` per reward,
    ``{prefix}/skipped_samples``, and ``{prefix}/pass@1`` and ``{prefix}/pass@{num_samples}``, a sample being
    correct when its total reward is at least ``success_threshold`` (a skipped sample is not).

    >>> from learner.tasks import RewardScores
    >>> scores = RewardScores(np.array([1, 0, 0, 0], np.float32), {"gsm8k": np.array([1, 0, 0, 0], np.float32)}, [])
    >>> metrics = evaluation_metrics(scores, num_samples=2)  # prompt 0: one of 2 correct; prompt 1: none
    >>> metrics["eval/reward_mean"], metrics["eval/gsm8k/mean"], metrics["eval/pass@1"], metrics["eval/pass@2"]
    (0.25, 0.25, 0.25, 0.5)
    """
    total = np.asarray(scores.total, np.float64)
    if total.size % num_samples:
        raise ValueError(f"{total.size} samples are not groups of num_samples={num_samples}")
    correct = (np.nan_to_num(total, nan=-np.inf) >= success_threshold).reshape(-1, num_samples)
    out = scores.metrics(prefix)
    out[f"{prefix}/reward_mean"] = float(np.nanmean(total)) if np.isfinite(total).any() else float("nan")
    for k in sorted({1, num_samples}):
        out[f"{prefix}/pass@{k}"] = pass_at_k(correct, k)
    return out
