"""Corrections of partial rollouts: rows whose tokens were drawn by several policy versions, each token with its own
behaviour logprob and version, against the float64 NumPy reference.

A mixed row's behaviour policy is the one that actually drew it: token t from version v_t, so its probability is
the product of each token's probability under its own version. Token-level weights use each token's logprob as it
is; the sequence-level ones (sequence TIS, geometric weights and rejection) multiply (or average, in log space) the
per-token ratios, which is that product: the weight of a row equals the product of its version segments' own
weights. OPSM reads no behaviour logprob. Staleness is per token: the oldest token is the row's largest lag
(docs/corrections.md, "Partial rollouts").
"""

import functools

import numpy as np
import pytest

import corrections
from corrections import CorrectionConfig, ImportanceWeights
from tests.corrections.test_golden import as64, check_compute, close, dirty, same

B, T = 8, 12  # test_golden's shapes: the same compiled programs
LEARNER_VERSION = 8
# Per row: first token, length, and the version spans [start, end) relative to the first token.
ROWS = [
    (0, 10, [(0, 10, 7)]),  # one version
    (1, 11, [(0, 3, 5), (3, 7, 6), (7, 11, 7)]),  # three: a sample across two publishes
    (0, 12, [(0, 8, 6), (8, 12, 7)]),
    (3, 9, [(0, 2, 5), (2, 9, 7)]),  # a publish fell inside, one version skipped
    (0, 0, []),  # empty
    (5, 1, [(0, 1, 7)]),
    (2, 6, [(0, 3, 6), (3, 6, 7)]),
    (0, 12, [(0, 12, 6)]),
]
# The older the version, the further its logprobs from the proximal policy's (old - behaviour, mean and noise).
MISMATCH = {5: (0.05, 0.05), 6: (0.02, 0.03), 7: (0.002, 0.01)}


@functools.cache
def mixed_batch(seed: int = 0):
    """``(jax inputs, float64 reference inputs, versions, per-version behaviour logprobs)``, in `test_golden`'s
    layout: rollout logprobs taken, token by token, from the version that drew the token."""
    rng = np.random.default_rng(seed)
    m = np.zeros((B, T), np.float32)
    versions = np.full((B, T), -1)
    for b, (first, length, spans) in enumerate(ROWS):
        m[b, first:first + length] = 1
        for start, end, version in spans:
            versions[b, first + start:first + end] = version
    old = -rng.uniform(0.05, 3.0, (B, T))
    behaviour = {v: old - rng.normal(mean, noise, (B, T)) for v, (mean, noise) in MISMATCH.items()}
    roll = np.where(versions >= 0, np.choose(np.clip(versions - 5, 0, 2), [behaviour[5], behaviour[6], behaviour[7]]),
                    old)
    lp = old + rng.normal(0.0, 0.05, (B, T))
    adv = rng.normal(0.0, 1.0, B)
    adv[1] = -0.8  # OPSM looks at negative rows
    lag = np.where(versions >= 0, LEARNER_VERSION - versions, 0)
    jx = {k: dirty(v, m) for k, v in dict(roll=roll, old=old, lp=lp).items()}
    jx |= {"adv": np.float32(adv), "m": m}
    n = {k: as64(np.where(m.astype(bool), np.float32(v), 0.0)) for k, v in dict(roll=roll, old=old, lp=lp).items()}
    n |= {"adv": as64(adv), "m": m.astype(bool), "lag": lag, "lr": n["old"] - n["roll"]}
    return (jx, n), versions, {v: as64(np.float32(x)) for v, x in behaviour.items()}


# Token-level, sequence-level and geometric weights and rejections, OPSM, AReaL's behaviour-weight mask.
PRESETS = ("decoupled_token_is", "decoupled_seq_is", "decoupled_seq_is_rs", "decoupled_geo_rs_token_tis",
           "slime_opsm", "areal_decoupled_ppo")


@pytest.mark.parametrize("name", PRESETS)
def test_presets_on_mixed_version_rows_equal_the_float64_reference(name):
    """Weights, masks, per-token loss, loss and every metric, staleness per token included."""
    data, _, _ = mixed_batch()
    check_compute(corrections.preset(name), data)


def segment_log_ratios(row: int, behaviour) -> list[np.ndarray]:
    """Row ``row``'s per-token log-ratios old - behaviour, one array per version span, each from its own version's
    logprobs (independently of how the batch's rollout logprobs were assembled)."""
    (_, n), _, _ = mixed_batch()
    first = ROWS[row][0]
    return [n["old"][row, first + start:first + end] - behaviour[version][row, first + start:first + end]
            for start, end, version in ROWS[row][2]]


@pytest.mark.parametrize("row", [1, 2, 3])
def test_sequence_weight_of_a_mixed_row_is_the_product_of_its_version_segments(row):
    """Sequence IS (unbounded) = prod over segments of pi_old / pi_v of that segment; geometric = their log-mean.
    A single behaviour policy per sample (the newest version's logprobs for every token) gives another number."""
    (j, n), _, behaviour = mixed_batch()
    segments = segment_log_ratios(row, behaviour)
    for level, expected in (("sequence", np.exp(sum(s.sum() for s in segments))),
                            ("geometric", np.exp(np.concatenate(segments).mean()))):
        out = corrections.compute(j["lp"], j["adv"], j["m"], CorrectionConfig(importance=ImportanceWeights(
            level, high=None)), proximal_logprobs=j["old"], rollout_logprobs=j["roll"])
        valid = n["m"][row]
        close(np.asarray(out.weights)[row][valid], np.full(valid.sum(), expected), rtol=2e-5, what=level)
        newest = n["old"][row][valid] - behaviour[7][row][valid]
        one_policy = np.exp(newest.sum()) if level == "sequence" else np.exp(newest.mean())
        assert abs(one_policy / expected - 1) > 1e-3, "the segments' versions should matter in this batch"


def test_opsm_reads_no_behaviour_logprob():
    """OPSM's decision (mean advantage < 0 and mean old - lp > delta) is the same whichever versions drew a row."""
    (j, n), _, behaviour = mixed_batch()
    cfg = corrections.preset("slime_opsm")
    run = lambda roll: corrections.compute(j["lp"], j["adv"], j["m"], cfg, proximal_logprobs=j["old"],  # noqa: E731
                                           rollout_logprobs=roll)
    same(run(j["roll"]).mask, run(dirty(behaviour[5], j["m"])).mask, what="OPSM mask")


def test_staleness_is_per_token_and_the_oldest_token_is_the_rows_largest_lag():
    (j, n), versions, _ = mixed_batch()
    lag = n["lag"]
    metrics = corrections.staleness_metrics(lag, j["m"])
    valid = n["m"]
    close(metrics["rollout_corr/staleness_mean"], lag[valid].mean())
    close(metrics["rollout_corr/staleness_max"], LEARNER_VERSION - versions[valid].min())
    assert metrics["rollout_corr/staleness_max"] == 3  # row 1's first tokens, version 5
