"""A misbehaving environment costs its episode, never the run: a step that hangs (sync or async) is given up on
after step_timeout_s and never blocks the exit; every bad output is a counted episode error naming the environment
and the field; a run whose environment fails in 25% of its steps trains on the rest (real processes)."""

import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from learner.tasks import StepResult
from tests.e2e.test_main_job import REPO_ROOT, train_env
from tests.learner.rl.test_episodes import Echo, EchoTask, run_group

RELEASE = threading.Event()  # lets the hanging environments of this process return at the end of their test


def returning(value):
    class Returns(Echo):
        def step(self, generated):
            return value

    return Returns


BAD_STEPS = {  # what step returns -> what the error says
    "observation None": (StepResult(observation=None), "returned observation=None: must be token ids, text or chat"),
    "observation an int": (StepResult(observation=7), "returned observation=7: must be token ids, text or chat"),
    "ids beyond the vocabulary": (StepResult(observation=np.array([5, 1000])),
                                  "returned observation with id 1000 at position 1: ids must be in [0, 1000)"),
    "negative ids": (StepResult(observation=[3, -2]), "returned observation with id -2 at position 1: ids must be"),
    "ids beyond int32": (StepResult(observation=np.array([2**40])), f"returned observation with id {2**40} at"),
    "float ids": (StepResult(observation=np.array([1.5])), "returned observation as float64 values: token ids must"),
    "NaN reward": (StepResult(reward=float("nan")), "returned reward=nan: must be a finite number"),
    "infinite reward": (StepResult(reward=float("inf"), done=True), "returned reward=inf: must be a finite number"),
    "text reward": (StepResult(reward="1"), "returned reward='1': must be a finite number"),
    "done not a bool": (StepResult(done="yes"), "returned done='yes': must be a bool"),
    "info not a mapping": (StepResult(info=["tool_call"]), "returned info of type list: must be a mapping"),
    "not a StepResult": ({"observation": [3]}, "returned dict, not a learner.tasks.StepResult"),
}


@pytest.mark.parametrize("case", BAD_STEPS)
def test_a_bad_step_result_is_a_counted_episode_error_naming_the_environment_and_the_field(case):
    value, message = BAD_STEPS[case]
    episodes, episode_runner, engine = run_group(EchoTask(environment=returning(value)), num_samples=2)
    assert [e.ended_by for e in episodes] == ["env_error"] * 2 and all(np.isnan(e.reward) for e in episodes)
    assert episode_runner.metrics()["multiturn/env_errors"] == 2
    assert len(engine.requests) == 2  # the first turns only: nothing bad reached the engine
    error = episode_runner.last_environment_error
    assert error.startswith("environment of task 'echo' (returning.<locals>.Returns.step) returned "), error
    assert message in error, error


def test_an_environment_factory_that_fails_is_a_counted_episode_error():
    task = EchoTask()
    task.environment = lambda: None
    episodes, episode_runner, _ = run_group(task, num_samples=2)
    assert [e.ended_by for e in episodes] == ["env_error"] * 2
    assert "returned NoneType: it needs reset and step methods" in episode_runner.last_environment_error


@pytest.mark.parametrize("prompt, message", [(None, "returned a first prompt=None"),
                                             ([10, 5000], "returned a first prompt with id 5000 at position 1"),
                                             ([], "returned a first prompt of 0 tokens: it must have 1 to 4")])
def test_a_bad_first_prompt_is_a_counted_episode_error(prompt, message):
    class BadReset(Echo):
        def reset(self, record):
            return prompt

    episodes, episode_runner, engine = run_group(EchoTask(environment=BadReset), num_samples=2)
    assert [e.ended_by for e in episodes] == ["env_error"] * 2 and engine.requests == []
    assert episode_runner.metrics()["multiturn/env_errors"] == 2
    assert "(test_a_bad_first_prompt_is_a_counted_episode_error.<locals>.BadReset.reset)" in (
        episode_runner.last_environment_error) and message in episode_runner.last_environment_error


class Hangs(Echo):
    def step(self, generated):
        RELEASE.wait()


class HangsAsync(Echo):
    async def step(self, generated):  # blocks the event loop: no await, so no asyncio timeout can cut it
        RELEASE.wait()


@pytest.mark.parametrize("environment", [Hangs, HangsAsync], ids=["sync", "async_blocking"])
def test_a_step_that_hangs_is_given_up_on_and_counted_while_it_runs(environment):
    RELEASE.clear()
    try:
        episodes, episode_runner, _ = run_group(EchoTask(environment=environment, step_timeout_s=0.2), num_samples=2)
        assert [e.ended_by for e in episodes] == ["env_error"] * 2
        assert "took more than 0.2 s (the task's step_timeout_s): given up on" in episode_runner.last_environment_error
        metrics = episode_runner.metrics()
        assert (metrics["multiturn/env_errors"], metrics["multiturn/env_calls_abandoned"],
                metrics["multiturn/env_calls_stuck"]) == (2, 2, 2)
    finally:
        RELEASE.set()
    for _ in range(600):  # released: the given-up threads end (no deadline: only an upper bound on the polling)
        if episode_runner.metrics()["multiturn/env_calls_stuck"] == 0:
            break
        time.sleep(0.1)
    assert episode_runner.metrics()["multiturn/env_calls_stuck"] == 0


NEVER_RETURNS = """
import threading
from learner.rl.episodes import EpisodeRunner, EpisodeRequest
from rollout_client import SamplingParams
from tests.learner.rl.test_episodes import CountingEngine, Echo, EchoTask

class NeverReturns(Echo):
    def step(self, generated):
        threading.Event().wait()

task = EchoTask(environment=NeverReturns, step_timeout_s=0.5)
engine = EpisodeRunner(CountingEngine(), task)
episodes = engine.submit(EpisodeRequest(task.prompts()[0], SamplingParams(), num_samples=2)).result(120)
print([e.ended_by for e in episodes], engine.metrics()["multiturn/env_calls_stuck"], flush=True)
engine.close()
"""


def test_a_process_whose_sync_step_never_returns_still_exits():
    """The given-up calls run in daemon threads: the interpreter's exit does not wait for them (before, the
    environment's thread pool was joined at exit, forever)."""
    result = subprocess.run([sys.executable, "-c", NEVER_RETURNS], cwd=REPO_ROOT, env=train_env(),
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == "['env_error', 'env_error'] 2\n"
    assert "Traceback" not in result.stderr


@pytest.mark.slow  # a whole calculator run (compiles, warm-up, engine process): ~2-5 min on 2 loaded cores
def test_a_calculator_run_whose_environment_fails_in_25_percent_of_steps_trains_and_shows_the_failures(tmp_path):
    """One step call in four fails, in each way of FAILURES in turn (a hang included), in every group: the run
    trains its steps on the groups' other samples (before, each failure dropped its group and the run ended at
    step 1), exits 0, and the metrics count the failures."""
    from learner.reporting.metrics_writers import read_metrics

    run_dir = tmp_path / "run"
    sets = ['task.name="tests.support.flaky_environment_task:FlakyCalculator"',
            "task.args={num_prompts=64, max_turns=3, max_turn_tokens=8, step_timeout_s=3.0}",
            "warmup.steps=150", "warmup.batch_size=32", "warmup.noise=0.0",  # right answers, and wrong ones
            "rollout.prompts_per_step=4", "rollout.num_samples=4",
            "server.max_batch_size=16", "update.fast_compile=true", "update.num_minibatches=1",
            "update.ppo_epochs=1", "loop.steps=3", "optimizer.warmup_steps=0", "checkpoints.every=3",
            f"run_dir={json.dumps(str(run_dir))}"]
    command = [sys.executable, "-m", "learner.train", "--config", str(REPO_ROOT / "configs" / "tool_calculator.toml"),
               *[arg for value in sets for arg in ("--set", value)]]
    result = subprocess.run(command, cwd=REPO_ROOT, env=train_env(), capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "Traceback" not in result.stderr
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:  # every group lost an episode, and the step trained on the rest
        assert 0 < record["rollout/samples"] < 16
        assert np.isfinite(record["reward/mean"]) and np.isfinite(record["actor/grad_norm"])
    assert [r["policy/learner_version"] for r in records] == [records[0]["policy/learner_version"] + i
                                                             for i in range(3)]
    last = records[-1]
    assert last["multiturn/env_errors"] >= 3 * 4  # at least one per group: every kind of FAILURES met
    assert last["multiturn/env_calls_abandoned"] >= 1  # the hang, given up on
    assert last["rollout/groups_dropped"] >= 0
    assert "episode ended: environment of task 'tool_calculator' (FlakyEnvironment.step) raised RuntimeError: " \
           "flaky tool: crashed" in result.stderr
