"""Learning-curve plots: a real PNG of the expected size, and an error when nothing can be drawn."""

import matplotlib.image
import numpy as np
import pytest

from learner.reporting.metrics_writers import JsonlWriter, read_metrics
from learner.reporting.plots import learning_curves_figure, plot_learning_curves


def test_writes_a_png_of_the_panels(tmp_path):
    writer = JsonlWriter(tmp_path / "metrics.jsonl")
    for step in range(30):
        metrics = {
            "reward/mean": 1 - np.exp(-step / 10),
            "rollout_corr/kl": 1e-3 * np.cos(step),
            "rollout_corr/chi2_token": 2e-3,
            "actor/pg_clipfrac": 0.1,
        }
        if step % 2:  # logged every other step only: a partial series
            metrics["rollout_corr/rollout_rs_masked_fraction"] = 0.01 * step
        writer.write(step, metrics)
    writer.close()
    png = plot_learning_curves(tmp_path / "metrics.jsonl", tmp_path / "plots" / "curves.png", dpi=50)
    assert png.stat().st_size > 10_000
    image = matplotlib.image.imread(png)
    assert image.shape == (2 * 3.5 * 50, 2 * 5 * 50, 4)  # 4 panels on 2 columns: 2 rows of 5 x 3.5 inches
    assert image[..., :3].std() > 0.05  # not a blank canvas


def test_leaves_out_panels_without_data(tmp_path):
    writer = JsonlWriter(tmp_path / "metrics.jsonl")
    for step in range(5):
        writer.write(step, {"reward/mean": step / 5})
    writer.close()
    png = plot_learning_curves(tmp_path / "metrics.jsonl", tmp_path / "curves.png", dpi=50)
    assert matplotlib.image.imread(png).shape == (3.5 * 50, 5 * 50, 4)  # one panel, one column


def test_nothing_to_plot(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "other": 1.0}\n')
    with pytest.raises(ValueError, match="none of the plotted metrics"):
        plot_learning_curves(tmp_path / "metrics.jsonl", tmp_path / "curves.png")


def _write(path, records):
    writer = JsonlWriter(path)
    for step, metrics in enumerate(records, start=1):
        writer.write(step, metrics)
    writer.close()


def test_panels_that_are_zero_at_every_step_are_left_out_and_multi_turn_is_drawn(tmp_path):
    """A preset without rejection logs its rejection fractions as 0 at every step, a run without tool errors its
    error count: neither gets a panel. Turns and tool calls per episode do."""
    _write(tmp_path / "metrics.jsonl", [
        {"reward/mean": step / 40, "rollout_corr/rollout_rs_masked_fraction": 0.0, "multiturn/turns_mean": 2.0,
         "multiturn/tool_calls_mean": min(1.0, step / 20), "multiturn/tool_errors": 0.0} for step in range(40)])
    records = read_metrics(tmp_path / "metrics.jsonl")
    titles = [axes.get_title() for axes in learning_curves_figure(records).axes]
    assert titles == ["reward", "multi-turn (per episode)"]
    png = plot_learning_curves(tmp_path / "metrics.jsonl", tmp_path / "curves.png", dpi=50)
    assert matplotlib.image.imread(png).shape == (3.5 * 50, 2 * 5 * 50, 4)  # 2 panels: one row of two


def test_a_reward_of_zero_at_every_step_keeps_its_panel():
    """A reward of 0 throughout is a result (a random checkpoint on GSM8K), not a metric never logged."""
    records = [{"step": step, "reward/mean": 0.0, "rollout_corr/rollout_rs_masked_fraction": 0.0,
                "eval/reward_mean": 0.0} for step in range(1, 4)]
    panels = (("reward", ("reward/mean",)), ("rejection fraction", ("rollout_corr/rollout_rs_masked_fraction",)),
              ("validation", ("eval/reward_mean",)))
    assert [axes.get_title() for axes in learning_curves_figure(records, panels).axes] == ["reward", "validation"]


def test_one_spike_does_not_flatten_the_mismatch_panel(tmp_path):
    """chi2 ~2e-3 for 100 steps and 40.0 at one: the panel's range is that of the other values (the spike is
    marked on its edge and counted in the legend); a smooth series keeps matplotlib's own range."""
    rng = np.random.default_rng(0)
    chi2 = 2e-3 + 2e-4 * rng.standard_normal(100)
    chi2[37] = 40.0
    _write(tmp_path / "metrics.jsonl", [{"reward/mean": step / 100, "rollout_corr/chi2_token": float(value)}
                                        for step, value in enumerate(chi2)])
    records = read_metrics(tmp_path / "metrics.jsonl")
    reward_axes, mismatch_axes = learning_curves_figure(records).axes
    low, high = mismatch_axes.get_ylim()
    typical = np.delete(chi2, 37)
    assert low <= typical.min() and typical.max() <= high < 0.01  # unclipped, the top would be 40
    assert "chi2_token: 1 off scale (40)" in [text.get_text() for text in mismatch_axes.get_legend().get_texts()]
    assert reward_axes.get_ylim()[1] >= 0.99  # rising 0 -> 0.99: nothing set aside
    png = plot_learning_curves(tmp_path / "metrics.jsonl", tmp_path / "curves.png", dpi=50)
    assert png.stat().st_size > 10_000
