"""The main job end to end: the real server process, the real loop, every output of the run directory checked."""

import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np

from learner.checkpoints.checkpointer import CheckpointConfig, Checkpointer
from learner.reporting.metrics_writers import read_metrics
from learner.reporting.rollout_log import RolloutLogReader
from learner.rl import load_config
from learner.rl.prompt_dataset import prompt_dataset
from learner.tasks import load_task

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO_ROOT / "configs" / "default.toml"
# A shortened default run: few steps, small batches, fast compiles.
SHORT = ("warmup.steps=2", "warmup.batch_size=16", "rollout.prompts_per_step=4", "rollout.num_samples=4",
         "server.max_batch_size=16", "update.fast_compile=true", "loop.plot_every=2")
WARMUP_STEPS = 2


def train_command(run_dir: pathlib.Path, *overrides: str) -> list[str]:
    sets = [arg for override in (*SHORT, f"run_dir={json.dumps(str(run_dir))}", *overrides)
            for arg in ("--set", override)]
    return [sys.executable, "-m", "learner.train", "--config", str(DEFAULT_CONFIG), *sets]


def train_env() -> dict:
    """The test process's environment (with the test run's compilation cache, see conftest.py), on the CPU."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO_ROOT)}


# A safety net, not a speed check: on the shared 2-core machine at load ~20 a 4-step run took 334 s (its server compiles
# every program before it serves: 135 s of it).
def run_training(run_dir: pathlib.Path, *overrides: str, timeout_s: float = 600) -> str:
    return run_training_output(run_dir, *overrides, timeout_s=timeout_s)[0]


def run_training_output(run_dir: pathlib.Path, *overrides: str, timeout_s: float = 600) -> tuple[str, str]:
    """stdout and stderr of a run that must succeed."""
    result = subprocess.run(train_command(run_dir, *overrides), cwd=REPO_ROOT, env=train_env(), capture_output=True,
                            text=True, timeout=timeout_s)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result.stdout, result.stderr


def dataset_prompts(run_dir: pathlib.Path, *overrides: str) -> list[list[tuple[int, ...]]]:
    """Prompt batches of the run's data pipeline, in order: what step k must have trained on (batch k - 1)."""
    config = load_config(DEFAULT_CONFIG, [*SHORT, *overrides])
    task = load_task(config.task.name, config.task.args)
    records = task.prompts()
    dataset = prompt_dataset(np.arange(len(records)), lambda i: {"index": np.int64(i)},
                             global_batch_size=config.rollout.prompts_per_step, seed=config.task.seed,
                             process_index=0, process_count=1)
    return [sorted(tuple(records[int(i)]["prompt_ids"]) for i in batch["index"])
            for batch in (dataset[i] for i in range(config.loop.steps))]


def logged_prompts(batch) -> list[tuple[int, ...]]:
    """The distinct prompts of a logged batch (tokens before the first loss-masked one), sorted."""
    starts = np.argmax(batch.loss_mask > 0, axis=1)
    return sorted({tuple(row[:start]) for row, start in zip(batch.tokens, starts)})


def check_run(run_dir: pathlib.Path, steps: int, *overrides: str) -> list[dict]:
    """Asserts the run directory of a finished run of ``steps`` steps is complete and consistent."""
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for record in records:
        assert record["policy/learner_version"] == WARMUP_STEPS + record["step"]
        assert record["policy/server_version"] == record["policy/learner_version"]
        assert 0.0 <= record["reward/mean"] <= 1.0
        assert record["rollout/samples"] == 16
        assert record["buffer/stale_dropped"] == 0
        assert 0.0 <= record["rollout_corr/staleness_mean"] <= 1.0
        if "rollout.partial=true" not in overrides:  # a publish waits for the samples in flight: one version each
            assert (record["rollout/partial_fraction"], record["rollout/versions_per_sample_max"]) == (0.0, 1.0)
    # the publish canary (canary.every = 50) verified the start's and the first step's publishes of each run (a
    # resumed run's too), and no other: float32 on both sides
    canaried = [record for record in records if "canary/mean_abs_diff" in record]
    assert canaried[0] is records[0]
    assert all("canary/start_mean_abs_diff" in record for record in canaried)
    assert max(max(record["canary/start_mean_abs_diff"], record["canary/mean_abs_diff"]) for record in canaried) < 1e-5
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "learning_curves.png").stat().st_size > 10_000

    with Checkpointer(CheckpointConfig(str(run_dir / "checkpoints"))) as checkpointer:
        assert checkpointer.latest_step() == steps
        assert checkpointer.read_metadata()["policy_version"] == WARMUP_STEPS + steps

    reader = RolloutLogReader(run_dir / "rollout_log")
    assert reader.steps.tolist() == list(range(1, steps + 1))
    expected_prompts = dataset_prompts(run_dir, *overrides)
    for batch, record in zip(reader.batches(), records):
        versions = batch.policy_version[batch.loss_mask > 0]
        trained_version = WARMUP_STEPS + batch.step - 1  # the learner's version when it trained this batch
        assert versions.max() <= trained_version and versions.min() >= trained_version - 1
        assert batch.learner_version.tolist() == [trained_version] * len(batch.rewards)
        assert set(np.unique(batch.rewards)) <= {0.0, 1.0}
        np.testing.assert_allclose(batch.rewards.mean(), record["reward/mean"], rtol=1e-6)
        assert logged_prompts(batch) == sorted(set(expected_prompts[batch.step - 1]))
    return records


def test_short_default_run_writes_a_consistent_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    stdout, stderr = run_training_output(run_dir, "loop.steps=4", "checkpoints.every=2")
    check_run(run_dir, 4, "loop.steps=4")
    assert re.search(r"^train state: [\d,]+ parameters built in \d+\.\d s$", stdout, re.MULTILINE), stdout[:2000]
    # Never silent: each wait of the start-up is announced before it starts, in order, then where the time went.
    announced = ["building the train state ...", "warm-up: 2 steps of cross entropy; compiling its update step ...",
                 f"starting the tether engine (log: {run_dir / 'server.log'}) and publishing the weights ...",
                 "waiting for the first rollouts ...",
                 "compiling the RL update step ..."]
    lines = stdout.splitlines()
    assert all(line in lines for line in announced), stdout[:3000]
    assert [lines.index(line) for line in announced] == sorted(lines.index(line) for line in announced)
    assert re.search(r"^start-up: [\d.]+ s to the end of the first step: train state [\d.]+ s, warm-up [\d.]+ s, "
                     r"engine start [\d.]+ s, publish canary [\d.]+ s, first rollouts [\d.]+ s, first update [\d.]+ s, "
                     r"other -?[\d.]+ s$",
                     stdout, re.MULTILINE), stdout[:3000]
    # The warm-up's bar and the RL bar (a line per step at most every 5 s off a terminal: the first and last at least)
    assert re.search(r"^warm-up \[#+\] 2/2 loss \d+\.\d{3} [\d.]+ step/s$", stderr, re.MULTILINE), stderr[-3000:]
    assert re.search(r"^\[#+\.*\] 1/4 reward ", stderr, re.MULTILINE), stderr[-3000:]
    assert re.search(r"^\[#+\] 4/4 reward ", stderr, re.MULTILINE), stderr[-3000:]
    assert any(line.startswith("| policy version learner / server") and "| 6 / 6 " in line
               for line in stdout.splitlines())
    # Where the start-up went: its phases add up to its total, in step 1's metrics.
    records = read_metrics(run_dir / "metrics.jsonl")
    phases = [value for key, value in records[0].items() if key.startswith("startup/") and key.endswith("_s")
              and key not in ("startup/total_s", "startup/compile_s")]  # the phases and "other"
    assert {"startup/engine_start_s", "startup/warmup_s", "startup/publish_canary_s",
            "startup/first_update_s"} <= set(records[0])
    assert abs(sum(phases) - records[0]["startup/total_s"]) < 1e-3 * records[0]["startup/total_s"] + 1e-3
    assert records[0]["startup/compiled_programs"] > 0 and "startup/total_s" not in records[1]
    # Every program is built by the end of step 2: the server's before it served, the learner's in steps 1-2.
    for key in ("compile/programs", "server/compiled_programs"):
        assert records[1][key] > 0 and [r[key] for r in records[1:]] == [records[1][key]] * 3, key
    agreement = json.loads((run_dir / "process_0.json").read_text())
    assert agreement["steps"] == [1, 2, 3, 4] and agreement["policy_version"] == 6

    # The same command again: the run is finished, says so and exits 0, quietly (no server started, no asyncio noise).
    rerun = subprocess.run(train_command(run_dir, "loop.steps=4", "checkpoints.every=2"), cwd=REPO_ROOT,
                           env=train_env(), capture_output=True, text=True, timeout=240)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"{run_dir}: already finished at step 4 of 4; nothing to do" in rerun.stdout
    assert rerun.stderr == "" and not (run_dir / "server.log").read_text().count("listening") > 1

    from learner.tools.recompute_diagnostics import recompute

    diagnostics = recompute(run_dir)
    assert [d["step"] for d in diagnostics] == [1, 2, 3, 4]
    assert all(np.isfinite(d["rollout_corr/kl"]) for d in diagnostics)
