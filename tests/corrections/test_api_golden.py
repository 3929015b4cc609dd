"""Float64 golden tests for public functions that otherwise only have doctests: ``unbounded_ratios``, the verl
parsers (``verl_importance``, ``verl_rejection_rules``, ``from_verl``), ``check_batch`` and ``config_from_dict``.

References follow the formulas of ../shared/reference/corrections.md (sections 1, 2 and 7), written in NumPy.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import corrections
from corrections import CorrectionConfig, ImportanceWeights, Objective, RejectionRule

SAFETY = 20.0  # every log-ratio (and per-sequence sum / mean) is clamped to [-20, 20] before exp
NAN = np.nan

# three rows: a plain one, one past the clamp (token 25, sum 23, mean 11.5), an empty one; padding holds NaN
LOG_RATIO = np.float32([[0.3, -0.5, 0.7, NAN], [25.0, -2.0, NAN, NAN], [NAN, NAN, NAN, NAN]])
MASK = np.float32([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])


def per_row_ratios(level):
    """``unbounded_ratios`` is per sequence ([T], module docs of corrections/_weights.py): vmapped over the rows."""
    return np.asarray(jax.vmap(lambda lr, m: corrections.unbounded_ratios(lr, m, level))(LOG_RATIO, MASK))


def unbounded_reference(log_ratio, mask, level):
    """NumPy float64: exp(clamp(lr)) per token, exp(clamp(sum_t m*lr)) or exp(clamp(masked_mean(lr))) per row."""
    lr, m = np.asarray(log_ratio, np.float64), np.asarray(mask, bool)
    if level == "token":
        return np.exp(np.clip(lr, -SAFETY, SAFETY))
    total = np.where(m, lr, 0.0).sum(-1)
    stat = total if level == "sequence" else total / np.maximum(m.sum(-1), 1)
    return np.broadcast_to(np.exp(np.clip(stat, -SAFETY, SAFETY))[:, None], lr.shape)


# --------------------------------------------------------------------------------------------- unbounded_ratios
def test_unbounded_ratios_token_level():
    """Token level is exp(clamp(lr)) at every valid position, exp(20) past the clamp."""
    got = per_row_ratios("token")
    want = unbounded_reference(LOG_RATIO, MASK, "token")
    valid = MASK > 0
    np.testing.assert_allclose(got[valid], want[valid], rtol=1e-6)
    assert got[1, 0] == pytest.approx(np.exp(20.0), rel=1e-6)


@pytest.mark.parametrize("level, row_values", [
    ("sequence", [np.exp(0.5), np.exp(20.0), 1.0]),  # sums 0.5, 23 (clamped), empty
    ("geometric", [np.exp(0.5 / 3), np.exp(11.5), 1.0]),  # means 0.5/3, 11.5, empty
])
def test_unbounded_ratios_sequence_levels_ignore_nan_padding(level, row_values):
    """Sequence / geometric ratios are the row's clamped sum / mean over valid tokens, broadcast to every position
    (padding too); NaN in padding never leaks, an empty row gives 1."""
    got = per_row_ratios(level)
    want = unbounded_reference(LOG_RATIO, MASK, level)
    np.testing.assert_allclose(want[:, 0], row_values, rtol=1e-12)
    np.testing.assert_allclose(got, want, rtol=1e-6)


# --------------------------------------------------------------------------------------------- verl parsers
@pytest.mark.parametrize("args, want", [
    (("token", 2.0), ImportanceWeights("token", high=2.0, low=0.0, overflow="truncate")),
    (("sequence", "5"), ImportanceWeights("sequence", high=5.0, low=0.0, overflow="truncate")),
    (("token", " 0.5_5.0 ", True), ImportanceWeights("token", high=5.0, low=0.5, overflow="mask",
                                                     batch_normalize=True)),
    (("sequence", "0.25_4"), ImportanceWeights("sequence", high=4.0, low=0.25, overflow="mask")),
    ((None, 2.0), None),
    (("token", None), None),
])
def test_verl_importance_threshold_syntaxes(args, want):
    """A bare number truncates at it (TIS); "lo_up" is IcePop (weight 0 outside [lo, up]); None disables."""
    assert corrections.verl_importance(*args) == want


@pytest.mark.parametrize("args, match", [
    (("geometric", 2.0), "rollout_is='geometric' is not an option"),
    (("token", "2_1"), "lower bound 2.0 exceeds upper bound 1.0"),
    (("token", 0), "thresholds must be positive"),
    (("token", True), "not a bool"),
    (("token", "two"), "is not a number"),
])
def test_verl_importance_rejects_bad_settings(args, match):
    """Bad verl settings raise a ValueError that names the field."""
    with pytest.raises(ValueError, match=match):
        corrections.verl_importance(*args)


@pytest.mark.parametrize("rs, threshold, want", [
    ("token_k1", 2.0, [("token_k1", 0.5, 2.0)]),  # a bare k1 up means [1/up, up]
    ("seq_mean_k1", "1.001", [("seq_mean_k1", 1 / 1.001, 1.001)]),
    ("seq_max_k3", 0.01, [("seq_max_k3", None, 0.01)]),
    ("token_k1,seq_sum_k1", "0.5_2.0", [("token_k1", 0.5, 2.0), ("seq_sum_k1", 0.5, 2.0)]),  # one entry for all
    ("seq_mean_k1, token_k2, seq_mean_k1", "0.9_1.1, 0.5",  # duplicates dropped, order kept
     [("seq_mean_k1", 0.9, 1.1), ("token_k2", None, 0.5)]),
])
def test_verl_rejection_rule_syntaxes(rs, threshold, want):
    """verl's rollout_rs comma lists with a float, a "lo_up" string, or one threshold per rule."""
    rules = corrections.from_verl(rollout_rs=rs, rollout_rs_threshold=threshold).rejection
    assert [(r.name, r.low, r.high) for r in rules] == [(n, pytest.approx(lo) if lo else lo, hi) for n, lo, hi in want]


def test_verl_rejection_rules_inverted_and_errors():
    """reproduce_inverted_k1 maps "lo_up" to verl's (1/up, 1/lo); k3 "lo_up", count mismatches, outlier, missing
    thresholds raise ValueError."""
    (rule,) = corrections.verl_rejection_rules("seq_sum_k1", "0.5_4.0", reproduce_inverted_k1=True)
    assert (rule.low, rule.high) == (0.25, 2.0)
    (rule,) = corrections.verl_rejection_rules("seq_sum_k1", "0.5_4.0")
    assert (rule.low, rule.high) == (0.5, 4.0)
    for rs, threshold, match in [("seq_mean_k3", "0.1_0.2", "k2/k3 rules take one upper bound"),
                                 ("token_k1,seq_mean_k3", "0.5_2,0.1,0.2", "3 entries for 2 rules"),
                                 ("outlier", 2.0, "'outlier' is not an option"),
                                 ("token_k1", None, "rollout_rs_threshold is required")]:
        with pytest.raises(ValueError, match=match):
            corrections.verl_rejection_rules(rs, threshold)


def test_from_verl_builds_the_whole_config():
    """from_verl sets the mode, verl's PPO with dual clip 3, the kept-count denominator, weights and rules (bypass
    PPO-clip applies no weights, as verl's ``compute_policy_loss_bypass_mode``)."""
    got = corrections.from_verl(rollout_is="sequence", rollout_is_threshold="3.0", rollout_rs="seq_mean_k1",
                                rollout_rs_threshold="0.99_1.01", bypass_mode=True, clip_ratio_high=0.28)
    ppo = Objective("ppo", clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    assert got == CorrectionConfig(mode="bypass", objective=ppo, importance=None,
                                   rejection=(RejectionRule("seq_mean_k1", 0.99, 1.01),), denominator="kept")
    assert corrections.from_verl(rollout_is="token", rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001") \
        == corrections.preset("decoupled_geo_rs_token_tis")
    assert corrections.from_verl(bypass_mode=True, loss_type="reinforce").objective == Objective("reinforce")
    with pytest.raises(ValueError, match="needs bypass_mode=True"):
        corrections.from_verl(loss_type="reinforce")


# --------------------------------------------------------------------------------------------- check_batch
def test_check_batch_passes_nan_in_padding():
    """NaN / inf where the mask is 0 are fine, in rollout_logprobs and in any named logprob array."""
    assert corrections.check_batch(np.float32([[1, 1, 0]]), rollout_logprobs=np.float32([[-1.0, -2.0, NAN]]),
                                   proximal_logprobs=np.float32([[-1.0, -1.0, np.inf]])) is None


@pytest.mark.parametrize("mask, arrays, match", [
    ([[1, 2, 0]], {}, "mask must hold only 0 and 1"),
    ([[1, 0.5, 0]], {}, "mask must hold only 0 and 1"),
    ([[1, 1, 0]], {"rollout_logprobs": [[-1.0, NAN, NAN]]}, "rollout_logprobs must be finite where the mask is 1"),
    ([[1, 1, 0]], {"proximal_logprobs": [[-np.inf, -1.0, 0.0]]}, "proximal_logprobs must be finite where the mask"),
])
def test_check_batch_raises(mask, arrays, match):
    """A mask value other than 0/1, or a non-finite logprob inside the mask, raises naming the array."""
    with pytest.raises(AssertionError, match=match):
        corrections.check_batch(np.float32(mask), **{k: np.float32(v) for k, v in arrays.items()})


def test_compute_checks_values_on_eager_calls_by_default():
    """Eager ``compute`` rejects a mask of 2 and NaN inside the mask; ``check_values=False`` and jit skip the check;
    ``check_values=True`` under ``chex.chexify`` runs it inside jit."""
    import chex

    lp, bad_mask, roll = np.float32([[-1.0, -2.0]]), np.float32([[1, 2]]), np.float32([[-1.0, NAN]])
    run = lambda mask, roll=None, **cfg: corrections.compute(  # noqa: E731
        lp, np.ones(1, np.float32), mask, CorrectionConfig(**cfg), proximal_logprobs=lp, rollout_logprobs=roll)
    with pytest.raises(AssertionError, match="mask must hold only 0 and 1"):
        run(bad_mask)
    with pytest.raises(AssertionError, match="rollout_logprobs must be finite where the mask is 1"):
        run(np.float32([[1, 1]]), roll)
    run(bad_mask, check_values=False)
    jax.jit(lambda m: run(m).loss)(bad_mask)
    checked = chex.chexify(jax.jit(lambda m: run(m, check_values=True).loss), async_check=False)
    with pytest.raises(AssertionError, match="mask must hold only 0 and 1"):
        checked(bad_mask)


# --------------------------------------------------------------------------------------------- config dicts
def contained(part, whole) -> bool:
    """Whether every leaf of the nested plain data ``part`` is in ``whole`` with the same value."""
    if isinstance(part, dict):
        return isinstance(whole, dict) and all(k in whole and contained(v, whole[k]) for k, v in part.items())
    if isinstance(part, list):
        return isinstance(whole, list) and len(part) == len(whole) and all(map(contained, part, whole))
    return part == whole


@pytest.mark.parametrize("name", sorted(corrections.PRESETS))
def test_config_dict_round_trip_for_every_preset(name):
    """config_to_dict gives JSON-able plain data holding every value the preset set; config_from_dict inverts it."""
    config = corrections.preset(name)
    data = json.loads(json.dumps(corrections.config_to_dict(config)))
    assert contained(corrections.PRESETS[name], data)
    assert corrections.config_from_dict(data) == config


@pytest.mark.parametrize("data, match", [
    ({"clip": 0.2}, r"^config: unknown field\(s\) clip; known: check_values, denominator,"),
    ({"objective": {"name": "ppo", "eps": 0.2}}, r"^objective: unknown field\(s\) eps; known: clip_cov_high,"),
    ({"importance": {"level": "token", "cap": 2.0}}, r"^importance: unknown field\(s\) cap; known: batch_normalize,"),
    ({"rejection": [{"name": "token_k1", "hi": 2.0}]}, r"^rejection: unknown field\(s\) hi; known: high, low, name"),
    ({"importance": {"level": "tokens"}}, r"^importance.level='tokens' is not an option"),
])
def test_config_from_dict_names_the_bad_field(data, match):
    """An unknown key (at any level) or a bad value raises a ValueError naming the field."""
    with pytest.raises(ValueError, match=match):
        corrections.config_from_dict(data)
