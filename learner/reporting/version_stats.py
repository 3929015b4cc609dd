"""How many policy versions drew each trained sample: the statistics of partial rollouts (``rollout.partial``).

A sample kept running across a publish holds tokens of several versions, each stamped by the engine. These
functions read the per-token versions of a trained batch (``[B, T]``, the loss mask saying which tokens count: a
multi-turn episode's observations carry no version of their own), for the run's metrics and for
``python -m learner.tools.recompute_diagnostics`` on a rollout log.
"""

from __future__ import annotations

import numpy as np


def versions_per_row(policy_version, loss_mask) -> np.ndarray:
    """int64 ``[B]``: the distinct versions among each row's trained tokens (0 for a row with none).

    >>> versions_per_row(np.array([[3, 3, 4, 0], [5, 5, 5, 9]]), np.array([[1, 1, 1, 0], [1, 1, 1, 0]])).tolist()
    [2, 1]
    """
    versions, trained = np.asarray(policy_version), np.asarray(loss_mask) != 0
    return np.array([np.unique(row[mask]).size for row, mask in zip(versions, trained)], np.int64)


def version_metrics(policy_version, loss_mask) -> dict[str, float]:
    """``rollout/partial_fraction``: the share of rows (with a trained token) drawn by more than one version;
    ``rollout/versions_per_sample_max``: the most versions that drew one row.

    >>> version_metrics(np.array([[3, 3, 4], [5, 5, 5], [0, 0, 0]]), np.array([[1, 1, 1], [1, 1, 0], [0, 0, 0]]))
    {'rollout/partial_fraction': 0.5, 'rollout/versions_per_sample_max': 2.0}
    """
    counts = versions_per_row(policy_version, loss_mask)
    counts = counts[counts > 0]
    if not counts.size:
        return {}
    return {"rollout/partial_fraction": float(np.mean(counts > 1)),
            "rollout/versions_per_sample_max": float(counts.max())}
