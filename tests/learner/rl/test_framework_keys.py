"""A front door called directly (``corrections.from_verl(...)`` & co on a dict, keywords or a command line) returns
the loss only: the settings in its input that change training (epochs, optimizer, sampling, an advantage estimator
or a KL-in-reward Tether does not follow) are listed once, in one ``TrainingKeysWarning`` that points at the run key
``corrections.from_<framework>``; settings Tether does the same way and loss keys are not listed.
"""

from __future__ import annotations

import warnings

import pytest

import corrections
from corrections import TrainingKeysWarning
from corrections.frameworks._training import BETAS, GRPO, KL_IN_REWARD


def dropped(call) -> tuple[str, dict[str, str]]:
    """(message, {their key: Tether's key or 'not applied: why'}) of the one TrainingKeysWarning ``call()`` gives."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    listed = [w.message for w in caught if w.category is TrainingKeysWarning]
    assert len(listed) == 1, [str(w.message) for w in caught]
    return str(listed[0]), {row.key: row.tether for row in listed[0].rows}


@pytest.mark.parametrize("framework, config, want", [
    ("verl", {"algorithm": {"adv_estimator": "gae", "use_kl_in_reward": True},
              "actor_rollout_ref": {"actor": {"ppo_epochs": 2, "optim": {"lr": 1e-5}, "clip_ratio_high": 0.28}}},
     {"algorithm.adv_estimator": f"not applied: {GRPO}",
      "algorithm.use_kl_in_reward": f"not applied: {KL_IN_REWARD} (use_kl_loss)",
      "actor_rollout_ref.actor.ppo_epochs": "update.ppo_epochs",
      "actor_rollout_ref.actor.optim.lr": "optimizer.learning_rate"}),
    ("verl", {"ppo_epochs": 3, "clip_ratio_high": 0.28},  # a flat actor block
     {"actor_rollout_ref.actor.ppo_epochs": "update.ppo_epochs"}),
    ("skyrl", {"trainer": {"update_epochs_per_batch": 2, "policy": {"optimizer_config": {"adam_betas": [0.9, 0.95]}},
                           "algorithm": {"advantage_estimator": "rloo", "eps_clip_high": 0.28}}},
     {"trainer.update_epochs_per_batch": "update.ppo_epochs",
      "trainer.policy.optimizer_config.adam_betas": f"not applied: {BETAS}",
      "trainer.algorithm.advantage_estimator": f"not applied: {GRPO}"}),
    ("slime", "--lr 1e-5 --eps-clip 0.2 --n-samples-per-prompt 8",
     {"--lr": "optimizer.learning_rate", "--n-samples-per-prompt": "rollout.num_samples"}),
    ("areal", {"actor": {"eps_clip": 0.2, "optimizer": {"lr": 1e-5}}, "gconfig": {"n_samples": 4}},
     {"actor.optimizer.lr": "optimizer.learning_rate", "gconfig.n_samples": "rollout.num_samples"}),
])
def test_direct_call_lists_the_training_settings_it_drops(framework, config, want):
    door = getattr(corrections, f"from_{framework}")
    message, listed = dropped(lambda: door(config))
    assert listed == want
    assert f"corrections.from_{framework} = " in message and "learner.rl.framework_config" in message
    for key in want:
        assert f"{key}=" in message


def test_the_loss_is_unchanged_by_the_listed_settings():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrainingKeysWarning)
        with_training = corrections.from_verl({"actor_rollout_ref.actor.clip_ratio_high": 0.28,
                                               "actor_rollout_ref.actor.ppo_epochs": 4})
    assert with_training == corrections.from_verl({"actor_rollout_ref.actor.clip_ratio_high": 0.28})
    assert with_training.objective.clip_high == 0.28


@pytest.mark.parametrize("call", [
    lambda: corrections.from_verl({"algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
                                   "actor_rollout_ref": {"actor": {"clip_ratio_high": 0.28}}}),
    lambda: corrections.from_verl({"actor_rollout_ref.actor.optim.lr": None}),  # null: Tether's value stays
    lambda: corrections.from_skyrl({"trainer": {"algorithm": {"advantage_estimator": "grpo"}}}),
    lambda: corrections.from_slime("--use-tis --tis-clip 2.0 --kl-coef 0"),
    lambda: corrections.from_areal({"actor": {"eps_clip": 0.2, "kl_ctl": 0.0}}),
])
def test_no_warning_when_nothing_that_changes_training_is_dropped(call):
    """Loss keys, nulls and settings Tether does the same way (GRPO, no KL in the reward, a zero kl_coef)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrainingKeysWarning)
        call()


def test_config_from_dict_lists_them_too():
    _, listed = dropped(lambda: corrections.config_from_dict(
        {"actor_rollout_ref": {"actor": {"ppo_epochs": 2, "clip_ratio": 0.2}}}))
    assert listed == {"actor_rollout_ref.actor.ppo_epochs": "update.ppo_epochs"}
