"""One run per run_dir: a second run on a held directory is refused at once naming the holder; the lock of a
SIGKILLed run is taken over."""

import json
import os
import signal
import socket
import subprocess
import sys

from learner.rl.run_lock import LOCK_FILE, hold_run_dir
from tests.e2e.test_main_job import REPO_ROOT, train_command, train_env

HOLD = ("import pathlib, sys, time\n"
        "from learner.rl.run_lock import hold_run_dir\n"
        "with hold_run_dir(pathlib.Path(sys.argv[1])):\n"
        "    print('held', flush=True)\n"
        "    time.sleep(600)\n")


def _holder(run_dir):
    """A real process holding ``run_dir``'s lock, once it says so."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], cwd=REPO_ROOT, env=train_env(),
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    return holder


def test_a_second_run_on_a_held_run_dir_is_refused_naming_the_holder(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = _holder(run_dir)
    try:
        second = subprocess.run(train_command(run_dir, "loop.steps=2"), cwd=REPO_ROOT, env=train_env(),
                                capture_output=True, text=True, timeout=240)
    finally:
        holder.kill()
        holder.wait()
    assert second.returncode == 1
    assert "Traceback" not in second.stderr
    [line] = [line for line in second.stderr.splitlines() if line.startswith("error:")]
    assert f"run_dir {run_dir} is in use by another run (pid {holder.pid} on host {socket.gethostname()}" in line
    assert "set another run_dir" in line
    assert sorted(path.name for path in run_dir.iterdir()) == [LOCK_FILE]  # nothing read or written


def test_the_lock_of_a_sigkilled_run_is_taken_over(tmp_path):
    holder = _holder(tmp_path)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == holder.pid  # the stale file stays
    with hold_run_dir(tmp_path):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
