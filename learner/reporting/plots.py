"""Learning curves of a run, as one PNG, from its JSONL metrics.

Draws with matplotlib's Agg canvas directly (no pyplot, no global backend), so it works headless and inside
the training process.
"""

from __future__ import annotations

import io
import math
import os
import pathlib
from collections.abc import Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from learner.reporting.metrics_writers import read_metrics
from learner.reporting.run_files import write_atomically

# (panel title, metrics drawn in it); a panel none of whose metrics were logged is left out.
DEFAULT_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward/mean",)),
    ("train/rollout mismatch", ("rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/chi2_token")),
    ("clip fraction", ("actor/pg_clipfrac", "actor/pg_clipfrac_lower")),
    ("rejection fraction", ("rollout_corr/rollout_rs_masked_fraction", "rollout_corr/rollout_rs_seq_masked_fraction")),
    ("truncation bias (RAW logprobs)", ("sampler/log_kept_mass_mean", "sampler/log_kept_mass_min")),
)


def plot_learning_curves(
    metrics_path: str | os.PathLike,
    png_path: str | os.PathLike,
    panels: Sequence[tuple[str, Sequence[str]]] = DEFAULT_PANELS,
    columns: int = 2,
    dpi: int = 100,
) -> pathlib.Path:
    """Plots metrics against step, one panel per group, and saves the figure as a PNG.

    Args:
      metrics_path: a JSONL metrics file (``JsonlWriter``'s).
      png_path: where to write the PNG (parent directories are created).
      panels: ``(title, metric names)`` per panel; panels with none of their metrics logged are left out.
      columns: panels per row, at most.
      dpi: pixels per inch; each panel is 5 x 3.5 inches.

    Returns:
      ``png_path``. Raises ValueError if no panel has data.
    """
    records = read_metrics(metrics_path)
    present = [(title, [k for k in keys if any(k in r for r in records)]) for title, keys in panels]
    present = [(title, keys) for title, keys in present if keys]
    if not present:
        raise ValueError(f"none of the plotted metrics is in {metrics_path}")
    columns = min(columns, len(present))
    rows = math.ceil(len(present) / columns)
    figure = Figure(figsize=(5 * columns, 3.5 * rows), dpi=dpi, layout="constrained")
    FigureCanvasAgg(figure)
    for position, (title, keys) in enumerate(present, start=1):
        axes = figure.add_subplot(rows, columns, position)
        for key in keys:
            points = np.array([(r["step"], r[key]) for r in records if key in r], np.float64)
            axes.plot(points[:, 0], points[:, 1], label=key.split("/", 1)[-1])
        axes.set_title(title)
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    png_path = pathlib.Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    image = io.BytesIO()
    figure.savefig(image, format="png")
    write_atomically(png_path, image.getvalue())  # never through a link; a reader never sees half a PNG
    return png_path
