"""The main job as two JAX processes (gloo collectives, 2 simulated CPU devices each) on one global mesh."""

import json
import socket
import subprocess

import pytest

from tests.e2e.test_main_job import REPO_ROOT, check_run, train_command, train_env

STEPS = 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow  # 56 s on a quiet 2-core run: out of the default run's 15 minutes
def test_two_processes_train_the_same_batches_to_the_same_policy_version(tmp_path):
    run_dir = tmp_path / "run"
    port = _free_port()
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    processes = [
        subprocess.Popen(train_command(run_dir, f"loop.steps={STEPS}", "mesh.cpu_devices=2") + [
            "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
            cwd=REPO_ROOT, env=train_env(), stdout=log.open("w"), stderr=subprocess.STDOUT)
        for i, log in enumerate(logs)]
    try:
        for process in processes:
            process.wait(timeout=300)
    finally:
        for process in processes:
            process.kill()
    assert [p.returncode for p in processes] == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)

    check_run(run_dir, STEPS, f"loop.steps={STEPS}")
    first, second = (json.loads((run_dir / f"process_{i}.json").read_text()) for i in range(2))
    assert first == second
    assert first["steps"] == list(range(1, STEPS + 1)) and first["policy_version"] == 2 + STEPS
