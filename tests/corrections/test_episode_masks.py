"""Episodes' masks: environment tokens inside a sequence (observations between policy turns, mask 0) count in no
denominator or sequence statistic. Two checks per preset: the corrections on the episode equal those on the same
batch with the environment tokens removed (policy tokens only, padded at the end), and the sequence-level weights
and rejections equal the NumPy float64 references (tests/support/corrections_reference.py) under the episode's mask."""

import numpy as np
import pytest

import corrections
from tests.support import corrections_reference as ref

B, T = 6, 24
PRESETS = ["decoupled_token_is", "decoupled_seq_is", "decoupled_geo_rs_seq_tis", "decoupled_k3_rs_token_tis",
           "bypass_pg_geo_rs_seq_tis", "skyrl_geometric_mask", "slime_opsm", "token_truncate", "sequence_mask"]
GARBAGE = 1e3  # in the environment tokens' logprobs: anything they leaked into would change the result


def episode_batch(seed: int):
    """A batch of episodes: prompt, then policy turns with observations (mask 0) between them, then padding; the
    policy tokens' per-token versions differ per turn (a publish between turns)."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((B, T), np.float32)
    lag = np.zeros((B, T), np.float32)
    for row in range(B):
        position = int(rng.integers(1, 4))  # the prompt
        for turn in range(int(rng.integers(1, 4))):
            length = int(rng.integers(1, 5))
            mask[row, position:position + length] = 1.0
            lag[row, position:position + length] = 2 - turn  # turn 0 is the oldest policy's
            position += length + int(rng.integers(1, 4))  # the observation after the turn
            if position >= T - 4:
                break
    rollout = rng.normal(-1.5, 0.5, (B, T)).astype(np.float32)
    proximal = (rollout + rng.normal(0, 0.15, (B, T))).astype(np.float32)
    current = (proximal + rng.normal(0, 0.05, (B, T))).astype(np.float32)
    advantages = np.repeat(rng.normal(0, 1, (B, 1)), T, axis=1).astype(np.float32)
    hole = mask == 0
    for array in (rollout, proximal, current):
        array[hole] = GARBAGE
    return current, advantages * mask, mask, proximal, rollout, lag * mask


def compacted(arrays, mask):
    """Each row's policy tokens moved to the front (in order), zeros after: the batch without its observations."""
    out = []
    for array in arrays:
        packed = np.zeros_like(array)
        for row in range(B):
            kept = array[row][mask[row] == 1]
            packed[row, :kept.size] = kept
        out.append(packed)
    return out


@pytest.mark.parametrize("preset", PRESETS)
def test_environment_tokens_count_in_no_denominator_or_sequence_statistic(preset):
    current, advantages, mask, proximal, rollout, lag = episode_batch(seed=0)
    config = corrections.preset(preset)
    episode = corrections.compute(current, advantages, mask, config, proximal_logprobs=proximal,
                                  rollout_logprobs=rollout, policy_lag=lag)
    packed = compacted([current, advantages, mask, proximal, rollout, lag], mask)
    policy_only = corrections.compute(packed[0], packed[1], packed[2], config, proximal_logprobs=packed[3],
                                      rollout_logprobs=packed[4], policy_lag=packed[5])
    np.testing.assert_allclose(float(episode.loss), float(policy_only.loss), rtol=1e-5, atol=1e-6)
    assert float(episode.loss_denominator) == float(policy_only.loss_denominator) <= mask.sum()
    for name, value in episode.metrics.items():
        np.testing.assert_allclose(float(value), float(policy_only.metrics[name]), rtol=1e-4, atol=1e-5,
                                   err_msg=name)
    kept = mask == 1
    np.testing.assert_allclose(np.asarray(episode.weights)[kept], np.asarray(policy_only.weights)[packed[2] == 1],
                               rtol=1e-5, atol=1e-6)
    assert (np.asarray(episode.weights)[~kept] == 0).all() and (np.asarray(episode.per_token_loss)[~kept] == 0).all()


@pytest.mark.parametrize("seed", [0, 1])
def test_sequence_weights_of_episodes_equal_the_float64_references_under_the_episode_mask(seed):
    current, _, mask, proximal, rollout, _ = episode_batch(seed)
    log_ratio = np.where(mask == 1, proximal.astype(np.float64) - rollout, 0.0)
    weights = corrections.ImportanceWeights
    for level, reference in (("sequence", ref.sequence_tis(log_ratio, mask, high=2.0)),
                             ("geometric", ref.geometric_weight(log_ratio, mask, high=2.0))):
        config = corrections.CorrectionConfig(importance=weights(level=level, high=2.0))
        out = corrections.compute(current, np.zeros(B), mask, config, proximal_logprobs=proximal,
                                  rollout_logprobs=rollout)
        np.testing.assert_allclose(np.asarray(out.weights), reference, rtol=1e-5, atol=1e-6, err_msg=level)
