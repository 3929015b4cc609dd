"""The GSM8K recipe (`configs/gsm8k_qwen2.5.toml`) end to end on a random checkpoint of a real shape: per-phase
split, tokens/s, start-up and compile counts.

Nothing is downloaded: the checkpoint is written with `learner.checkpoints.hf_checkpoint.write_hf_checkpoint`
(`learner.tools.make_gsm8k_tiny.write_inputs`: random weights, a small BPE tokenizer; random weights never emit EOS,
so every completion runs to ``--new-tokens``), and the dataset is GSM8K-shaped jsonl (question, answer ending in
``#### <number>``). The run is ``python -m learner.train --config configs/gsm8k_qwen2.5.toml`` with the paths and the
sizes set on the command line (``--set`` passes more), its metrics summarised per step:

- ``step_s`` = rollout wait + update + publish, and NeMo-RL's throughput: (prompt + generated tokens) / step time /
  devices (``perf/all_tokens_per_s_per_device``);
- the start-up phases of step 1 (``startup/*``) and the programs built (learner ``compile/programs``, server
  ``server/compiled_programs``: constant after step 2 when nothing compiles mid-run).

Shapes: ``qwen2-0.5b`` (Qwen2.5-0.5B's exact config: the accelerator check, issue 37) and ``17m`` (a Qwen2 of ~17M
parameters: the loaded-CPU check of issue 39, with the recipe's ``server.max_batch_size`` 512).

    python -m scripts.bench.recipe --shape qwen2-0.5b --prompts 16 --samples 8 --new-tokens 512 --steps 3   # GPU
    python -m scripts.bench.recipe --shape 17m --prompts 4 --samples 4 --new-tokens 32 --steps 3             # CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import statistics
import subprocess
import sys

from learner.tools.make_gsm8k_tiny import shape_config, write_inputs
from scripts.bench.common import REPO_ROOT, checkout_env, write_json

PHASES = ("perf/step_s", "perf/rollout_wait_s", "perf/update_s", "perf/publish_s")


def recipe_command(files: dict, run_dir: pathlib.Path, args) -> list[str]:
    sets = {"model.hf_path": files["model"], "task.args.path": files["train"],
            "task.args.validation.path": files["test"], "task.args.validation.max_prompts": args.prompts,
            "rollout.prompts_per_step": args.prompts, "rollout.num_samples": args.samples,
            "rollout.max_new_tokens": args.new_tokens, "loop.steps": args.steps, "checkpoints.every": 1000,
            "optimizer.warmup_steps": 0}  # the recipe's 10 need more updates than a few steps make
    command = [sys.executable, "-m", "learner.train", "--config", str(REPO_ROOT / "configs" / "gsm8k_qwen2.5.toml"),
               "--run-dir", str(run_dir)]
    for key, value in sets.items():
        command += ["--set", f"{key}={json.dumps(value if isinstance(value, int) else str(value))}"]
    for extra in args.set:
        command += ["--set", extra]
    return command


# the learner's seconds so far tracing, lowering and compiling (or loading) programs, and its cache hits: with a warm
# cache, what the first update spends outside the backend compile (`learner.reporting.compiles`)
LEARNER_COMPILE = ("compile/trace_seconds", "compile/lower_seconds", "compile/seconds", "compile/cache_hits")


def summarize(run_dir: pathlib.Path) -> dict:
    """Per step: the phases and throughput; step 1's start-up record; the compile counts."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [{key: record.get(key, math.nan) for key in
              (*PHASES, "perf/all_tokens_per_s_per_device", "perf/tokens_per_s", "compile/programs",
               "server/compiled_programs", *LEARNER_COMPILE)} | {"step": record["step"]} for record in records]
    steady = steps[1:] or steps
    return {"steps": steps,
            "steady_median": {key: statistics.median(step[f"perf/{key}"] for step in steady) for key in
                              ("step_s", "rollout_wait_s", "update_s", "publish_s", "all_tokens_per_s_per_device")},
            "startup": {key: value for key, value in records[0].items() if key.startswith("startup/")},
            "eval": {key: value for key, value in records[-1].items() if key.startswith("eval/")}}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.recipe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2-0.5b", choices=("qwen2-0.5b", "17m"))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/bench_recipe"))
    parser.add_argument("--set", action="append", default=[], help="more run overrides (key=value)")
    parser.add_argument("--summarize", type=pathlib.Path, metavar="RUN_DIR",
                        help="only print the per-step summary of an existing run directory (any config)")
    args = parser.parse_args(argv)
    if args.summarize:
        return report(summarize(args.summarize))
    args.out.mkdir(parents=True, exist_ok=True)
    files = write_inputs(args.out, args.shape, max_seq_len=2048)
    run_dir = args.out / "run"
    command = recipe_command(files, run_dir, args)
    print(" ".join(command), flush=True)
    result = subprocess.run(command, cwd=REPO_ROOT, env=checkout_env())
    if result.returncode:
        sys.exit(f"the recipe run failed (exit {result.returncode}); its server log: {run_dir / 'server.log'}")
    summary = summarize(run_dir) | {"shape": args.shape, "config": dataclasses.asdict(shape_config(args.shape, 2048))}
    write_json(args.out / "summary.json", summary)
    return report(summary)


def report(summary: dict) -> dict:
    """Prints `summarize`'s figures: one line per step, the steady medians, the start-up phases."""
    for step in summary["steps"]:
        print("step {step}: {step_s:.2f} s = rollout wait {rollout_wait_s:.2f} + update {update_s:.2f} + publish "
              "{publish_s:.3f}; {all_tokens_per_s_per_device:,.0f} tokens/s/device (prompt + generated); programs "
              "built: learner {programs}, server {compiled_programs}".format(**{
                  key.split("/", 1)[-1]: value for key, value in step.items()}), flush=True)
        print("  learner so far: trace {trace_seconds:.1f} s + lower {lower_seconds:.1f} s + compile or load "
              "{seconds:.1f} s, {cache_hits:.0f} cache hits".format(**{
                  key.split("/", 1)[-1]: step.get(key, math.nan) for key in LEARNER_COMPILE}), flush=True)
    steady = summary["steady_median"]
    print("steady (median after step 1): {step_s:.3f} s/step ({steps_per_s:.2f} steps/s) = rollout wait "
          "{rollout_wait_s:.3f} + update {update_s:.3f} + publish {publish_s:.3f}; {all_tokens_per_s_per_device:,.0f} "
          "tokens/s/device".format(**steady, steps_per_s=1 / steady["step_s"]), flush=True)
    print("start-up:", ", ".join(f"{key.removeprefix('startup/')} {value:.1f}"
                                 for key, value in summary["startup"].items()), flush=True)
    return summary


if __name__ == "__main__":
    main()
