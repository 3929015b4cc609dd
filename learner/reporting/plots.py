"""Learning curves of a run, as one PNG, from its JSONL metrics.

Draws with matplotlib's Agg canvas directly (no pyplot, no global backend), so it works headless and inside
the training process. A panel whose metrics were never logged, or, but for the reward and validation panels (a reward
of 0 is a result), are zero at every step (rejection in a preset without rejection, tool errors in a run without any),
is left out. Each panel's y range is that of its typical
values (`robust_limits`): a few spikes do not flatten the rest; they are drawn as markers at the panel's edge.
"""

from __future__ import annotations

import io
import math
import os
import pathlib
from collections.abc import Mapping, Sequence

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
    ("multi-turn (per episode)", ("multiturn/turns_mean", "multiturn/tool_calls_mean")),
    ("tool errors (per step)", ("multiturn/tool_errors",)),
)
SHOWN_AT_ZERO = frozenset({"reward", "validation"})  # panels kept when their metrics are 0 at every step
SPIKE_SHARE = 0.02  # at most this share of a panel's values (one, in a short run) at each end may be off scale
FLATTENING = 10.0  # ... and only when drawing them would squeeze the other values into a tenth of the panel


def robust_limits(values: np.ndarray) -> tuple[float, float] | None:
    """The y range of a panel that a few spikes cannot flatten, or None where none would (matplotlib's own range).

    The typical values are those left once the most extreme `SPIKE_SHARE` (at least one) at each end are set aside;
    when the whole range is over `FLATTENING` times theirs, the range is theirs widened by their own span on each
    side (values there are still drawn), and the values beyond it are off scale.

    >>> robust_limits(np.array([0.0, 0.2, 0.5, 0.9, 1.0]))  # a rising reward: nothing off scale
    >>> robust_limits(np.array([1e-3, 2e-3, 2e-3, 3e-3, 5.0]))  # one chi2 spike
    (0.001, 0.004)
    """
    values = np.sort(values[np.isfinite(values)])
    if values.size < 5:
        return None
    low = np.percentile(values, 100 * SPIKE_SHARE, method="higher")
    high = np.percentile(values, 100 * (1 - SPIKE_SHARE), method="lower")
    if values[-1] - values[0] <= FLATTENING * (high - low):
        return None
    span = high - low
    return float(max(values[0], low - span)), float(min(values[-1], high + span))


def _padded(low: float, high: float) -> tuple[float, float]:
    pad = 0.05 * (high - low) or 0.05 * abs(high) or 1e-12
    return low - pad, high + pad


def _mark_off_scale(axes, steps: np.ndarray, values: np.ndarray, limits: tuple[float, float], color: str,
                    name: str) -> None:
    """Values beyond ``limits`` as triangles on the panel's edge, counted in the legend with the extreme one."""
    for beyond, edge, marker, extreme in ((values > limits[1], limits[1], "^", np.max),
                                          (values < limits[0], limits[0], "v", np.min)):
        if beyond.any():
            axes.plot(steps[beyond], np.full(beyond.sum(), edge), marker, color=color, clip_on=False,
                      label=f"{name}: {beyond.sum()} off scale ({extreme(values[beyond]):.3g})")


def learning_curves_figure(records: Sequence[Mapping[str, float]],
                           panels: Sequence[tuple[str, Sequence[str]]] = DEFAULT_PANELS, columns: int = 2,
                           dpi: int = 100) -> Figure:
    """The figure of `plot_learning_curves` for metric records (``{"step": ..., name: value}``).

    Raises:
      ValueError: no panel has data.
    """
    series = {key: np.array([(r["step"], r[key]) for r in records if key in r], np.float64).reshape(-1, 2)
              for _, keys in panels for key in keys}
    present = []
    for title, keys in panels:
        keys = [key for key in keys if len(series[key])]
        if keys and (title in SHOWN_AT_ZERO or any(np.any(series[key][:, 1] != 0) for key in keys)):
            present.append((title, keys))
    if not present:
        raise ValueError("none of the plotted metrics is in the records (or all are zero)")
    columns = min(columns, len(present))
    rows = math.ceil(len(present) / columns)
    figure = Figure(figsize=(5 * columns, 3.5 * rows), dpi=dpi, layout="constrained")
    FigureCanvasAgg(figure)
    for position, (title, keys) in enumerate(present, start=1):
        axes = figure.add_subplot(rows, columns, position)
        limits = robust_limits(np.concatenate([series[key][:, 1] for key in keys]))
        for key in keys:
            steps, values = series[key].T
            (line,) = axes.plot(steps, values, label=key.split("/", 1)[-1])
            if limits is not None:
                _mark_off_scale(axes, steps, values, limits, line.get_color(), key.split("/", 1)[-1])
        if limits is not None:
            axes.set_ylim(*_padded(*limits))
        axes.set_title(title)
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    return figure


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
      panels: ``(title, metric names)`` per panel; panels whose metrics were not logged, or are all zero, are left
        out.
      columns: panels per row, at most.
      dpi: pixels per inch; each panel is 5 x 3.5 inches.

    Returns:
      ``png_path``. Raises ValueError if no panel has data.
    """
    try:
        figure = learning_curves_figure(read_metrics(metrics_path), panels, columns, dpi)
    except ValueError:
        raise ValueError(f"none of the plotted metrics is in {metrics_path} (or all are zero)") from None
    png_path = pathlib.Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    image = io.BytesIO()
    figure.savefig(image, format="png")
    write_atomically(png_path, image.getvalue())  # never through a link; a reader never sees half a PNG
    return png_path
