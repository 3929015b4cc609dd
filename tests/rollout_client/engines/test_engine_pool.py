"""`EnginePool` against real scripted-engine servers on 127.0.0.1, killed with SIGKILL mid-run.

The scripted engine (``python -m rollout_client.server --engine scripted``) is a rollout.v1 server without a model:
fast to start, and its weights are one number, ``logprob_scale``, that multiplies every logprob, so which weights a
server holds is visible in its samples.
"""

import os
import signal
import time

import numpy as np
import pytest

from rollout_client import ClientConfig, EngineProcess, RolloutRequest, SamplingParams, TetherEngine
from rollout_client.engines.pool import EnginePool, EnginesDownError, Member, PoolConfig
from rollout_client.engines.process import free_port

SLOW = SamplingParams(max_new_tokens=50, stop_token_ids=(), seed=5)  # 50 steps x 5 ms: in flight for ~0.25 s
CLIENT = dict(ready_timeout_s=60, initial_backoff_s=0.05, max_backoff_s=0.2)


def launch(tmp_path, name: str, vocab_size: int = 1000) -> TetherEngine:
    process = EngineProcess("rollout_client.server", ["--engine", "scripted", "--vocab-size", str(vocab_size),
                                                      "--step-delay-s", "0.005"],
                            tmp_path / f"{name}.log", start_timeout_s=120)
    return TetherEngine(ClientConfig(target=process.address, **CLIENT), process=process)


def launched_member(tmp_path, name: str) -> Member:
    engine = launch(tmp_path, name)
    relaunches = iter(range(1, 100))
    return Member(engine.process.address, engine, relaunch=lambda current: launch(tmp_path,
                                                                                  f"{name}-{next(relaunches)}"))


def external_member(tmp_path, name: str, vocab_size: int = 1000) -> Member:
    engine = launch(tmp_path, name, vocab_size)
    return Member(engine.process.address, engine)  # no relaunch: the pool treats it as someone else's server


def scale(value: float) -> dict[str, np.ndarray]:
    return {"logprob_scale": np.asarray(value, np.float32)}


def requests(count: int, sampling=SLOW) -> list[RolloutRequest]:
    return [RolloutRequest([5, 6, 7], sampling, num_samples=2) for _ in range(count)]


def kill(member: Member) -> None:
    os.kill(member.engine.process._process.pid, signal.SIGKILL)
    member.engine.process._process.wait()


def test_requests_spread_over_engines_by_load(tmp_path):
    members = [external_member(tmp_path, "a"), external_member(tmp_path, "b")]
    with EnginePool(members) as pool:
        futures = [pool.submit(request) for request in requests(8)]
        results = [future.result(timeout=120) for future in futures]
    assert all(len(samples) == 2 for samples in results)
    # Least in-flight: 8 overlapping requests alternate between two idle engines, 4 each.
    assert [member.served for member in members] == [4, 4]


def test_killed_launched_engine_is_relaunched_with_the_current_weights(tmp_path):
    member = launched_member(tmp_path, "only")
    with EnginePool([member]) as pool:
        (reference,) = [s for s in pool.submit(RolloutRequest([5, 6, 7], SLOW)).result(timeout=120)]
        assert pool.publish(3, scale(2.0)) == 3
        first_process = member.engine.process
        futures = [pool.submit(request) for request in requests(4)]
        kill(member)
        results = [future.result(timeout=180) for future in futures]  # every request completes: none is lost
        metrics = pool.metrics()
        (after,) = pool.submit(RolloutRequest([5, 6, 7], SLOW)).result(timeout=120)
        served_version = pool.info().policy_version
    assert all(len(samples) == 2 for samples in results)
    assert member.engine.process is not first_process and first_process.returncode == -signal.SIGKILL
    assert metrics["engines/relaunches"] == 1 and metrics["engines/taken_back"] == 1
    assert metrics["engines/redispatched"] >= 1
    # The relaunched server got version 3's weights before serving: same tokens (same seed), logprobs x 2.
    assert served_version == 3
    np.testing.assert_array_equal(after.completion_token_ids, reference.completion_token_ids)
    np.testing.assert_allclose(after.logprobs, 2.0 * reference.logprobs, rtol=1e-6)
    assert (after.policy_versions == 3).all()


def test_dead_engine_is_taken_out_and_the_other_serves(tmp_path):
    survivor, victim = external_member(tmp_path, "survivor"), external_member(tmp_path, "victim")
    config = PoolConfig(probe_interval_s=0.2, give_up_after_s=600)
    with EnginePool([survivor, victim], config) as pool:
        pool.publish(1, scale(1.5))
        kill(victim)
        results = [f.result(timeout=180) for f in [pool.submit(r) for r in requests(6)]]
        assert pool.publish(2, scale(1.0)) == 2  # the dead one is skipped; the live one confirms
        metrics = pool.metrics()
    assert all(len(samples) == 2 for samples in results)
    assert not victim.healthy and survivor.healthy
    assert metrics["engines/healthy"] == 1 and metrics["engines/taken_out"] == 1


def test_external_engine_that_stays_down_ends_the_run_naming_its_address(tmp_path):
    member = external_member(tmp_path, "gone")
    with EnginePool([member], PoolConfig(probe_interval_s=0.2, give_up_after_s=1.0)) as pool:
        kill(member)
        with pytest.raises(EnginesDownError) as error:
            pool.submit(requests(1)[0]).result(timeout=180)
        with pytest.raises(EnginesDownError):  # later requests fail at once with the same message
            pool.submit(requests(1)[0]).result(timeout=10)
    message = str(error.value)
    assert f"the engine at {member.address} has been unreachable" in message


def test_launched_engine_out_of_relaunches_names_its_log_and_exit_code(tmp_path):
    member = launched_member(tmp_path, "doomed")
    with EnginePool([member], PoolConfig(max_relaunches=0)) as pool:
        kill(member)
        with pytest.raises(EnginesDownError) as error:
            pool.submit(requests(1)[0]).result(timeout=180)
    message = str(error.value)
    assert f"the launched engine at {member.address} (exit code {-signal.SIGKILL}; log {tmp_path / 'doomed.log'})" \
        in message
    assert "relaunched 0 times" in message


def test_engines_serving_different_models_are_refused(tmp_path):
    small, large = external_member(tmp_path, "small", 500), external_member(tmp_path, "large", 1000)
    try:
        with pytest.raises(ValueError, match=f"the engines at {small.address} and {large.address} serve different"):
            EnginePool([small, large])
    finally:
        small.engine.close()
        large.engine.close()


def test_pool_config_errors_name_the_field():
    with pytest.raises(ValueError, match="max_relaunches=-1: must be >= 0"):
        PoolConfig(max_relaunches=-1)
    with pytest.raises(ValueError, match="give_up_after_s=0: must be > 0"):
        PoolConfig(give_up_after_s=0)


def test_closing_the_pool_with_requests_in_flight_takes_no_engine_out(tmp_path, caplog):
    """A normal exit closes the pool while prefetched requests still run: they fail as 'closed', and the engine is
    not reported as 'taken out: the engine was replaced while the request ran' (nor are they resent)."""
    server = launch(tmp_path, "server").process
    try:  # a client of someone else's server (no process of its own), as server.address makes one
        member = Member(server.address, TetherEngine(ClientConfig(target=server.address, **CLIENT)))
        with caplog.at_level("WARNING", logger="rollout_client.engines.pool"):
            with EnginePool([member]) as pool:
                pool.submit(RolloutRequest([5, 6, 7], SLOW)).result(timeout=120)  # connected and serving
                futures = [pool.submit(request) for request in requests(4)]
            for future in futures:  # each resolved by the close, none left waiting for an engine
                with pytest.raises(EnginesDownError, match="the engine pool was closed"):
                    future.result(timeout=60)
    finally:
        server.stop()
    assert [record.getMessage() for record in caplog.records] == []
    assert pool.metrics()["engines/taken_out"] == 0 and pool.metrics()["engines/redispatched"] == 0


def test_external_engine_restarted_on_its_address_gets_the_current_weights_again(tmp_path):
    """A rollout.v1 server restarted by its operator (same port, its start-up weights, version 0) is taken back only
    after the current weights were streamed to it again: its version is read from the server, not remembered."""
    port = free_port()

    def serve(name: str) -> EngineProcess:
        return EngineProcess("rollout_client.server", ["--engine", "scripted", "--step-delay-s", "0.005"],
                             tmp_path / f"{name}.log", port=port)

    server = serve("first")
    member = Member(f"127.0.0.1:{port}", TetherEngine(ClientConfig(target=f"127.0.0.1:{port}", **CLIENT)))
    try:
        with EnginePool([member], PoolConfig(probe_interval_s=0.05, give_up_after_s=600)) as pool:
            (reference,) = pool.submit(RolloutRequest([5, 6, 7], SLOW)).result(timeout=120)  # start-up weights
            pool.publish(3, scale(2.0))
            os.kill(server.pid, signal.SIGKILL)
            server.stop()  # down
            waiting = pool.submit(RolloutRequest([5, 6, 7], SLOW))
            give_up = time.monotonic() + 120
            while member.healthy and time.monotonic() < give_up:  # the request failed: taken out
                time.sleep(0.01)
            server = serve("second")  # back on the same port, at version 0 with scale 1
            (after,) = waiting.result(timeout=120)
            metrics = pool.metrics()
    finally:
        member.engine.close()
        server.stop()
    assert metrics["engines/taken_out"] == 1 and metrics["engines/taken_back"] == 1
    np.testing.assert_array_equal(after.completion_token_ids, reference.completion_token_ids)
    np.testing.assert_allclose(after.logprobs, 2.0 * reference.logprobs, rtol=1e-6)
    assert (after.policy_versions == 3).all()
