"""Console output of a run: a one-line progress bar with live metrics, and a summary table at the end.

On a terminal the bar redraws in place; otherwise (logs, CI) it prints one line every ``every`` steps, so that
output stays readable when redirected.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

# (label, metric key, format) of the live fields; missing metrics are left out.
LIVE_FIELDS = (
    ("reward", "reward/mean", "{:.3f}"),
    ("kl(k3)", "rollout_corr/k3_kl", "{:.1e}"),  # the non-negative estimator of the train/rollout KL
    ("lp_diff", "rollout_corr/logprob_abs_diff_mean", "{:.1e}"),
    ("clip", "actor/pg_clipfrac", "{:.3f}"),
    ("lag", "rollout_corr/staleness_mean", "{:.2f}"),
    ("kept", "rollout/kept_fraction", "{:.2f}"),  # share of the step's samples trained on (the rest dropped)
    ("tok/s", "perf/tokens_per_s", "{:.0f}"),
)


class ProgressBar:
    """``[#####.....] 30/60 reward 0.512 kl(k3) 1.2e-04 ... kept 1.00 ... 1.8 step/s``.

    Args:
        total: last step of the run.
        start: steps already done (a resumed run).
        stream: where to draw (default stderr).
        every: when not drawing on a terminal, print every this many steps.
    """

    def __init__(self, total: int, start: int = 0, stream: TextIO | None = None, every: int = 10, width: int = 24):
        self.total, self.start, self.every, self.width = total, start, every, width
        self.stream = stream or sys.stderr
        self.interactive = self.stream.isatty()
        self.started = time.monotonic()

    def line(self, step: int, metrics: Mapping[str, float]) -> str:
        """The bar's text at ``step``."""
        filled = round(self.width * step / self.total)
        fields = [f"{label} {fmt.format(metrics[key])}" for label, key, fmt in LIVE_FIELDS if key in metrics]
        rate = (step - self.start) / max(time.monotonic() - self.started, 1e-9)
        return (f"[{'#' * filled}{'.' * (self.width - filled)}] {step}/{self.total} " + " ".join(fields)
                + f" {rate:.2f} step/s")

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.interactive:
            self.stream.write("\r\033[K" + self.line(step, metrics))
            self.stream.flush()
        elif step % self.every == 0 or step == self.total:
            print(self.line(step, metrics), file=self.stream, flush=True)

    def close(self) -> None:
        if self.interactive:
            self.stream.write("\n")
            self.stream.flush()


def summary_table(rows: Sequence[tuple[str, str]]) -> str:
    """A two-column text table.

    >>> print(summary_table([("steps", "60"), ("reward", "0.31 -> 0.93")]))
    +--------+--------------+
    | steps  | 60           |
    | reward | 0.31 -> 0.93 |
    +--------+--------------+
    """
    left = max(len(name) for name, _ in rows)
    right = max(len(value) for _, value in rows)
    rule = f"+{'-' * (left + 2)}+{'-' * (right + 2)}+"
    return "\n".join([rule, *(f"| {name:<{left}} | {value:<{right}} |" for name, value in rows), rule])
