"""scripts/bench/mismatch_study.py: its summaries against hand-computed values, and the --quick grid end to end."""

import doctest
import json
import math
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from learner.reporting.metrics_writers import read_metrics
from learner.rl import load_config
from scripts.bench import mismatch_study as study

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_docstring_examples():
    assert doctest.testmod(study).failed == 0  # scripts/ is not collected, so its doctests run here


def records(rewards, **extra):
    return [{"step": step, "reward/mean": reward, **{k: v[step - 1] for k, v in extra.items()}}
            for step, reward in enumerate(rewards, start=1)]


def test_summary_of_a_learning_run():
    rewards = [0.1, 0.2, 0.3, 0.5, 0.7, 0.8, 0.9, 0.9]
    summary = study.summarize(records(rewards, **{"rollout_corr/kl": [0.01] * 4 + [0.03] * 4}), target=0.6)
    trailing = [np.mean(rewards[max(0, i - 4):i + 1]) for i in range(len(rewards))]  # 5-step trailing means
    assert summary["start_reward"] == pytest.approx(0.2)
    assert summary["final_reward"] == pytest.approx(np.mean(rewards[-5:]))
    assert summary["best_reward"] == pytest.approx(max(trailing))
    assert summary["steps_to_target"] == 1 + next(i for i, m in enumerate(trailing) if m >= 0.6)  # == 6
    assert summary["collapsed"] is False
    assert summary["kl"] == pytest.approx(0.02) and summary["chi2"] is None and summary["log_kept_mass"] is None


def test_summary_flags_collapse_and_non_finite_losses():
    collapsed = study.summarize(records([0.3, 0.6, 0.8, 1.0, 0.9, 0.9, 0.9, 0.5, 0.3, 0.2, 0.1, 0.1]), target=0.7)
    assert collapsed["collapsed"] and collapsed["steps_to_target"] == 5  # trailing means 0.675 then 0.72
    stalled = study.summarize(records([0.3] * 10))
    assert not stalled["collapsed"] and stalled["steps_to_target"] is None
    exploded = study.summarize(records([0.3] * 4, **{"actor/pg_loss": [0.1, 0.1, math.nan, 0.1]}))
    assert exploded["collapsed"]


def test_aggregate_and_table():
    runs = [study.summarize(records([0.3, 0.7, 0.9, 1.0, 1.0]), target=0.7),  # trailing means .3 .5 .633 .725
            study.summarize(records([0.2, 0.2, 0.2, 0.2, 0.2]), target=0.7)]
    row = study.aggregate(runs)
    finals = [0.78, 0.2]
    assert row["final_reward"] == pytest.approx(np.mean(finals))
    assert row["final_reward_sd"] == pytest.approx(np.std(finals))
    assert (row["reached_target"], row["steps_to_target"], row["collapsed"]) == (1, 4.0, 0)
    table = study.markdown_table({("bf16", "none"): row}, target=0.7)
    assert "| bf16 | none | 0.417 | 0.490 ± 0.290 | 4 (1/2) | 0/2 |" in table


def test_cells_isolate_their_source_and_correction():
    """A source's overrides replace every mismatch setting of the base config (here bf16_server.toml's)."""
    cell = study.Cell("staleness_2", "cispo", seed=3)
    config = load_config(REPO_ROOT / "configs" / "bf16_server.toml", cell.overrides())
    assert (config.server.dtype, config.rollout.max_staleness, config.rollout.top_p) == ("float32", 2, 1.0)
    assert (config.corrections.preset, config.corrections.overrides, config.loop.seed) == (
        "skyrl_cispo", {"mode": "bypass"}, 3)
    raw = load_config(None, study.Cell("top_p_raw", "none", seed=0).overrides())
    assert (raw.rollout.logprob_mode, raw.rollout.top_p, raw.corrections.preset) == ("raw", 0.9, "disabled")


@pytest.mark.slow  # several real runs (minutes on 2 cores): run with `pytest -m slow`
def test_quick_study_end_to_end(tmp_path):
    """Ten real runs (every source x two corrections), then a rerun that only re-reads the finished runs."""
    command = [sys.executable, "-m", "scripts.bench.mismatch_study", "--quick", "--out", str(tmp_path), "--parallel",
               "2"]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["failed_runs"] == []
    rows = {(r["source"], r["correction"]): r for r in results["results"]}
    assert set(rows) == {(s, c) for s in ("staleness_0", "bf16", "staleness_2", "staleness_4", "top_p_raw")
                         for c in ("none", "geo_rs_token_tis")}
    for row in rows.values():
        assert row["runs"][0]["steps"] == 3 and 0 <= row["final_reward"] <= 1
    for correction in ("none", "geo_rs_token_tis"):
        # Float32 synchronous: no mismatch, no staleness. bf16 server: a real logprob mismatch.
        assert abs(rows["staleness_0", correction]["kl"]) < 1e-5 and rows["staleness_0", correction]["staleness"] == 0
        bf16 = read_metrics(tmp_path / "runs" / "bf16" / correction / "seed_0" / "metrics.jsonl")
        assert min(r["rollout_corr/logprob_abs_diff_mean"] for r in bf16) > 1e-4
        # Async: the third step trains on samples two versions old.
        stale = read_metrics(tmp_path / "runs" / "staleness_2" / correction / "seed_0" / "metrics.jsonl")
        assert [r["rollout_corr/staleness_mean"] for r in stale] == [0, 1, 2]  # exactly (fixed_staleness)
        # The trap: RAW ratios of truncated sampling show no mismatch; the truncation diagnostic does.
        trap = rows["top_p_raw", correction]
        assert abs(trap["kl"]) < 1e-5 and trap["log_kept_mass"] < -0.01
    assert rows["bf16", "geo_rs_token_tis"]["seq_rejected"] > 0 and rows["bf16", "none"]["seq_rejected"] == 0
    for source in ("staleness_0", "bf16", "staleness_2", "staleness_4", "top_p_raw"):
        assert (tmp_path / f"{source}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| top_p_raw | geo_rs_token_tis |" in (tmp_path / "results.md").read_text()

    rerun = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert not re.search(r"^\[\d+/10\]", rerun.stdout, re.MULTILINE)  # no run finished again: nothing ran
    assert json.loads((tmp_path / "results.json").read_text())["results"] == results["results"]
