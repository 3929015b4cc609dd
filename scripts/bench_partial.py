"""Partial rollouts side by side: the same run with ``rollout.partial`` on and off, over the same number of samples.

Runs ``configs/partial_rollouts.toml`` (a task with a long tail of completion lengths) twice at the same time, as
``python -m learner.train`` subprocesses, with ``rollout.partial = true`` and ``false``: both see the same machine
load (on a shared machine it changes over minutes). ``--repeats N`` does it N times. Prints, per run, the samples
trained per second of the RL loop (over its steps' wall time, warm-up and start-up excluded; and the median of the
steps' own rates, which a compile inside one step does not move), the reward of the first and last 20 steps,
``rollout/partial_fraction`` (mean), ``rollout/versions_per_sample_max`` (max), the per-token staleness (mean), the
samples dropped as stale, the mean seconds of a step's phases (update, publish, rollout wait), and whether every
metric was finite.

    python scripts/bench_partial.py [--steps 80] [--repeats 1] [--out DIR] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import math
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from learner.reporting.metrics_writers import read_metrics  # noqa: E402

CONFIG = REPO_ROOT / "configs" / "partial_rollouts.toml"
LAST = 20  # steps averaged for the reward at the start and at the end


def summary(records: list[dict]) -> dict[str, float]:
    """The side-by-side numbers of one run's ``metrics.jsonl`` records."""
    def series(key):
        return np.array([r[key] for r in records if key in r], np.float64)

    samples, step_s = series("rollout/samples"), series("perf/step_s")
    # a run without partial rollouts logs neither key: none of its samples holds two versions
    partial, versions = series("rollout/partial_fraction"), series("rollout/versions_per_sample_max")
    seconds = step_s.sum()
    finite = all(math.isfinite(v) for r in records for v in r.values() if isinstance(v, float))
    return {"steps": len(records), "samples": samples.sum(), "loop_s": seconds,
            "samples_per_s": samples.sum() / seconds,
            "median_samples_per_s": np.median(samples / step_s),
            "reward_first": series("reward/mean")[:LAST].mean(), "reward_last": series("reward/mean")[-LAST:].mean(),
            "partial_fraction": partial.mean() if partial.size else 0.0,
            "versions_max": versions.max(initial=1.0),
            "staleness_mean": series("rollout_corr/staleness_mean").mean(),
            "stale_dropped": series("buffer/stale_dropped")[-1],
            **{f"{phase}_s": series(f"perf/{phase}_s").mean() for phase in ("update", "publish", "rollout_wait")},
            "all_finite": finite}


def start(run_dir: pathlib.Path, partial: bool, steps: int, overrides: list[str]) -> subprocess.Popen:
    """Starts one training run; its output (progress bars included) goes to ``run_dir``/train.log."""
    sets = [f"rollout.partial={str(partial).lower()}", f"loop.steps={steps}", *overrides]
    command = [sys.executable, "-m", "learner.train", "--config", str(CONFIG), "--run-dir", str(run_dir),
               *[arg for item in sets for arg in ("--set", item)]]
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "train.log", "wb") as log:
        return subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=80, help="RL steps of each run")
    parser.add_argument("--repeats", type=int, default=1, help="alternate the two settings this many times")
    parser.add_argument("--out", type=pathlib.Path, help="where the run directories go (default: a temporary one)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for both runs")
    args = parser.parse_args(argv)
    out = args.out or pathlib.Path(tempfile.mkdtemp(prefix="bench-partial-"))
    columns = ("samples_per_s", "median_samples_per_s", "reward_first", "reward_last", "partial_fraction",
               "versions_max", "staleness_mean", "stale_dropped", "update_s", "publish_s", "rollout_wait_s", "loop_s",
               "all_finite")
    widths = {name: max(10, len(name) + 2) for name in columns}
    print(f"{'run':>16}" + "".join(f"{name:>{widths[name]}}" for name in columns), flush=True)
    for repeat in range(args.repeats):
        runs = {partial: (out / f"partial={str(partial).lower()}-{repeat}") for partial in (True, False)}
        processes = {partial: start(run_dir, partial, args.steps, args.set) for partial, run_dir in runs.items()}
        for partial, process in processes.items():
            if process.wait():
                raise SystemExit(f"the run with rollout.partial={str(partial).lower()} failed "
                                 f"(exit {process.returncode}; its output: {runs[partial] / 'train.log'})")
        for partial, run_dir in runs.items():
            result = summary(read_metrics(run_dir / "metrics.jsonl"))
            print(f"{'partial=' + str(partial).lower():>16}" + "".join(
                f"{str(result[c]):>{widths[c]}}" if isinstance(result[c], bool) else f"{result[c]:>{widths[c]}.4g}"
                for c in columns),
                flush=True)


if __name__ == "__main__":
    main()
