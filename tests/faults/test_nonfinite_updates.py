"""Non-finite updates: skipped and counted however many come in a row, never checkpointed; a run whose updates stay
non-finite stops after ``optimizer.max_consecutive_skips`` steps with its latest checkpoint finite."""

import json

import jax
import numpy as np
import pytest

from learner.checkpoints.checkpointer import CheckpointConfig, Checkpointer, restore_target
from learner.rl import CheckpointHook, Run, load_config
from learner.rl.run import NonFiniteUpdateError
from learner.rl.trainer import Trainer

SHORT = ["warmup.steps=0", "rollout.prompts_per_step=2", "rollout.num_samples=2", "server.max_batch_size=8",
         "update.fast_compile=true", "update.num_minibatches=1", "update.ppo_epochs=1",  # one optimizer update a step
         "corrections.overrides={}"]  # no KL reference: the checkpoint is the train state alone


def short_config(run_dir, *overrides):
    return load_config("configs/default.toml", [*SHORT, f"run_dir={json.dumps(str(run_dir))}", *overrides])


def _nan_advantages_from(step_of_first_nan):
    """A `Trainer.train` whose batches' advantages are NaN from the given call on (1-based)."""
    original, calls = Trainer.train, []

    def train(self, batch, raw_logprobs=False):
        calls.append(1)
        if len(calls) >= step_of_first_nan:
            batch = batch.replace(advantages=np.full_like(batch.advantages, np.nan))
        return original(self, batch, raw_logprobs)

    return train


def _host(tree):
    return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


@pytest.mark.slow  # 41 s on a quiet 2-core run: out of the default run's 15 minutes
def test_run_stops_after_max_consecutive_skips_and_its_checkpoint_is_finite(tmp_path, monkeypatch):
    monkeypatch.setattr(Trainer, "train", _nan_advantages_from(2))
    # 3 in a row (not the default 10) keeps the run short; tests/learner/update/test_optimizer.py skips 12 in a row at a
    # lower limit, so an optimizer that applied after a fixed count (optax.apply_if_finite) still fails there.
    config = short_config(tmp_path / "run", "loop.steps=10", "optimizer.max_consecutive_skips=3")
    steps = []
    with pytest.raises(NonFiniteUpdateError, match=r"steps 2 to 4: .*optimizer.max_consecutive_skips = 3"):
        with Run(config, hooks=[CheckpointHook(every=1)]) as run:
            trainer = run.trainer
            for record in run.steps():
                steps.append(record.step)
                if record.step == 1:
                    after_first = _host(run.trainer.state.params), _host(run.trainer.state.opt_state.inner_state)
                else:  # skipped: parameters and Adam moments as after step 1, the skip counted
                    for a, b in zip(_host(run.trainer.state.params), after_first[0]):
                        np.testing.assert_array_equal(a, b)
                    for a, b in zip(_host(run.trainer.state.opt_state.inner_state), after_first[1]):
                        np.testing.assert_array_equal(a, b)
                    assert int(run.trainer.state.opt_state.total_notfinite) == record.step - 1
                    assert record.metrics["actor/skipped_updates"] == record.step - 1
    assert steps == list(range(1, 4))  # step 4 raised before its hooks: no checkpoint of it
    directory = tmp_path / "run" / "checkpoints"
    with Checkpointer(CheckpointConfig(str(directory))) as checkpointer:
        assert checkpointer.latest_step() == 3
        restored = checkpointer.restore(restore_target(trainer.state, trainer.shardings))
    assert restored.step == 3 and restored.skipped == ()
    assert all(np.isfinite(leaf).all() for leaf in _host(restored.state.params))
    for a, b in zip(_host(restored.state.params), after_first[0]):
        np.testing.assert_array_equal(a, b)

    # A NaN state is refused, and nothing is written.
    with Run(config, hooks=[]) as run:
        assert run.start_step == 3
        run.trainer.state = run.trainer.state.replace(
            params=jax.tree.map(lambda x: x * np.nan, run.trainer.state.params))
        with pytest.raises(NonFiniteUpdateError, match="step 4: the train state holds NaN"):
            run.save_checkpoint(4)
    assert sorted(p.name for p in directory.iterdir()) == ["2", "3"]  # no 4


@pytest.mark.slow  # 20 s on a quiet 2-core run: out of the default run's 15 minutes
def test_a_run_whose_every_update_was_skipped_never_finishes(tmp_path, monkeypatch):
    """Fewer steps than max_consecutive_skips, all skipped: the last step raises (no checkpoint of it, so a rerun
    does not report the run finished), naming what was non-finite."""
    monkeypatch.setattr(Trainer, "train", _nan_advantages_from(1))
    config = short_config(tmp_path / "run", "loop.steps=3")
    with pytest.raises(NonFiniteUpdateError, match=r"steps 1 to 3: every one skipped .* never finishes\)\. "
                                                   r"Non-finite at step 3: .*actor/pg_loss.* latest checkpoint is 2"):
        with Run(config, hooks=[CheckpointHook(every=1)]) as run:
            run.train()


@pytest.mark.slow  # 17 s on a quiet 2-core run: out of the default run's 15 minutes
def test_a_plugin_tasks_reward_beyond_the_bound_is_skipped_and_counted(tmp_path):
    """A task computing its own rewards (no RewardSet) returns 1e300 for one sample a step: its group is left out,
    the sample counted in reward/skipped_samples, and the update trains on finite rewards."""
    config = short_config(tmp_path / "run", "loop.steps=2", "task.args={num_prompts=64}",
                          'task.name="tests.support.flaky_reward_task:HugeFirstReward"')
    with Run(config, hooks=[]) as run:
        records = list(run.steps())
    for record in records:
        assert record.metrics["reward/skipped_samples"] == 1
        assert record.samples == 2 and record.metrics["rollout/kept_fraction"] == 0.5  # 2 groups of 2, one left out
        assert np.isfinite(record.metrics["reward/mean"]) and record.metrics["actor/skipped_updates"] == 0
