"""An engine that dies ends what waits on it, with one line naming its log and exit code.

- The reference server's generation loop failing (a device out of memory, say) stops the server process with exit
  code `ENGINE_FAILED_EXIT_CODE` and one last log line, instead of a dead thread behind a live server.
- A pool whose launched engine is out of relaunches fails with a one-line `EnginesDownError` naming the log and the
  exit code.
- The main job whose embedded server dies (SIGKILL, no relaunches left) exits 1 with one ``error:`` line naming
  ``server.log`` and the exit code, and no traceback.
"""

import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from rollout_client import ClientConfig, EngineProcess, RolloutRequest, SamplingParams, TetherEngine
from rollout_client.engines.pool import EnginePool, EnginesDownError, Member, PoolConfig
from rollout_client.server.app import ENGINE_FAILED_EXIT_CODE
from rollout_client.server.scheduler import Scheduler
from tests.e2e.test_main_job import train_command, train_env
from tests.support.failing_engine_server import FAILURE, FailingGenerator

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
REQUEST = RolloutRequest([5, 6, 7], SamplingParams(max_new_tokens=20, stop_token_ids=(), seed=3), num_samples=2)
CLIENT = dict(ready_timeout_s=60, initial_backoff_s=0.05, max_backoff_s=0.2)


def test_a_failing_generation_loop_reports_its_error_instead_of_dying_silently():
    failed = threading.Event()
    errors = []
    scheduler = Scheduler(FailingGenerator(1), on_failure=lambda error: (errors.append(error), failed.set()))
    from rollout_client.sampling_params import LogprobMode
    from rollout_client.server.generator import SequenceSpec
    spec = SequenceSpec(prompt_token_ids=np.array([5, 6], np.int32), sampling=REQUEST.sampling, sample_index=0,
                        logprob_mode=LogprobMode.PROCESSED)
    scheduler.submit(spec, sink=lambda output: None)
    assert failed.wait(timeout=30)
    assert isinstance(errors[0], RuntimeError) and str(errors[0]) == FAILURE
    scheduler.close()


def launch_failing(tmp_path, name: str, fail_at_step: int) -> TetherEngine:
    process = EngineProcess("tests.support.failing_engine_server",
                            ["--engine", "failing", "--vocab-size", "1000", "--fail-at-step", str(fail_at_step)],
                            tmp_path / f"{name}.log", start_timeout_s=120)
    return TetherEngine(ClientConfig(target=process.address, **CLIENT), process=process)


def test_the_server_process_exits_with_its_code_and_one_line_when_its_engine_fails(tmp_path):
    engine = launch_failing(tmp_path, "oom", fail_at_step=3)
    try:
        engine.submit(REQUEST)
        give_up = time.monotonic() + 120
        while engine.process.returncode is None and time.monotonic() < give_up:
            time.sleep(0.1)
        assert engine.process.returncode == ENGINE_FAILED_EXIT_CODE
        last_line = (tmp_path / "oom.log").read_text().strip().splitlines()[-1]
        assert last_line == (f"rollout-server: the engine failed, stopping (exit code {ENGINE_FAILED_EXIT_CODE}): "
                             f"RuntimeError: {FAILURE}")
    finally:
        engine.close()


def test_a_pool_out_of_relaunches_fails_with_one_line_naming_the_log_and_exit_code(tmp_path):
    engine = launch_failing(tmp_path, "doomed", fail_at_step=1)
    with EnginePool([Member(engine.process.address, engine, relaunch=lambda current: launch_failing(
            tmp_path, "doomed-again", fail_at_step=1))], PoolConfig(max_relaunches=1)) as pool:
        with pytest.raises(EnginesDownError) as error:
            pool.submit(REQUEST).result(timeout=240)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("no inference engine is serving: the launched engine at ")
    assert f"(exit code {ENGINE_FAILED_EXIT_CODE}; log {tmp_path / 'doomed-again.log'}) was relaunched 1 times" \
        in message


def child_pids(pid: int) -> list[int]:
    """The children of every thread of ``pid`` (a run starts its server from a thread: learner.rl.run)."""
    return [int(child) for task in pathlib.Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()]


@pytest.mark.slow  # ~40 s on a loaded 2-core machine: the run's set-up (compiles, server start) dominates
@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="finds the engine process to SIGKILL through /proc/<pid>/task/*/children (Linux only)")
def test_the_main_job_ends_with_one_line_when_its_engine_dies(tmp_path):
    """The real run: its server killed once the run is set up (the metrics hook's tensorboard/ exists: the engine
    is connected and rollouts are requested), no relaunch left (server.max_relaunches=0)."""
    run_dir = tmp_path / "run"
    command = train_command(run_dir, "loop.steps=500", "server.max_relaunches=0", "warmup.steps=0")
    with subprocess.Popen(command, cwd=REPO_ROOT, env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as job:
        try:
            give_up = time.monotonic() + 600  # the set-up: the server compiles every program before it serves
            while not (run_dir / "tensorboard").exists() and time.monotonic() < give_up and job.poll() is None:
                time.sleep(0.2)
            servers = child_pids(job.pid)
            assert len(servers) == 1, servers
            os.kill(servers[0], signal.SIGKILL)
            stdout, stderr = job.communicate(timeout=180)
        finally:
            if job.poll() is None:
                job.kill()
    assert job.returncode == 1, stderr[-3000:]
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-3000:]
    assert errors[0].startswith("error: no inference engine is serving: the launched engine at 127.0.0.1:")
    assert f"(exit code {-signal.SIGKILL}; log {run_dir / 'server.log'})" in errors[0]
    assert stderr.strip().splitlines()[-1] == errors[0]
