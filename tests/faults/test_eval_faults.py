"""Evaluation under faults: its requests are retried as training requests are (the client's retries, the engine
pool's resends), and a final failure ends the CLI with one ``error:`` line. Against a real server process that ends
Generate calls with CANCELLED (`tests.support.cancelling_server`)."""

import dataclasses
import json
import types

import pytest

from learner.rl.config import client_config, load_config
from learner.rl.hooks import EvalHook, EvaluationError
from learner.tasks import load_task
from learner.train import errors_as_lines
from rollout_client import EnginePool, EngineProcess, Member, TetherEngine


def _evaluation_run(tmp_path, cancel_attempts: int, status: str = "CANCELLED"):
    """A run's evaluation side (task with validation prompts, config, engine pool) against the cancelling server."""
    rows = [{"question": f"{a}+{b}", "answer": str(a + b)} for a in range(4) for b in range(4)]
    (tmp_path / "sums.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = {"path": str(tmp_path / "sums.jsonl"), "prompt_column": "question", "answer_column": "answer",
            "tokenizer": "char", "rewards": ["exact_match"], "max_completion_tokens": 3,
            "validation": {"fraction": 0.25, "every": 5}}
    config = load_config(None, ["rollout.num_samples=2", "server.generate_deadline_s=20.0"])
    config = dataclasses.replace(config, task=dataclasses.replace(config.task, name="dataset", args=args))
    task = load_task(config.task.name, config.task.args)
    vocab = task.tokenizer.vocab_size
    process = EngineProcess("tests.support.cancelling_server", ["--cancel-attempts", str(cancel_attempts),
                                                              "--status", status, "--vocab-size", str(vocab)],
                            tmp_path / "server.log", start_timeout_s=60)
    engine = TetherEngine(client_config(config, process.address, auth_token=None, vocab_size=vocab), process=process)
    pool = EnginePool([Member(process.address, engine)])
    return types.SimpleNamespace(task=task, config=config, engine=pool, max_new_tokens=3)


def test_an_evaluation_whose_calls_are_cancelled_once_is_retried_and_scored(tmp_path):
    run = _evaluation_run(tmp_path, cancel_attempts=1)
    try:
        hook = EvalHook()
        hook.on_start(run)
        record = types.SimpleNamespace(step=5, metrics={})
        hook.on_step(run, record)
        requests = 2 * len(run.task.validation_records())  # sampled and greedy
        assert run.engine.metrics()["generate/retries"] == requests
    finally:
        run.engine.close()
    assert record.metrics["eval/dropped_samples"] == 0
    assert 0.0 <= record.metrics["eval/reward_mean"] <= 1.0 and "eval/greedy/pass@1" in record.metrics


def test_an_evaluation_that_fails_ends_the_cli_with_one_error_line(tmp_path):
    """A failure no retry helps (INTERNAL; an engine that stays down ends the run as EnginesDownError, its own line)."""
    run = _evaluation_run(tmp_path, cancel_attempts=1000, status="INTERNAL")
    try:
        hook = EvalHook()
        hook.on_start(run)
        with pytest.raises(SystemExit) as exit_info, errors_as_lines():
            hook.on_step(run, types.SimpleNamespace(step=5, metrics={}))
    finally:
        run.engine.close()
    message = str(exit_info.value.code)
    assert message.startswith("error: step 5: evaluation failed: ") and "\n" not in message, message
    assert "INTERNAL" in message
    assert isinstance(exit_info.value.__context__, EvaluationError)
