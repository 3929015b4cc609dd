"""Partial rollouts side by side: the same run with ``rollout.partial`` on and off, over the same number of samples.

Runs ``configs/partial_rollouts.toml`` (a task with a long tail of completion lengths) twice at the same time, as
``python -m learner.train`` subprocesses, with ``rollout.partial = true`` and ``false``: both see the same machine
load (on a shared machine it changes over minutes). ``--repeats N`` does it N times. Prints, per run, the samples
trained per second of the RL loop (over its steps' wall time, warm-up and start-up excluded; and the median of the
steps' own rates, which a compile inside one step does not move), the reward of the first and last 20 steps,
``rollout/partial_fraction`` (mean), ``rollout/versions_per_sample_max`` (max), the per-token staleness (mean), the
samples dropped as stale, the mean seconds of a step's phases (update, publish, rollout wait), whether every
metric was finite, and the policy's reward: the exact expected reward of the run's last checkpoint on 4,096 fixed
prompts of the task (`policy_reward`).

The reward columns are noisy: two runs of one config differ by up to 0.06 in reward of the last 20 steps, which
samples the policy on the same 160 prompts. ``policy_reward`` is computed, not sampled: on an exact-match task
(reward 1 for the answer then eos, the `TextTask` rule) a sample's expected reward is the probability of that
completion, `learner.logprobs.completions`. Two runs of one config differ there by ~0.01.

    python -m scripts.bench.partial [--steps 80] [--repeats 1] [--out DIR] [--set KEY=VALUE ...]
    python -m scripts.bench.partial --summarize DIR   # the table again, from the run directories in DIR
"""

from __future__ import annotations

import argparse
import math
import pathlib
import subprocess
import sys
import tempfile

import jax
import numpy as np

from learner.checkpoints.reading import checkpoint_policy, choose_checkpoint
from learner.logprobs.completions import completion_logprobs
from learner.logprobs.sampler_replay import truncates
from learner.reporting.metrics_writers import read_metrics
from learner.tasks import TextTask, load_task
from scripts.bench.common import REPO_ROOT, checkout_env

CONFIG = REPO_ROOT / "configs" / "partial_rollouts.toml"
LAST = 20  # steps averaged for the reward at the start and at the end
EVAL_PROMPTS = 4096  # prompts of the exact policy reward, drawn as the task draws its prompts,
EVAL_SEED = 20261128  # from this seed: the same in every run
COLUMNS = ("samples_per_s", "median_samples_per_s", "reward_first", "reward_last", "policy_reward", "partial_fraction",
           "versions_max", "staleness_mean", "stale_dropped", "update_s", "publish_s", "rollout_wait_s", "loop_s",
           "all_finite")


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


def policy_reward(run_dir: pathlib.Path) -> float:
    """The exact expected reward of the run's newest verified checkpoint on `EVAL_PROMPTS` prompts: the mean
    probability of each prompt's demonstration (answer then eos) at the run's temperature. Exact per prompt for a
    `TextTask` (reward 1 for that completion alone) and a sampler without top-k, top-p or min-p; the prompts are a
    sample of the task's (about 60% of them are one of the ten one-digit strings in configs/partial_rollouts.toml)."""
    model, config = checkpoint_policy(choose_checkpoint(run_dir / "checkpoints", None))
    rollout = config["rollout"]
    if truncates(rollout["top_k"], rollout["top_p"], rollout["min_p"]):
        raise SystemExit(f"{run_dir}: policy_reward needs a sampler without top-k, top-p or min-p (it is the "
                         "probability of the answer under softmax(logits / temperature))")
    task = load_task(config["task"]["name"], config["task"]["args"])
    if not isinstance(task, TextTask):
        raise SystemExit(f"{run_dir}: policy_reward needs an exact-match TextTask, not {type(task).__name__}")
    max_new_tokens = rollout["max_new_tokens"] or task.max_completion_tokens
    rng = np.random.default_rng(EVAL_SEED)
    prompts = [task.make_prompt(rng)[0] for _ in range(EVAL_PROMPTS)]
    answers = [task.demonstration(prompt) for prompt in prompts]
    probabilities = np.exp(completion_logprobs(model, prompts, answers, temperature=rollout["temperature"]))
    fits = np.array([answer.size <= max_new_tokens for answer in answers])  # a longer answer is cut: reward 0
    return float(np.mean(np.where(fits, probabilities, 0.0)))


def print_run(name: str, run_dir: pathlib.Path, widths: dict) -> None:
    """One run's row of the table, its columns `COLUMNS`: its metrics' `summary` and its `policy_reward`."""
    result = summary(read_metrics(run_dir / "metrics.jsonl")) | {"policy_reward": policy_reward(run_dir)}
    print(f"{name:>16}" + "".join(
        f"{str(result[c]):>{widths[c]}}" if isinstance(result[c], bool) else f"{result[c]:>{widths[c]}.4g}"
        for c in COLUMNS), flush=True)


def start(run_dir: pathlib.Path, partial: bool, steps: int, overrides: list[str]) -> subprocess.Popen:
    """Starts one training run; its output (progress bars included) goes to ``run_dir``/train.log."""
    sets = [f"rollout.partial={str(partial).lower()}", f"loop.steps={steps}", *overrides]
    command = [sys.executable, "-m", "learner.train", "--config", str(CONFIG), "--run-dir", str(run_dir),
               *[arg for item in sets for arg in ("--set", item)]]
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "train.log", "wb") as log:
        return subprocess.Popen(command, cwd=REPO_ROOT, env=checkout_env(), stdout=log, stderr=subprocess.STDOUT)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.partial",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=80, help="RL steps of each run")
    parser.add_argument("--repeats", type=int, default=1, help="alternate the two settings this many times")
    parser.add_argument("--out", type=pathlib.Path, help="where the run directories go (default: a temporary one)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for both runs")
    parser.add_argument("--summarize", type=pathlib.Path, metavar="DIR",
                        help="run nothing: print the table of the run directories (partial=*) in DIR")
    args = parser.parse_args(argv)
    # this process computes policy_reward on the CPU: on an accelerator it would take memory the runs need
    jax.config.update("jax_platforms", "cpu")
    widths = {name: max(10, len(name) + 2) for name in COLUMNS}
    print(f"{'run':>16}" + "".join(f"{name:>{widths[name]}}" for name in COLUMNS), flush=True)
    if args.summarize:
        run_dirs = sorted(path for path in args.summarize.glob("partial=*") if path.is_dir())
        if not run_dirs:
            raise SystemExit(f"{args.summarize}: no run directory partial=* in it")
        for run_dir in run_dirs:
            print_run(run_dir.name, run_dir, widths)
        return
    out = args.out or pathlib.Path(tempfile.mkdtemp(prefix="bench-partial-"))
    for repeat in range(args.repeats):
        runs = {partial: (out / f"partial={str(partial).lower()}-{repeat}") for partial in (True, False)}
        processes = {partial: start(run_dir, partial, args.steps, args.set) for partial, run_dir in runs.items()}
        for partial, process in processes.items():
            if process.wait():
                raise SystemExit(f"the run with rollout.partial={str(partial).lower()} failed "
                                 f"(exit {process.returncode}; its output: {runs[partial] / 'train.log'})")
        for partial, run_dir in runs.items():
            print_run(f"partial={str(partial).lower()}", run_dir, widths)


if __name__ == "__main__":
    main()
