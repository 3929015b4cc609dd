"""Issue #49, item 2: a server that sends nothing on a Generate stream is found by its silence, a slow one that
sends heartbeats never is (real server processes on 127.0.0.1).

- Client level: a silent server (tests/support/silent_server.py) raises `ServerSilentError` after ``max_silences``
  silences of ``silence_timeout_s``, not after the growing deadlines (~31 first deadlines); a scripted server whose
  every step takes longer than the silence timeout finishes, with no retry.
- Pool level: the silent engine is taken out and not probed back (its health check answers), so the request fails
  with `EnginesDownError` naming it as hung, at once rather than after ``give_up_after_s``.
- Run level: ``python -m learner.train`` against a silent server ends in one ``error:`` line.
"""

import subprocess
import sys
import time

import pytest

from rollout_client import (
    ClientConfig,
    EnginePool,
    EnginesDownError,
    Member,
    PoolConfig,
    RolloutClient,
    RolloutRequest,
    SamplingParams,
    ServerSilentError,
    TetherEngine,
)
from tests.rollout_client.conftest import ServerProcess

SILENCE_S = 4.0  # heartbeats every 1 s: a loaded machine's event loop keeps that
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=4, seed=3)


@pytest.fixture(scope="module")
def silent(tmp_path_factory):
    process = ServerProcess([sys.executable, "-m", "tests.support.silent_server", "--engine", "scripted"],
                            tmp_path_factory.mktemp("silent"))
    yield process
    process.stop()


# The slow server's test waits long enough for a loaded machine: at 4 s (heartbeats every 1 s) it was cut in a full
# default run at load ~15, the server's event loop starved for 4 s twice. 20 s: heartbeats every 5 s.
SLOW_SILENCE_S = 20.0


@pytest.fixture(scope="module")
def slow(tmp_path_factory):
    """Each step (one token) takes 1.25 silence timeouts."""
    process = ServerProcess([sys.executable, "-m", "rollout_client.server", "--engine", "scripted",
                             "--step-delay-s", str(1.25 * SLOW_SILENCE_S)], tmp_path_factory.mktemp("slow"))
    yield process
    process.stop()


def test_a_silent_server_is_reported_after_two_silences_not_after_the_growing_deadlines(silent):
    config = ClientConfig(target=silent.target, silence_timeout_s=SILENCE_S, deadline_base_s=600.0)
    with RolloutClient(config) as client:
        started = time.monotonic()
        with pytest.raises(ServerSilentError, match=rf"the server at {silent.target} sent nothing, not even a "
                                                    rf"heartbeat, for 4 s, 2 times in a row: it is hung"):
            client.generate(RolloutRequest([5], PARAMS, num_samples=2))
        elapsed = time.monotonic() - started
        assert client.metrics()["generate/retries"] == 1
    # two silences (plus scheduling on a loaded machine), far below one 600 s deadline
    assert 2 * SILENCE_S <= elapsed < 2 * SILENCE_S + 60, elapsed


@pytest.mark.slow  # two tokens of 25 s each
def test_a_slow_server_sending_heartbeats_is_never_cut(slow):
    # a 600 s first deadline: only a silence could cut these 50 s
    config = ClientConfig(target=slow.target, silence_timeout_s=SLOW_SILENCE_S, deadline_base_s=600.0)
    with RolloutClient(config) as client:
        started = time.monotonic()
        samples = client.generate(RolloutRequest([5], SamplingParams(max_new_tokens=2, seed=3), num_samples=2))
        elapsed = time.monotonic() - started
        assert client.metrics()["generate/retries"] == 0
    assert [len(sample.completion_token_ids) for sample in samples] == [2, 2]
    assert elapsed > 2 * SLOW_SILENCE_S  # it sent no sample (nor chunk) for longer than the silence timeout


def test_the_pool_takes_a_silent_engine_out_for_good_and_names_it_hung(silent):
    engine = TetherEngine(ClientConfig(target=silent.target, silence_timeout_s=SILENCE_S))
    pool = EnginePool([Member(silent.target, engine)], PoolConfig(probe_interval_s=0.2, give_up_after_s=600.0))
    try:
        started = time.monotonic()
        future = pool.submit(RolloutRequest([5], PARAMS, num_samples=1))
        with pytest.raises(EnginesDownError) as raised:
            future.result(timeout=300)
        elapsed = time.monotonic() - started
    finally:
        pool.close()
    message = str(raised.value)
    assert message.startswith(f"no inference engine is serving: the engine at {silent.target} is hung "
                              "(ServerSilentError: Generate "), message
    assert "\n" not in message
    assert elapsed < 2 * SILENCE_S + 60, elapsed  # not give_up_after_s (600 s): its health check answers
    assert pool.metrics()["engines/taken_back"] == 0


@pytest.mark.slow  # a model server and a run up to its first rollouts: ~1 minute on the shared 2-core machine
def test_a_run_against_a_silent_server_ends_in_one_error_line_within_two_minutes(tmp_path):
    from rollout_client import EngineProcess
    from tests.e2e.test_main_job import REPO_ROOT, train_command, train_env

    server = EngineProcess("tests.support.silent_server", ["--engine", "model", "--model-config", "tiny", "--eos-ids",
                                                           "2", "--max-batch-size", "16", "--max-seq-len", "8"],
                           tmp_path / "silent_server.log", start_timeout_s=240)
    try:
        process = subprocess.Popen(train_command(tmp_path / "run", "loop.steps=3",
                                                 f'server.address="{server.address}"', "server.silence_timeout_s=30"),
                                   cwd=REPO_ROOT, env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True)
        lines, waiting_since = [], None
        for line in process.stdout:  # the run's output as it comes: when did it first ask for samples? (the publish
            lines.append(line.rstrip("\n"))  # canary's, announced by its line, comes before the first rollouts)
            if waiting_since is None and line.startswith("canary: the tether engine's logprobs"):
                waiting_since = time.monotonic()
        process.wait(timeout=60)
        reported_after = time.monotonic() - waiting_since
    finally:
        server.stop()
    output = "\n".join(lines)
    assert process.returncode == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert lines[-1].startswith(f"error: no inference engine is serving: the engine at {server.address} is hung "
                                "(ServerSilentError: Generate "), lines[-1]
    assert "sent nothing, not even a heartbeat, for 30 s, 2 times in a row: it is hung" in lines[-1], lines[-1]
    assert 60 <= reported_after < 120, reported_after
