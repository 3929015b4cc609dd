"""Resume after SIGKILL: the rerun continues step, data position and server policy version, with no gap or repeat."""

import subprocess
import time

import pytest

from learner.reporting.metrics_writers import read_metrics
from tests.e2e.test_main_job import REPO_ROOT, check_run, run_training, train_command, train_env

STEPS = 8
OVERRIDES = (f"loop.steps={STEPS}", "checkpoints.every=2")


@pytest.mark.slow  # 46 s on a quiet 2-core run: out of the default run's 15 minutes
def test_sigkill_mid_run_then_rerun_continues_where_the_last_checkpoint_left_off(tmp_path):
    kill_mid_run_then_rerun(tmp_path / "run", OVERRIDES)


@pytest.mark.slow  # two real runs: ~40 s
def test_partial_rollouts_keep_the_resume_guarantees(tmp_path):
    """With rollout.partial = true (samples run on across publishes): the same kill and rerun, the same checks."""
    kill_mid_run_then_rerun(tmp_path / "run", (*OVERRIDES, "rollout.partial=true"))


def kill_mid_run_then_rerun(run_dir, overrides) -> None:
    """SIGKILL after step 5 (checkpoints every 2 steps), rerun: steps 1..8 once each, in the data order of an
    uninterrupted run, the server's version continuing the learner's (`check_run`)."""
    first = subprocess.Popen(train_command(run_dir, *overrides), cwd=REPO_ROOT, env=train_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    give_up = time.monotonic() + 180
    try:
        while len(read_metrics(run_dir / "metrics.jsonl")) < 5:  # mid-run, after checkpoints 2 and 4
            assert first.poll() is None and time.monotonic() < give_up, "the first run ended before the kill"
            time.sleep(0.05)
    finally:
        first.kill()
        first.wait()
    killed_at = len(read_metrics(run_dir / "metrics.jsonl"))
    assert killed_at < STEPS
    # Saves are async: the rerun must resume from the newest checkpoint that was committed when the kill came.
    committed = sorted(int(path.name) for path in (run_dir / "checkpoints").iterdir() if path.name.isdigit())
    assert committed, "no checkpoint was committed before the kill"

    stdout = run_training(run_dir, *overrides)
    records = check_run(run_dir, STEPS, *overrides)  # steps 1..8 once each, data order, versions
    resumed_from = int(stdout.split("| steps")[1].split("|")[1].split("-")[0]) - 1
    assert resumed_from == committed[-1] and 2 <= resumed_from <= killed_at
    assert records[resumed_from]["policy/server_version"] == records[resumed_from - 1]["policy/learner_version"] + 1


@pytest.mark.slow  # two real runs: ~40 s
def test_sigkill_before_the_first_periodic_checkpoint_then_rerun_resumes_from_step_0(tmp_path):
    """Only the fresh start's checkpoint 0 is committed at the kill: the rerun restores it and must not save step 0
    again (that raised orbax's StepAlreadyExistsError on every rerun)."""
    run_dir, steps = tmp_path / "run", 6
    overrides = (f"loop.steps={steps}", "checkpoints.every=50")
    first = subprocess.Popen(train_command(run_dir, *overrides), cwd=REPO_ROOT, env=train_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    give_up = time.monotonic() + 180
    try:
        while len(read_metrics(run_dir / "metrics.jsonl")) < 3:
            assert first.poll() is None and time.monotonic() < give_up, "the first run ended before the kill"
            time.sleep(0.05)
    finally:
        first.kill()
        first.wait()
    committed = sorted(int(path.name) for path in (run_dir / "checkpoints").iterdir() if path.name.isdigit())
    assert committed == [0]

    stdout = run_training(run_dir, *overrides)
    check_run(run_dir, steps, f"loop.steps={steps}")
    assert "| steps" in stdout and "| 1-6 of 6" in stdout
