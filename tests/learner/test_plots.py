"""Learning-curve plots: a real PNG of the expected size, and an error when nothing can be drawn."""

import matplotlib.image
import numpy as np
import pytest

from learner.reporting.metrics_writers import JsonlWriter
from learner.reporting.plots import plot_learning_curves


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
