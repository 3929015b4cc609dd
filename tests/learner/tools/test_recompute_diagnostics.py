"""learner/tools/recompute_diagnostics.py on a small rollout log: the values equal the corrections' own."""


import jax
import numpy as np
import pytest

import corrections
from learner.reporting.metrics_writers import read_metrics
from learner.reporting.rollout_log import RolloutLogWriter
from learner.tools import recompute_diagnostics
from tests.learner.reporting.test_rollout_log import make_batch

PRESET = "decoupled_token_is"
VERSION_KEYS = {"rollout/partial_fraction", "rollout/versions_per_sample_max", "rollout_corr/staleness_mean",
                "rollout_corr/staleness_max"}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A log of two batches with T = 7, padded to the log's max_length 12 (one compiled program per check)."""
    path = tmp_path_factory.mktemp("run")
    batches = [make_batch(step, rows=4, length=7) for step in (10, 11)]
    with RolloutLogWriter(path / "rollout_log", max_length=12) as writer:
        for batch in batches:
            writer.append(batch)
    return path, batches


def test_mismatch_metrics_equal_the_corrections(run_dir, capsys):
    path, batches = run_dir
    recompute_diagnostics.main([str(path), "--jsonl", str(path / "diagnostics.jsonl")])
    records = read_metrics(path / "diagnostics.jsonl")
    assert [r["step"] for r in records] == [10, 11]
    mismatch_metrics = jax.jit(corrections.mismatch_metrics)
    for record, batch in zip(records, batches):
        expected = mismatch_metrics(batch.proximal_logprobs, batch.rollout_logprobs, batch.loss_mask)
        assert set(record) == {"step", *expected, *VERSION_KEYS}
        np.testing.assert_allclose([record[k] for k in expected], [float(v) for v in expected.values()], rtol=1e-6)
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["step", "kl", "k3_kl", "chi2_tok", "chi2_seq", "lp_diff", "partial", "versions",
                                "stale"]
    assert [line.split()[0] for line in table[1:]] == ["10", "11"]
    assert float(table[1].split()[1]) == pytest.approx(records[0]["rollout_corr/kl"], rel=1e-3)


def test_preset_metrics_equal_compute(run_dir):
    path, batches = run_dir
    records = recompute_diagnostics.recompute(path, preset=PRESET)

    @jax.jit
    def expected_metrics(proximal, rollout, mask, advantages):
        return corrections.compute(proximal, advantages, mask, corrections.preset(PRESET),
                                   proximal_logprobs=proximal, rollout_logprobs=rollout).metrics

    for record, batch in zip(records, batches):
        expected = expected_metrics(batch.proximal_logprobs, batch.rollout_logprobs, batch.loss_mask, batch.advantages)
        assert "rollout_corr/rollout_is_mean" in expected
        np.testing.assert_allclose([record[k] for k in expected], [float(v) for v in expected.values()], rtol=1e-6)


def test_partial_rollout_statistics_equal_a_float64_reference(run_dir):
    """The logged batches' rows hold tokens of up to three versions (`make_batch`): the share of rows drawn by more
    than one, the most versions in a row, and the trained tokens' staleness (learner version - token version)."""
    path, batches = run_dir
    for record, batch in zip(recompute_diagnostics.recompute(path), batches):
        mask = batch.loss_mask.astype(np.float64)
        trained = [np.unique(v[m > 0]) for v, m in zip(batch.policy_version, mask) if m.any()]
        lag = (batch.learner_version - batch.policy_version.astype(np.float64)) * mask
        assert record["rollout/partial_fraction"] == pytest.approx(np.mean([v.size > 1 for v in trained]), rel=1e-12)
        assert record["rollout/versions_per_sample_max"] == max(v.size for v in trained)
        assert record["rollout_corr/staleness_mean"] == pytest.approx(lag.sum() / mask.sum(), rel=1e-6)
        assert record["rollout_corr/staleness_max"] == lag[mask > 0].max()
