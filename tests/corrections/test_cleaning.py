"""The per-sequence pass cleans raw inputs itself (step 1): per-sequence advantages are broadcast per row, padding
may hold anything, and a KL or entropy term appears only when configured. Results must not depend on any of it."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import corrections
from corrections import CorrectionConfig, ImportanceWeights, Objective, RejectionRule

B, T = 6, 9
CONFIGS = {
    "ppo_tis_geo": CorrectionConfig(
        objective=Objective("ppo", dual_clip=3.0), importance=ImportanceWeights("token", high=2.0),
        rejection=(RejectionRule("geometric", 0.9, 1.1),),
    ),
    "bypass_kl_entropy": CorrectionConfig(mode="bypass", kl_coef=0.1, entropy_coef=0.01,
                                          importance=ImportanceWeights("sequence", high=5.0, batch_normalize=True)),
    "kl_cov": CorrectionConfig(objective=Objective("kl_cov", kl_cov_ratio=0.2)),
}


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    lengths = np.array([0, 1, 4, 9, 7, 3])
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
    old = rng.uniform(-3, -0.1, (B, T)).astype(np.float32)
    arrays = dict(lp=old + rng.normal(0, 0.05, (B, T)), old=old, roll=old + rng.normal(0, 0.05, (B, T)),
                  ref=old + rng.normal(0, 0.1, (B, T)), entropy=rng.uniform(0, 2, (B, T)))
    return {k: v.astype(np.float32) for k, v in arrays.items()}, rng.normal(size=B).astype(np.float32), mask


def _dirty(x, mask):
    return np.where(mask > 0, x, np.float32(np.nan)).astype(np.float32)


def _run(config, arrays, adv, mask, rows_per_chunk):
    fn = jax.jit(lambda a, adv, m: corrections.compute(
        a["lp"], adv, m, config, proximal_logprobs=a["old"], rollout_logprobs=a["roll"], ref_logprobs=a["ref"],
        entropy=a["entropy"] if config.entropy_coef > 0 else None, rows_per_chunk=rows_per_chunk))
    return jax.tree.map(np.asarray, fn(arrays, adv, mask))


@pytest.mark.parametrize("rows_per_chunk", [4, 0])
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.slow  # 27 s on a quiet 2-core run: out of the default run's 15 minutes
def test_sequence_advantages_and_dirty_padding_give_identical_outputs(name, rows_per_chunk):
    config = CONFIGS[name]
    arrays, adv, mask = _batch()
    clean = _run(config, arrays, adv, mask, rows_per_chunk)
    dirty = {k: _dirty(v, mask) for k, v in arrays.items()}
    token_adv = _dirty(np.broadcast_to(adv[:, None], (B, T)), mask)
    got = _run(config, dirty, token_adv, mask, rows_per_chunk)
    # The two inputs compile to different programs (the dirty one has extra selects), so XLA may order a reduction
    # differently: values agree to float32 rounding (a few ulp), not bit for bit. Padding garbage leaking in would
    # be NaN or O(1) off; the masks, 0/1, must agree exactly.
    np.testing.assert_array_equal(got.mask, clean.mask)
    for field in ("weights", "per_token_loss", "loss", "loss_numerator", "loss_denominator"):
        np.testing.assert_allclose(getattr(got, field), getattr(clean, field), rtol=1e-6, atol=1e-7, err_msg=field)
    assert got.metrics.keys() == clean.metrics.keys()
    for key, value in clean.metrics.items():
        np.testing.assert_allclose(got.metrics[key], value, rtol=1e-6, atol=1e-7, err_msg=key)
    assert np.all(np.isfinite(got.per_token_loss)) and np.all(got.per_token_loss[mask == 0] == 0)
    assert got.mask.dtype == np.float32 and np.all(got.mask <= mask)
