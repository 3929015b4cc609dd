"""The mismatch study: which off-policy corrections keep RL training stable under a train/inference mismatch.

Every cell of the grid is a real run of the main job (``python -m learner.train`` with its own embedded server) on
the base config, with one mismatch source and one correction set by ``--set`` overrides:

==================  ===================================================================================
source              what differs between the sampler and the learner
==================  ===================================================================================
staleness_0         nothing: float32 server, synchronous (every sample on-policy), the control
bf16                the server computes in bfloat16 against the float32 learner; synchronous
staleness_2 / _4    rollouts sampled exactly 2 / 4 policy versions behind the learner (``fixed_staleness``)
top_p_raw           top-p 0.9 sampling scored with RAW logprobs (the renormalisation trap); synchronous
==================  ===================================================================================

Corrections are `corrections` presets: none (``disabled``: decoupled PPO anchored at the recomputed proximal policy,
no behaviour weight), token_tis, seq_tis, geo_rs, geo_rs_token_tis (verl's ``decoupled_*`` presets, bounds as
shipped), decoupled_ppo (``areal_decoupled_ppo``) and cispo (``skyrl_cispo`` in bypass mode: CISPO's clipped
weight taken against the rollout policy, i.e. off-policy IS).

Each seed's supervised warm-up runs once, in this process, and is exported as a Hugging Face checkpoint that every
run of that seed starts from (``model.hf_path``), so cells differ only in source and correction. The runs share a
persistent XLA compilation cache. Under ``--out``: one PNG per source (reward, KL, chi2 and, for RAW truncated
sampling, the log kept mass over steps; one line per correction, the band spans the seeds), ``results.md`` (the
table) and ``results.json``, and each run's own directory. Rerunning the same command skips finished runs and
resumes unfinished ones from their checkpoints.

    python -m scripts.bench.mismatch_study [--config configs/default.toml] [--out runs/mismatch_study] [--quick]
        [--sources ...] [--corrections ...] [--seeds 0 1] [--steps 40] [--parallel 2] [--set section.field=value]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import subprocess
import sys
import time

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from learner.reporting.metrics_writers import read_metrics
from learner.rl import RunConfig, load_config
from scripts.bench.common import checkout_env

# What every source sets (its own settings replace these), so a base config's choices cannot leak into a source.
NO_MISMATCH = {"server.dtype": "float32", "rollout.max_staleness": 0, "rollout.fixed_staleness": True,
               "rollout.top_p": 1.0, "rollout.logprob_mode": "processed"}
SOURCES = {
    "staleness_0": {},
    "bf16": {"server.dtype": "bfloat16"},
    "staleness_2": {"rollout.max_staleness": 2},
    "staleness_4": {"rollout.max_staleness": 4},
    "top_p_raw": {"rollout.top_p": 0.9, "rollout.logprob_mode": "raw"},
}
# name -> (corrections preset, overrides)
CORRECTIONS = {
    "none": ("disabled", {}),
    "token_tis": ("decoupled_token_is", {}),
    "seq_tis": ("decoupled_seq_is", {}),
    "geo_rs": ("decoupled_geo_rs", {}),
    "geo_rs_token_tis": ("decoupled_geo_rs_token_tis", {}),
    "decoupled_ppo": ("areal_decoupled_ppo", {}),
    "cispo": ("skyrl_cispo", {"mode": "bypass"}),  # the clipped weight is pi / pi_rollout: off-policy IS
}
QUICK = dict(seeds=[0], steps=3, corrections=["none", "geo_rs_token_tis"], warmup_steps=30)

START_STEPS, FINAL_STEPS = 3, 5  # the start reward is the mean of the first 3 steps, the final of the last 5
COLLAPSE_DROP = 0.25  # collapsed: final reward this far below the best 5-step mean (or a non-finite loss)
MISMATCH_METRICS = {"kl": "rollout_corr/kl", "chi2": "rollout_corr/chi2_token",
                    "log_kept_mass": "sampler/log_kept_mass_mean",
                    "seq_rejected": "rollout_corr/rollout_rs_seq_masked_fraction",
                    "staleness": "rollout_corr/staleness_mean"}
PANELS = (("reward", "reward/mean"), ("train/rollout KL", "rollout_corr/kl"),
          ("chi2 (token)", "rollout_corr/chi2_token"), ("log kept mass (RAW, truncated)", "sampler/log_kept_mass_mean"))


@dataclasses.dataclass(frozen=True)
class Cell:
    """One run of the grid."""

    source: str
    correction: str
    seed: int

    def run_dir(self, out: pathlib.Path) -> pathlib.Path:
        return out / "runs" / self.source / self.correction / f"seed_{self.seed}"

    def overrides(self) -> list[str]:
        preset, overrides = CORRECTIONS[self.correction]
        settings = NO_MISMATCH | SOURCES[self.source] | {"corrections.preset": preset,
                                                         "corrections.overrides": overrides, "loop.seed": self.seed}
        return [f"{key}={_toml(value)}" for key, value in settings.items()]


def _toml(value) -> str:
    """A TOML value for ``--set`` (strings quoted, inline tables for dicts)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def warm_start(config: RunConfig, directory: pathlib.Path) -> pathlib.Path:
    """Runs the config's warm-up once and exports the policy as a Hugging Face checkpoint ``directory``."""
    if (directory / "config.json").exists():
        return directory
    from learner.checkpoints.hf_checkpoint import write_hf_checkpoint
    from learner.rl import Trainer
    from learner.tasks import load_task

    trainer = Trainer(config, load_task(config.task.name, config.task.args))
    trainer.load_hf_weights()
    losses = trainer.warm_up()
    print(f"warm start seed {config.loop.seed}: {len(losses)} steps, cross entropy {losses[0]:.3f} -> "
          f"{losses[-1]:.3f}", flush=True)
    return write_hf_checkpoint(directory, trainer.host_weights(), trainer.model_config)  # atomic


def finished(run_dir: pathlib.Path) -> bool:
    """The main loop writes ``process_0.json`` after its last step."""
    return (run_dir / "process_0.json").exists()


def run_grid(cells: list[Cell], command: list[str], out: pathlib.Path, parallel: int,
             warm: dict[int, list[str]]) -> dict[Cell, int]:
    """Runs the cells, ``parallel`` at a time; returns each cell's exit status (0 for runs finished before)."""
    env = checkout_env()  # the runs import this checkout, wherever the study starts
    env.setdefault("PYTHONHASHSEED", "0")  # the update program's serialised form (its cache key) depends on it
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(out / "jax_cache"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    status = {cell: 0 for cell in cells if finished(cell.run_dir(out))}
    pending = [cell for cell in cells if cell not in status]
    running: dict[Cell, tuple[subprocess.Popen, float]] = {}
    while pending or running:
        while pending and len(running) < parallel:
            cell = pending.pop(0)
            run_dir = cell.run_dir(out)
            run_dir.mkdir(parents=True, exist_ok=True)
            args = [*command, *(f"--set={o}" for o in warm[cell.seed] + cell.overrides()), f"--run-dir={run_dir}"]
            with open(run_dir / "train.log", "a") as log:
                running[cell] = (subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env),
                                 time.monotonic())
        time.sleep(0.2)
        for cell, (process, started) in list(running.items()):
            if process.poll() is None:
                continue
            del running[cell]
            status[cell] = process.returncode
            records = read_metrics(cell.run_dir(out) / "metrics.jsonl")
            outcome = (f"final reward {summarize(records)['final_reward']:.3f}" if process.returncode == 0 and records
                       else f"FAILED (exit {process.returncode}, see {cell.run_dir(out) / 'train.log'})")
            print(f"[{len(status)}/{len(cells)}] {cell.source} / {cell.correction} / seed {cell.seed}: {outcome} "
                  f"({time.monotonic() - started:.0f} s)", flush=True)
    return status


def _trailing_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Mean of the last ``window`` values at each step (fewer at the start)."""
    cumulative = np.concatenate([[0.0], np.cumsum(values)])
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    return (cumulative[ends] - cumulative[starts]) / (ends - starts)


def summarize(records: list[dict], target: float = 0.6) -> dict:
    """One run's numbers: start and final reward, steps to target, collapse, mean mismatch metrics.

    >>> records = [{"step": s, "reward/mean": r} for s, r in enumerate([0.2, 0.3, 0.4, 0.8, 0.9, 0.9], 1)]
    >>> summary = summarize(records, target=0.6)
    >>> summary["steps_to_target"], summary["collapsed"], round(summary["final_reward"], 2)
    (6, False, 0.66)
    """
    rewards = np.array([r["reward/mean"] for r in records], np.float64)
    smoothed = _trailing_mean(rewards, FINAL_STEPS)
    reached = np.flatnonzero(smoothed >= target)
    losses = [r.get(key, 0.0) for r in records for key in ("actor/pg_loss", "actor/grad_norm")]
    final = float(np.mean(rewards[-FINAL_STEPS:]))
    summary = {
        "steps": len(records),
        "start_reward": float(np.mean(rewards[:START_STEPS])),
        "final_reward": final,
        "best_reward": float(np.max(smoothed)),
        "steps_to_target": int(records[reached[0]]["step"]) if reached.size else None,
        "collapsed": bool(not np.all(np.isfinite(losses)) or final < np.max(smoothed) - COLLAPSE_DROP),
    }
    for name, key in MISMATCH_METRICS.items():
        values = [r[key] for r in records if key in r]
        summary[name] = float(np.mean(values)) if values else None
    return summary


def aggregate(summaries: list[dict]) -> dict:
    """Over the seeds of one (source, correction): means, spread, collapse and target counts."""
    finals = [s["final_reward"] for s in summaries]
    reached = [s["steps_to_target"] for s in summaries if s["steps_to_target"] is not None]
    row = {"seeds": len(summaries), "start_reward": float(np.mean([s["start_reward"] for s in summaries])),
           "final_reward": float(np.mean(finals)), "final_reward_sd": float(np.std(finals)),
           "reached_target": len(reached), "steps_to_target": float(np.median(reached)) if reached else None,
           "collapsed": sum(s["collapsed"] for s in summaries)}
    for name in MISMATCH_METRICS:
        values = [s[name] for s in summaries if s[name] is not None]
        row[name] = float(np.mean(values)) if values else None
    return row


def _number(value, digits: str) -> str:
    return "–" if value is None else format(value, digits)


def markdown_table(rows: dict[tuple[str, str], dict], target: float) -> str:
    """The results table, one line per (source, correction)."""
    lines = [f"| source | correction | start reward | final reward (± sd) | steps to {target} | collapsed | "
             "KL | chi2 | log kept mass | seq rejected | staleness |", "|" + "---|" * 11]
    for (source, correction), row in rows.items():
        steps = (f"{row['steps_to_target']:.0f} ({row['reached_target']}/{row['seeds']})"
                 if row["steps_to_target"] is not None else f"not reached (0/{row['seeds']})")
        lines.append(
            f"| {source} | {correction} | {row['start_reward']:.3f} | {row['final_reward']:.3f} ± "
            f"{row['final_reward_sd']:.3f} | {steps} | {row['collapsed']}/{row['seeds']} | {_number(row['kl'], '.2e')} "
            f"| {_number(row['chi2'], '.2e')} | {_number(row['log_kept_mass'], '.3f')} | "
            f"{_number(row['seq_rejected'], '.2f')} | {_number(row['staleness'], '.2f')} |")
    return "\n".join(lines) + "\n"


def plot_source(source: str, runs: dict[str, list[list[dict]]], path: pathlib.Path) -> pathlib.Path:
    """One figure per source: a panel per metric, a line per correction (mean over seeds, band = min..max)."""
    panels = [(title, key) for title, key in PANELS
              if any(key in r for seeds in runs.values() for records in seeds for r in records)]
    columns = 2
    rows = math.ceil(len(panels) / columns)
    figure = Figure(figsize=(6 * columns, 3.8 * rows), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    figure.suptitle(f"mismatch source: {source}")
    for position, (title, key) in enumerate(panels, start=1):
        axes = figure.add_subplot(rows, columns, position)
        for correction, seeds in runs.items():
            length = min(len(records) for records in seeds)
            if not length or key not in seeds[0][0]:
                continue
            values = np.array([[r.get(key, np.nan) for r in records[:length]] for records in seeds], np.float64)
            steps = [r["step"] for r in seeds[0][:length]]
            line, = axes.plot(steps, np.nanmean(values, axis=0), label=correction)
            axes.fill_between(steps, np.nanmin(values, axis=0), np.nanmax(values, axis=0), alpha=0.15,
                              color=line.get_color())
        axes.set_title(title)
        axes.set_xlabel("RL step")
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small", ncol=2)
    figure.savefig(path)
    return path


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.mismatch_study",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/default.toml", help="base run config (TOML)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/mismatch_study"))
    parser.add_argument("--quick", action="store_true",
                        help=f"end-to-end check in a few minutes: {QUICK}, every source (overrides those flags)")
    parser.add_argument("--sources", nargs="+", choices=list(SOURCES), default=list(SOURCES))
    parser.add_argument("--corrections", nargs="+", choices=list(CORRECTIONS), default=list(CORRECTIONS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--steps", type=int, default=40, help="RL steps per run")
    parser.add_argument("--target", type=float, default=0.6, help="reward whose 5-step mean counts as reached")
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override the base config for every run (repeatable), e.g. --set model.name=small")
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.steps, args.corrections = QUICK["seeds"], QUICK["steps"], QUICK["corrections"]
        args.set = [f"warmup.steps={QUICK['warmup_steps']}", *args.set]
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    started = time.monotonic()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    loop = [f"loop.steps={args.steps}", f"checkpoints.every={args.steps}", f"loop.plot_every={args.steps}"]
    base = load_config(args.config, [*args.set, *loop])
    warm = {seed: [] for seed in args.seeds}
    if base.warmup.steps:
        from learner.train import setup_jax

        setup_jax(base)
        for seed in args.seeds:
            config = load_config(args.config, [*args.set, *loop, f"loop.seed={seed}"])
            directory = warm_start(config, out / "warm_start" / f"seed_{seed}")
            warm[seed] = [f"model.hf_path={_toml(str(directory))}", "warmup.steps=0"]
    cells = [Cell(source, correction, seed) for source in args.sources for correction in args.corrections
             for seed in args.seeds]
    command = [sys.executable, "-m", "learner.train", f"--config={pathlib.Path(args.config).resolve()}",
               *(f"--set={o}" for o in [*args.set, *loop])]
    status = run_grid(cells, command, out, args.parallel, warm)

    results, rows = [], {}
    for source in args.sources:
        runs = {}
        for correction in args.corrections:
            seeds = [read_metrics(Cell(source, correction, s).run_dir(out) / "metrics.jsonl") for s in args.seeds]
            seeds = [records for records in seeds if records]
            if not seeds:
                continue
            runs[correction] = seeds
            summaries = [summarize(records, args.target) for records in seeds]
            rows[source, correction] = aggregate(summaries)
            preset, overrides = CORRECTIONS[correction]
            results.append({"source": source, "correction": correction, "preset": preset, "overrides": overrides,
                            "runs": summaries, **rows[source, correction]})
        if runs:
            plot_source(source, runs, out / f"{source}.png")
    failed = [cell for cell, code in status.items() if code != 0]
    table = markdown_table(rows, args.target)
    (out / "results.md").write_text(table)
    (out / "results.json").write_text(json.dumps(
        {"config": args.config, "overrides": args.set, "steps": args.steps, "seeds": args.seeds, "target": args.target,
         "failed_runs": [dataclasses.asdict(cell) for cell in failed], "results": results}, indent=1))
    print(table, flush=True)
    print(f"{len(cells)} runs ({len(failed)} failed) in {time.monotonic() - started:.0f} s; figures, results.md and "
          f"results.json in {out}", flush=True)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
