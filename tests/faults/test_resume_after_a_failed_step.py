"""A run that failed at RL step 1 (its reward raised) and is rerun with the same command resumes from the fresh
start's checkpoint 0: no second save of step 0 (orbax's StepAlreadyExistsError), metrics from step 1 on once each."""

import subprocess

import pytest

from learner.reporting.metrics_writers import read_metrics
from tests.e2e.test_main_job import REPO_ROOT, run_training, train_command, train_env

STEPS = 2


@pytest.mark.slow  # 47 s on a quiet 2-core run: out of the default run's 15 minutes
def test_a_reward_that_raised_at_step_1_then_the_same_command_resumes(tmp_path):
    run_dir, marker = tmp_path / "run", tmp_path / "raised"
    overrides = ("warmup.steps=0", f"loop.steps={STEPS}", "checkpoints.every=50",
                 'task.name="tests.support.flaky_reward_task:FlakyAddition"',
                 f'task.args={{num_prompts=64, marker="{marker}"}}')
    first = subprocess.run(train_command(run_dir, *overrides), cwd=REPO_ROOT, env=train_env(), capture_output=True,
                           text=True, timeout=240)
    assert first.returncode != 0 and "flaky reward: raised at the first RL step" in first.stderr, first.stderr[-3000:]
    assert marker.exists() and not read_metrics(run_dir / "metrics.jsonl")
    committed = sorted(int(path.name) for path in (run_dir / "checkpoints").iterdir() if path.name.isdigit())
    assert committed == [0]

    stdout = run_training(run_dir, *overrides)
    assert "| steps" in stdout and f"1-{STEPS}" in stdout.split("| steps")[1].split("\n")[0], stdout[-2000:]
    assert [record["step"] for record in read_metrics(run_dir / "metrics.jsonl")] == list(range(1, STEPS + 1))
    committed = sorted(int(path.name) for path in (run_dir / "checkpoints").iterdir() if path.name.isdigit())
    assert committed == [0, STEPS]
