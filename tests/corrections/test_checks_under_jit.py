"""``compute`` as a library under a plain ``jax.jit``: the documented value checks fail at trace time naming the fix
(check_values=True without chex.chexify), a mask that is not 0/1 poisons the loss (default checks), and extreme but
finite rollout logprobs keep every metric finite."""

import dataclasses

import chex
import jax
import numpy as np
import pytest

import corrections

LP = np.log(np.full((2, 4), 0.5, np.float32))
MASK = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], np.int32)
ADV = np.array([1.0, -1.0], np.float32)


def _loss(config):
    return jax.jit(lambda lp, mask: corrections.compute(lp, ADV, mask, config, proximal_logprobs=LP,
                                                        rollout_logprobs=LP).loss)


def test_check_values_true_under_plain_jit_fails_at_trace_time_naming_chexify():
    checked = dataclasses.replace(corrections.preset("decoupled_token_is"), check_values=True)
    with pytest.raises(RuntimeError, match=r"check_values=True checks traced values only inside chex.chexify: wrap "
                                         r"the jitted function, chex.chexify\(jax.jit\(f\), async_check=False\)"):
        _loss(checked)(LP, MASK)
    bad = MASK.copy()
    bad[0, 1] = 2
    with pytest.raises(AssertionError, match="mask must hold only 0 and 1"):  # the documented way still works
        chex.chexify(_loss(checked), async_check=False)(LP, bad)


def test_a_mask_not_0_or_1_makes_the_loss_nan_under_jit_with_the_default_checks():
    config = corrections.preset("decoupled_token_is")
    eager = corrections.compute(LP, ADV, MASK, config, proximal_logprobs=LP, rollout_logprobs=LP).loss
    np.testing.assert_allclose(_loss(config)(LP, MASK), eager, rtol=1e-6)
    for value in (2, -1):
        bad = MASK.copy()
        bad[1, 2] = value
        assert np.isnan(_loss(config)(LP, bad))
    with pytest.raises(AssertionError, match="mask must hold only 0 and 1; first bad value 2"):  # eager: raised
        corrections.compute(LP, ADV, np.where(MASK == 1, 2, 0), config, proximal_logprobs=LP, rollout_logprobs=LP)


@pytest.mark.parametrize("preset", ["decoupled_token_is", "bypass_ppo_clip", "decoupled_geo_rs"])
def test_extreme_rollout_logprobs_keep_every_metric_finite(preset):
    config = corrections.preset(preset)
    run = jax.jit(lambda roll: corrections.compute(LP, ADV, MASK, config, proximal_logprobs=LP,
                                                   rollout_logprobs=roll).metrics)
    extreme, floor = LP.copy(), LP.copy()
    extreme[0, :3], floor[0, :3] = -3e38, corrections.METRIC_LOGPROB_FLOOR
    metrics = run(extreme)
    assert [name for name, value in metrics.items() if not np.isfinite(value)] == []
    expected = run(floor)  # below the floor counts as the floor
    for name, value in metrics.items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-6, err_msg=name)
    assert float(metrics["rollout_corr/kl"]) == pytest.approx(-(1e4 + np.log(0.5)) * 3 / 7, rel=1e-5)
