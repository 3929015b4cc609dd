"""Ctrl-C and SIGTERM mid-run keep the work: a real `python -m learner.train` stopped by a real signal saves a verified
checkpoint of the step it reached, and the rerun resumes there, says so, and finishes a complete run directory."""

import os
import signal
import subprocess
import time

import pytest
from etils import epath

from learner.checkpoints.checkpointer import verify_manifest
from learner.reporting.metrics_writers import read_metrics
from tests.e2e.test_main_job import REPO_ROOT, check_run, run_training, train_command, train_env

STEPS = 10
# No periodic checkpoint before the end: everything a rerun resumes from is the stop's own save.
OVERRIDES = (f"loop.steps={STEPS}", "checkpoints.every=50")


def stop_mid_run(run_dir, tmp_path, name: str, after_step: int, send) -> tuple[int, str, str]:
    """Starts the run in its own session (as a terminal would), ``send(process)`` once ``after_step`` steps are
    logged; returns the exit code, stdout and stderr."""
    stdout, stderr = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
    with stdout.open("w") as out, stderr.open("w") as err:
        process = subprocess.Popen(train_command(run_dir, *OVERRIDES), cwd=REPO_ROOT, env=train_env(), stdout=out,
                                   stderr=err, start_new_session=True)
        give_up = time.monotonic() + 600
        try:
            while len(read_metrics(run_dir / "metrics.jsonl")) < after_step:
                assert process.poll() is None and time.monotonic() < give_up, stderr.read_text()[-3000:]
                time.sleep(0.05)
            send(process)
            code = process.wait(timeout=300)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    return code, stdout.read_text(), stderr.read_text()


def check_stopped_at(run_dir, code: int, expected_code: int, stderr: str) -> int:
    """The stop's exit code and line, its checkpoint verified at the last logged step; returns that step."""
    reached = len(read_metrics(run_dir / "metrics.jsonl"))
    assert code == expected_code, stderr[-3000:]
    assert f"checkpoint {reached} saved and verified; rerun the same command to resume from step {reached}" in stderr
    committed = sorted(int(path.name) for path in (run_dir / "checkpoints").iterdir() if path.name.isdigit())
    assert committed[-1] == reached < STEPS
    assert verify_manifest(epath.Path(run_dir / "checkpoints" / str(reached))) is None
    return reached


@pytest.mark.slow  # three real runs: ~2-4 minutes on the 2-core CPU
def test_ctrl_c_then_sigterm_save_the_step_reached_and_the_reruns_resume_there(tmp_path):
    run_dir = tmp_path / "run"
    # Ctrl-C in a terminal: SIGINT to the whole foreground group (the engine's process is in its own session)
    code, _, stderr = stop_mid_run(run_dir, tmp_path, "first", 2, lambda p: os.killpg(p.pid, signal.SIGINT))
    first = check_stopped_at(run_dir, code, 128 + signal.SIGINT, stderr)

    # A preempted cloud job: SIGTERM to the learner
    code, stdout, stderr = stop_mid_run(run_dir, tmp_path, "second", first + 2, lambda p: p.send_signal(signal.SIGTERM))
    assert f"resuming from step {first} (checkpoint of 20" in stdout
    second = check_stopped_at(run_dir, code, 128 + signal.SIGTERM, stderr)
    assert second >= first + 2

    stdout = run_training(run_dir, *OVERRIDES)
    assert f"resuming from step {second} (checkpoint of 20" in stdout
    assert f"| {second + 1}-{STEPS} of {STEPS}" in stdout
    check_run(run_dir, STEPS, *OVERRIDES)  # steps 1..10 once each, in the data order of an uninterrupted run
