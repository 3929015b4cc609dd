"""Hooks in process, on a stand-in run's `RunView`: when they act and what they write."""

import dataclasses
import json
import types

import numpy as np

from learner.reporting.progress import StartupTimes
from learner.rl import (
    AgreementHook,
    CheckpointHook,
    MetricsHook,
    RunView,
    StepRecord,
    SummaryHook,
    default_hooks,
    load_config,
)
from learner.update.batch import TrainBatch


def _run(tmp_path, steps=5, start_step=0, resumed=False, saved=None):
    """A run's view without a run: ``saved`` collects the steps checkpointed."""
    return RunView(config=load_config(None, [f"loop.steps={steps}"]), run_dir=tmp_path, process_index=0, task=None,
                   engine=None, start_step=start_step, resumed=resumed, max_new_tokens=4, length=4,
                   startup_times=StartupTimes(), save_checkpoint=(saved if saved is not None else []).append)


def _record(step, reward):
    tokens = np.full((2, 4), step, np.int32)
    batch = TrainBatch(tokens, tokens, tokens > 0, *(np.zeros((2, 4), np.float32),) * 3, tokens)
    metrics = {"reward/mean": reward, "policy/learner_version": step, "policy/server_version": step,
               "perf/step_s": 0.5, "perf/samples_per_s": 4.0}
    return StepRecord(step=step, metrics=metrics, batch=batch, samples=2, rewards=np.full(2, reward, np.float32),
                      proximal_logprobs=np.zeros((2, 4), np.float32), policy_version=step, server_version=step)


def test_checkpoints_at_the_start_every_n_steps_and_the_last_step(tmp_path):
    saved = []
    run, hook = _run(tmp_path, steps=5, saved=saved), CheckpointHook(every=2)
    hook.on_start(run)
    for step in range(1, 6):
        hook.on_step(run, _record(step, 0.0))
    assert saved == [0, 2, 4, 5]
    resumed = []
    CheckpointHook(every=2).on_start(_run(tmp_path, steps=5, start_step=2, resumed=True, saved=resumed))
    assert resumed == []  # a resumed run does not save its start again
    from_zero = []  # killed before its first periodic save: resumed from step 0's checkpoint
    CheckpointHook(every=2).on_start(_run(tmp_path, steps=5, start_step=0, resumed=True, saved=from_zero))
    assert from_zero == []


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
            record = _record(step, reward)
            record.metrics["rollout/kept_fraction"] = 0.5 if step == 2 else 0.875
            if step == 2:
                record.metrics.update({"eval/pass@1": 0.5, "eval/dropped_samples": 0.0, "eval/skipped_samples": 3.0})
            hook.on_step(run, record)
        hook.on_end(run)
    table = capsys.readouterr().out
    assert "| reward (first step -> last step)     | 0.250 -> 1.000" in table  # 3 steps: not "first 20"
    assert "| wall time (start-up included)" in table
    assert "| samples trained on (mean, min share) | 0.75, 0.50" in table
    assert "| steps/s (RL loop)                    | 2.00" in table
    assert "| eval/pass@1 (step 2)                 | 0.500" in table  # the last evaluation
    assert "eval/skipped_samples (step 2)" in table and "eval/dropped_samples" not in table  # counters where not 0
    record = json.loads((tmp_path / "process_0.json").read_text())
    assert (record["steps"], record["reward_mean"], record["policy_version"]) == ([1, 2, 3], [0.25, 0.5, 1.0], 3)


def test_default_hooks_order_puts_evaluation_first_and_checkpoints_after_the_writers():
    names = [type(hook).__name__ for hook in default_hooks(load_config(None))]
    assert names == ["EvalHook", "MetricsHook", "RolloutLogHook", "ProgressHook", "PlotHook", "CheckpointHook",
                     "AgreementHook", "SummaryHook"]
    assert [hook.leader_only for hook in default_hooks(load_config(None))] == [True, True, True, True, True, False,
                                                                              False, True]


class _AnsweringEngine:
    """Stands in for an engine: completes each prompt with a scripted answer (by prompt text and sample index)."""

    def __init__(self, tokenizer, answers):
        self.tokenizer, self.answers, self.requests = tokenizer, answers, []

    def submit(self, request):
        import concurrent.futures
        self.requests.append(request)
        prompt = self.tokenizer.decode(request.prompt_token_ids, skip_special_tokens=True)
        samples = [types.SimpleNamespace(sample_index=i, completion_token_ids=self.tokenizer.encode(text))
                   for i, text in enumerate(self.answers(prompt, request)) if text is not None]
        future = concurrent.futures.Future()
        future.set_result(samples)
        return future


def test_eval_hook_scores_greedy_and_sampled_completions_of_the_validation_prompts(tmp_path):
    from learner.rl import EvalHook
    from learner.tasks import load_task
    rows = [{"q": f"{a}+{b}=", "a": str(a + b)} for a in range(3) for b in range(3)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "valid.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[:2]))  # 0+0, 0+1
    task = load_task("dataset", {"path": str(tmp_path / "train.jsonl"), "prompt_column": "q", "answer_column": "a",
                                 "tokenizer": "char", "rewards": ["exact_match"], "max_completion_tokens": 4,
                                 "validation": {"path": str(tmp_path / "valid.jsonl"), "every": 2}})

    def answers(prompt, request):
        if request.sampling.top_k == 1:  # greedy: right on 0+0, wrong on 0+1
            return ["0"] if "0+0" in prompt else ["7"]
        # sampled, 4 per prompt: 0+0 two right of 4; 0+1 one right, and one sample dropped by the client
        return ["0", "5", "0", "5"] if "0+0" in prompt else ["1", "2", None, "3"]

    engine = _AnsweringEngine(task.tokenizer, answers)
    run = dataclasses.replace(_run(tmp_path), config=load_config(None, ["loop.steps=3", "rollout.num_samples=4"]),
                              task=task, engine=engine)
    hook = EvalHook()
    hook.on_start(run)
    records = {step: _record(step, 0.0) for step in (1, 2, 3)}
    for step, record in records.items():  # noqa: B007
        hook.on_step(run, record)
    assert "eval/pass@1" not in records[1].metrics  # every 2 steps, and at the last step
    for step in (2, 3):
        metrics = records[step].metrics
        assert metrics["eval/greedy/pass@1"] == 0.5
        assert metrics["eval/reward_mean"] == 3 / 8  # 3 right of 8 (the dropped one counts as wrong)
        assert metrics["eval/pass@1"] == (2 / 4 + 1 / 4) / 2
        assert metrics["eval/pass@4"] == 1.0
        assert metrics["eval/dropped_samples"] == 1
    assert len(engine.requests) == 2 * 2 * 2  # 2 evaluations x 2 prompts x (greedy, sampled)
    greedy = [r for r in engine.requests if r.num_samples == 1]
    assert all(r.sampling.top_k == 1 and r.sampling.temperature == 1.0 for r in greedy)


def test_eval_hook_is_inactive_for_tasks_without_validation(tmp_path):
    from learner.rl import EvalHook
    from learner.tasks import load_task
    run = dataclasses.replace(_run(tmp_path), task=load_task("addition_1digit", {}))
    hook = EvalHook()
    hook.on_start(run)
    record = _record(5, 0.0)
    hook.on_step(run, record)
    assert not any(key.startswith("eval/") for key in record.metrics)


def test_the_plot_refresh_draws_on_a_thread_and_the_end_waits_for_its_own(tmp_path, monkeypatch):
    import threading

    from learner.rl import PlotHook
    from learner.rl import hooks as hooks_module

    release, drawn = threading.Event(), []

    def slow_plot(metrics_path, png_path, panels):
        release.wait(60)
        drawn.append(png_path)

    monkeypatch.setattr(hooks_module, "plot_learning_curves", slow_plot)
    hook, run = PlotHook(every=2, num_samples=4), _run(tmp_path)
    hook.on_step(run, types.SimpleNamespace(step=2))  # returns while the refresh still draws
    hook.on_step(run, types.SimpleNamespace(step=4))  # due while the last one draws: skipped
    assert drawn == [] and hook._drawing.is_alive()
    release.set()
    hook.on_end(run)  # waits for the refresh in flight, then draws the end's
    assert drawn == [tmp_path / "learning_curves.png"] * 2
