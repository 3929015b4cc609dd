"""Hooks in process, on a stand-in run: when they act and what they write."""

import json
import types

import numpy as np

from learner.rl import AgreementHook, CheckpointHook, MetricsHook, SummaryHook, StepRecord, default_hooks, load_config
from learner.batch import TrainBatch


def _run(tmp_path, steps=5, start_step=0):
    saved = []
    run = types.SimpleNamespace(config=load_config(None, [f"loop.steps={steps}"]), run_dir=tmp_path,
                                start_step=start_step, step=start_step, process_index=0, saved=saved,
                                save_checkpoint=saved.append,
                                trainer=types.SimpleNamespace(policy_version=7))
    return run


def _record(step, reward):
    tokens = np.full((2, 4), step, np.int32)
    batch = TrainBatch(tokens, tokens, tokens > 0, *(np.zeros((2, 4), np.float32),) * 3, tokens)
    metrics = {"reward/mean": reward, "policy/learner_version": step, "policy/server_version": step,
               "perf/step_s": 0.5, "perf/samples_per_s": 4.0}
    return StepRecord(step=step, metrics=metrics, batch=batch, samples=2, rewards=np.full(2, reward, np.float32),
                      proximal_logprobs=np.zeros((2, 4), np.float32), policy_version=step, server_version=step)


def test_checkpoints_at_the_start_every_n_steps_and_the_last_step(tmp_path):
    run, hook = _run(tmp_path, steps=5), CheckpointHook(every=2)
    hook.on_start(run)
    for step in range(1, 6):
        hook.on_step(run, _record(step, 0.0))
    assert run.saved == [0, 2, 4, 5]
    resumed = _run(tmp_path, steps=5, start_step=2)
    CheckpointHook(every=2).on_start(resumed)
    assert resumed.saved == []  # a resumed run does not save its start again


def test_metrics_hook_writes_every_step_and_drops_steps_after_a_resume(tmp_path):
    hook = MetricsHook()
    hook.on_start(_run(tmp_path))
    for step in (1, 2, 3):
        hook.on_step(None, _record(step, step / 10))
    hook.close()
    resumed = MetricsHook()
    resumed.on_start(_run(tmp_path, start_step=2))  # restored from checkpoint 2: step 3 is redone
    resumed.on_step(None, _record(3, 0.9))
    resumed.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(line["step"], line["reward/mean"]) for line in lines] == [(1, 0.1), (2, 0.2), (3, 0.9)]


def test_summary_and_agreement_at_the_end(tmp_path, capsys):
    run = _run(tmp_path, steps=3)
    summary, agreement = SummaryHook(), AgreementHook()
    for hook in (summary, agreement):
        hook.on_start(run)
        for step, reward in ((1, 0.25), (2, 0.5), (3, 1.0)):
            hook.on_step(run, _record(step, reward))
        hook.on_end(run)
    table = capsys.readouterr().out
    assert "| reward (first 3 -> last 5 steps) | 0.583 -> 0.583" in table
    assert "| steps/s (RL loop)                | 2.00" in table
    record = json.loads((tmp_path / "process_0.json").read_text())
    assert (record["steps"], record["reward_mean"], record["policy_version"]) == ([1, 2, 3], [0.25, 0.5, 1.0], 7)


def test_default_hooks_order_puts_checkpoints_after_the_writers():
    names = [type(hook).__name__ for hook in default_hooks(load_config(None))]
    assert names == ["MetricsHook", "RolloutLogHook", "ProgressHook", "PlotHook", "CheckpointHook", "AgreementHook",
                     "SummaryHook"]
    assert [hook.leader_only for hook in default_hooks(load_config(None))] == [True, True, True, True, False, False,
                                                                              True]
