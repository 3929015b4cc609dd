"""`Run` driven in process as a notebook would, against the real embedded server (a child process on 127.0.0.1)."""

import json
import os
import signal

import numpy as np
import pytest

from learner.checkpoints.checkpointer import CheckpointConfig, Checkpointer
from learner.rl import CheckpointHook, Hook, MetricsHook, ResumeConfigError, Run, load_config

# A shortened default run: few steps, small batches, fast compiles. 4 prompts x 4 samples = 16 rows per step.
SHORT = ["warmup.steps=2", "warmup.batch_size=16", "rollout.prompts_per_step=4", "rollout.num_samples=4",
         "server.max_batch_size=16", "update.fast_compile=true"]


def short_config(run_dir, *overrides):
    return load_config("configs/default.toml", [*SHORT, f"run_dir={json.dumps(str(run_dir))}", *overrides])


class Recorder(Hook):
    """Records every call, to check the documented order."""

    def __init__(self):
        self.calls = []

    def on_start(self, run):
        self.calls.append(("start", run.start_step))

    def on_step(self, run, record):
        self.calls.append(("step", record.step))

    def on_end(self, run):
        self.calls.append(("end",))

    def close(self):
        self.calls.append(("close",))


class KillEngineAt(Hook):
    """SIGKILLs the launched engine's server after a step (a crash, an OOM kill)."""

    def __init__(self, step):
        self.step, self.killed = step, None

    def on_step(self, run, record):
        if record.step == self.step:
            (member,) = run.engine.members
            self.killed = member.engine.process
            os.kill(self.killed.pid, signal.SIGKILL)


class RaiseAt(Hook):
    def __init__(self, step):
        self.step = step

    def on_step(self, run, record):
        if record.step == self.step:
            raise KeyboardInterrupt(f"stop at {self.step}")


def test_three_steps_from_a_notebook_then_a_finished_rerun_then_a_refused_resume(tmp_path):
    config = short_config(tmp_path / "run", "loop.steps=3")
    recorder = Recorder()
    with Run(config, hooks=[MetricsHook(), recorder, CheckpointHook(every=2)]) as run:
        records = list(run.steps())
        assert run.finished
    assert [r.step for r in records] == [1, 2, 3]
    for record in records:
        assert record.policy_version == record.server_version == 2 + record.step  # 2 warm-up updates before
        assert record.samples == 16 and record.rewards.shape == (16,)
        assert set(np.unique(record.rewards)) <= {0.0, 1.0}
        assert record.metrics["reward/mean"] == pytest.approx(float(record.rewards.mean()))
        assert record.proximal_logprobs.shape == (16, record.batch.tokens.shape[1])
        lp = record.proximal_logprobs[record.batch.loss_mask[:16] > 0]
        assert np.all(lp <= 0) and np.all(np.isfinite(lp))
        # staleness 1: each token was sampled by the policy before this update or the one before it
        versions = record.batch.policy_version[record.batch.loss_mask > 0]
        assert versions.max() <= record.policy_version - 1 and versions.min() >= record.policy_version - 2
    assert recorder.calls == [("start", 0), ("step", 1), ("step", 2), ("step", 3), ("end",), ("close",)]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    with Checkpointer(CheckpointConfig(str(tmp_path / "run" / "checkpoints"))) as checkpointer:
        assert checkpointer.all_steps() == [2, 3]  # every 2 and the last; keep_last 2 dropped step 0

    again = Recorder()
    with Run(config, hooks=[again]) as run:  # finished: no engine, no hooks, no steps
        assert run.finished and run.engine is None and list(run.steps()) == []
    assert again.calls == []

    with pytest.raises(ResumeConfigError, match=r"task.name changed.*loop.allow_config_change"):
        with Run(short_config(tmp_path / "run", "loop.steps=4", "task.name=sort_digits"), hooks=[]):
            pass


@pytest.mark.slow  # 45 s on a quiet 2-core run: out of the default run's 15 minutes
def test_an_exception_right_after_a_checkpoint_save_started_keeps_that_checkpoint_and_a_killed_engine_is_relaunched(
        tmp_path):
    config = short_config(tmp_path / "run", "loop.steps=4")
    recorder = Recorder()
    with pytest.raises(KeyboardInterrupt, match="stop at 2"):
        with Run(config, hooks=[recorder, CheckpointHook(every=1), RaiseAt(2)]) as run:
            for _ in run.steps():
                pass
    assert recorder.calls[-1] == ("close",) and ("end",) not in recorder.calls
    directory = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in directory.iterdir()) == ["1", "2"]  # complete: no *.orbax-checkpoint-tmp left
    with Checkpointer(CheckpointConfig(str(directory))) as checkpointer:
        assert checkpointer.read_metadata(2)["policy_version"] == 2 + 2

    resumed, kill = Recorder(), KillEngineAt(3)
    with Run(config, hooks=[resumed, kill]) as run:  # resumes from the kept checkpoint
        assert run.start_step == 2
        records = list(run.steps())  # the engine dies after step 3: relaunched, given the weights, steps go on
        (member,) = run.engine.members
    assert [r.step for r in records] == [3, 4]
    assert resumed.calls[0] == ("start", 2)
    assert kill.killed.returncode == -signal.SIGKILL and member.engine.process is not kill.killed
    assert records[-1].metrics["engines/relaunches"] == 1 and records[-1].metrics["engines/taken_back"] == 1
    assert all(r.server_version == r.policy_version == 2 + r.step for r in records)


@pytest.mark.slow  # 45 s on a quiet 2-core run: out of the default run's 15 minutes
def test_kl_to_the_reference_policy_trains_reports_kl_loss_and_survives_a_resume(tmp_path):
    # Clean demonstrations give a policy right often enough that the first step has groups with mixed rewards (a
    # gradient), so the policy moves away from the reference; one optimizer update per step, so the first step's
    # KL is that of the reference itself.
    # A step whose groups all agree (every sample right, or every one wrong) has no gradient and leaves the policy
    # where it was; samples draw their own seeds, so which steps move is not fixed: the KL is checked against them.
    warm = ("warmup.steps=40", "warmup.noise=0.0", "update.num_minibatches=1", "update.ppo_epochs=1")
    config = short_config(tmp_path / "run", *warm, "loop.steps=3", "corrections.overrides={kl_coef=0.05}")
    with Run(config, hooks=[CheckpointHook(every=1)]) as run:
        initial = {k: np.asarray(v) for k, v in run.trainer.host_weights().items()}
        records = list(run.steps())
        reference = run.trainer.reference
    kl = [r.metrics["actor/kl_loss"] for r in records]
    moved = np.cumsum([r.metrics["actor/grad_norm"] > 0 for r in records]) > 0  # trained at this step or before
    assert kl[0] == pytest.approx(0.0, abs=1e-6)  # the first update starts at the reference policy
    assert moved[1], "no gradient in two steps: the test's warm-up should give groups with mixed rewards"
    for step in (1, 2):  # once an update has moved the policy away from the reference, its KL is positive
        assert (kl[step] > 0) if moved[step - 1] else kl[step] == pytest.approx(0.0, abs=1e-6)
        assert np.isfinite(kl[step])
    # The reference stays the frozen initial policy (it is not trained).
    names = sorted(initial)
    flat_reference = dict(zip(names, [np.asarray(x) for x in _leaves_in_name_order(reference, names)]))
    for name in names:
        np.testing.assert_array_equal(flat_reference[name], initial[name])

    with Run(short_config(tmp_path / "run", *warm, "loop.steps=4", "corrections.overrides={kl_coef=0.05}"),
             hooks=[]) as run:  # the checkpoint holds the reference: restored, not re-frozen from step 3's policy
        for name, leaf in zip(names, _leaves_in_name_order(run.trainer.reference, names)):
            np.testing.assert_array_equal(np.asarray(leaf), initial[name])
        [record] = list(run.steps())
        assert record.metrics["actor/kl_loss"] > 0


def _leaves_in_name_order(params, names):
    from learner.model.param_paths import parameter_names

    own, _ = parameter_names(params)
    by_name = dict(zip(own, __import__("jax").tree.leaves(params)))
    return [by_name[name] for name in names]


def test_a_model_context_too_short_for_prompt_and_completion_is_refused_at_start():
    """The tiny model has 256 positions: 300 new tokens cannot fit, and the bucketed batch length must not hide it."""
    from learner.rl.trainer import Trainer
    from learner.tasks import load_task

    config = load_config("configs/default.toml", ["rollout.max_new_tokens=300"])
    with pytest.raises(ValueError, match=r"plus 300 new tokens \(rollout.max_new_tokens, .*exceed the model's "
                                         r"context of 256 positions: lower task.args.max_prompt_tokens or "
                                         r"rollout.max_new_tokens"):
        Trainer(config, load_task(config.task.name, {"num_prompts": 8}))


@pytest.mark.slow  # an in-process run of 2 steps
def test_dropped_samples_show_as_the_kept_share_and_a_step_under_half_warns_once(tmp_path, monkeypatch):
    """3 of 4 groups lose 3 of their 4 samples to a failed reward (NaN). A failed sample costs only itself, but a
    group left with fewer than 2 scored samples is dropped: each step trains on the last group, 4 of 16 samples."""
    from learner.tasks._digit_tasks import Addition

    original = Addition.rewards

    def rewards(self, rows, completions):
        values = np.asarray(original(self, rows, completions), np.float32)
        values = values.reshape(-1, 4)  # [groups, samples]
        values[:-1, :3] = np.nan  # 3 samples of every group but the last
        return values.reshape(-1)

    monkeypatch.setattr(Addition, "rewards", rewards)
    with pytest.warns(UserWarning, match=r"step 1 trained on 4 of 16 samples .* warned once") as warned:
        with Run(short_config(tmp_path / "run", "loop.steps=2", "warmup.steps=0", "update.num_minibatches=1",
                              "update.ppo_epochs=1", "corrections.overrides={}"), hooks=[]) as run:
            records = list(run.steps())
    assert [r.metrics["rollout/kept_fraction"] for r in records] == [0.25, 0.25]
    assert sum("trained on" in str(w.message) for w in warned) == 1
