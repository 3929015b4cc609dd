"""``tis_clipfrac`` counts truncated weights: with no importance weights configured it is 0, however far the ratios
are from 1 (it read 0.81-0.98 in a from_verl run without truncated IS: issue 50)."""

import numpy as np

from corrections import CorrectionConfig, ImportanceWeights, compute

P = "rollout_corr/"


def test_no_weights_means_nothing_clipped_and_truncation_still_counts():
    rng = np.random.default_rng(0)
    lp = -rng.uniform(0.5, 3.0, (4, 6))
    roll = lp + rng.normal(0, 0.5, lp.shape)  # ratios far from 1
    mask = np.ones_like(lp)
    advantages = rng.normal(size=4)
    plain = compute(lp, advantages, mask, CorrectionConfig(), proximal_logprobs=lp, rollout_logprobs=roll)
    assert float(plain.metrics[P + "tis_clipfrac"]) == 0.0
    truncated = compute(lp, advantages, mask, CorrectionConfig(importance=ImportanceWeights("token", high=1.2)),
                        proximal_logprobs=lp, rollout_logprobs=roll)
    want = np.mean(np.exp(lp - roll) > 1.2)
    assert want > 0.1
    np.testing.assert_allclose(float(truncated.metrics[P + "tis_clipfrac"]), want, rtol=1e-6)
