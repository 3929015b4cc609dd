"""scripts/bench_partial.py's summary of one run's metrics records, against the same numbers computed by hand."""

import math
import pathlib
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "scripts"))
from bench_partial import LAST, summary  # noqa: E402


def records(steps: int, partial: bool) -> list[dict]:
    """``steps`` metrics records as a run writes them: 64 samples a step, step times 0.5 s + 0.01 s x step."""
    out = []
    for step in range(1, steps + 1):
        record = {"rollout/samples": 64.0, "perf/step_s": 0.5 + 0.01 * step, "reward/mean": step / 100,
                  "rollout_corr/staleness_mean": 2.0 - 1.0 / step, "buffer/stale_dropped": float(step // 10),
                  "perf/update_s": 0.4, "perf/publish_s": 0.02 * (step % 2), "perf/rollout_wait_s": 0.1}
        if partial:
            record |= {"rollout/partial_fraction": (step % 4 == 0) / 8,
                       "rollout/versions_per_sample_max": 1.0 + (step % 5 == 0)}
        out.append(record)
    return out


def test_the_summary_equals_a_hand_computation():
    steps = 30
    result = summary(records(steps, partial=True))
    seconds = sum(0.5 + 0.01 * s for s in range(1, steps + 1))
    assert result["samples_per_s"] == pytest.approx(64 * steps / seconds, rel=1e-12)
    rates = sorted(64 / (0.5 + 0.01 * s) for s in range(1, steps + 1))
    assert result["median_samples_per_s"] == pytest.approx((rates[14] + rates[15]) / 2, rel=1e-12)
    assert result["reward_first"] == pytest.approx(sum(range(1, LAST + 1)) / 100 / LAST, rel=1e-12)
    assert result["reward_last"] == pytest.approx(sum(range(steps - LAST + 1, steps + 1)) / 100 / LAST, rel=1e-12)
    assert result["partial_fraction"] == pytest.approx(7 / 8 / steps, rel=1e-12)  # 7 steps of 30 at 1/8
    assert result["versions_max"] == 2.0
    assert result["stale_dropped"] == 3.0  # the counter's last value, not a sum
    assert result["update_s"] == pytest.approx(0.4, rel=1e-12)
    assert result["publish_s"] == pytest.approx(0.02 * 15 / steps, rel=1e-12)
    assert result["rollout_wait_s"] == pytest.approx(0.1, rel=1e-12)
    assert result["all_finite"] is True


def test_a_run_without_partial_metrics_reads_as_one_version_and_a_nan_is_flagged():
    result = summary(records(25, partial=False))
    assert result["partial_fraction"] == 0.0 and result["versions_max"] == 1.0
    broken = records(25, partial=False)
    broken[7]["perf/update_s"] = math.nan
    assert summary(broken)["all_finite"] is False
