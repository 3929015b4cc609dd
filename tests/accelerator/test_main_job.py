"""The README's main job on the accelerator, unchanged but for 60 RL steps and synchronous rollouts
(``rollout.max_staleness = 0``, so that the train/rollout KL measures the learner against the server, not a lag):
the embedded server and the learner share the device through their default memory budgets.

Checked: exit code 0; reward rising (mean of the last 10 steps >= 0.5 and >= the first 10 steps' + 0.2; main's GPU
run went 0.19 -> 0.87 with staleness 1); train/rollout KL (``rollout_corr/kl``) at most 2e-6 in absolute value at
every step (CPU: ~1e-8; main on a GPU with TF32 matmuls: ~1e-5).
"""

import os
import pathlib
import subprocess
import sys
import time

import numpy as np

from learner.reporting.metrics_writers import read_metrics

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
STEPS = 60


def test_the_main_job_trains_on_the_accelerator(tmp_path):
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "learner.train", "--config", str(REPO_ROOT / "configs" / "default.toml"),
               "--set", f"loop.steps={STEPS}", "--set", "rollout.max_staleness=0", "--run-dir", str(run_dir)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    start = time.monotonic()
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    seconds = time.monotonic() - start
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [record["step"] for record in records] == list(range(1, STEPS + 1))
    rewards = np.array([record["reward/mean"] for record in records])
    kl = np.array([record["rollout_corr/kl"] for record in records])
    print(f"main job: {seconds:.0f} s, reward {rewards[:10].mean():.2f} -> {rewards[-10:].mean():.2f}, "
          f"max |train/rollout KL| {np.abs(kl).max():.1e}")
    assert rewards[-10:].mean() >= 0.5 and rewards[-10:].mean() >= rewards[:10].mean() + 0.2
    assert np.abs(kl).max() <= 2e-6
