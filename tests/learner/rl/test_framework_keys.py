"""What a direct call does not apply, a run does: the settings of a framework config that change training
(epochs, optimizer, sampling, an advantage estimator or a KL-in-reward Tether does not follow) get their meaning in
a Tether run from ``learner.rl.framework_keys`` (the run-config key, or why Tether does not follow it), and each is
one the front door (``corrections.from_verl`` & co) lists as not applied: as its framework's key outside the loss
(``TrainingKeysWarning``) or as a key it does not know (``UnknownKeyWarning``). None is dropped silently.
"""

from __future__ import annotations

import warnings

import pytest

import corrections
from corrections.frameworks import nest, slime_arguments, whole
from learner.rl.framework_keys import BETAS, GRPO, KL_IN_REWARD, NOT_USED, rows


def name(framework: str, key: str) -> str:
    """A key as the tables and the warnings both name it (slime's ``--tis-clip`` and ``tis_clip`` alike)."""
    return key.removeprefix("--").replace("-", "_") if framework == "slime" else key


def listed(framework: str, config) -> set[str]:
    """The keys a direct call says it does not apply: its TrainingKeysWarning's and its UnknownKeyWarnings'."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        getattr(corrections, f"from_{framework}")(config)
    keys = set()
    for warning in caught:
        if isinstance(warning.message, corrections.TrainingKeysWarning):
            assert warning.message.framework == framework
            keys |= set(warning.message.settings)
        elif isinstance(warning.message, corrections.UnknownKeyWarning):
            keys.add(warning.message.path.split(".", 1)[1])  # "verl.data" -> "data"
    return {name(framework, key) for key in keys}


def training_rows(framework: str, config) -> dict[str, str]:
    """{their key: Tether's run key or 'not applied: why'} of the config's settings that change training."""
    data = slime_arguments(config) if framework == "slime" else nest(config, framework)
    table, _ = rows(framework, whole(framework, data), set())
    return {row.key: row.tether for row in table if not row.tether.startswith(("corrections.", NOT_USED))}


@pytest.mark.parametrize("framework, config, want", [
    ("verl", {"algorithm": {"adv_estimator": "gae", "use_kl_in_reward": True},
              "actor_rollout_ref": {"actor": {"ppo_epochs": 2, "optim": {"lr": 1e-5}, "clip_ratio_high": 0.28}},
              "data": {"train_batch_size": 64}},
     {"algorithm.adv_estimator": f"not applied: {GRPO}",
      "algorithm.use_kl_in_reward": f"not applied: {KL_IN_REWARD} (use_kl_loss)",
      "actor_rollout_ref.actor.ppo_epochs": "update.ppo_epochs",
      "actor_rollout_ref.actor.optim.lr": "optimizer.learning_rate",
      "data.train_batch_size": "rollout.prompts_per_step"}),
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
def test_the_training_settings_a_direct_call_lists_get_their_run_meaning(framework, config, want):
    assert training_rows(framework, config) == want
    dropped = listed(framework, config)
    for key in want:
        key = name(framework, key)
        assert any(key == other or key.startswith(f"{other}.") for other in dropped), (key, dropped)


@pytest.mark.parametrize("framework, config", [
    ("verl", {"algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
              "actor_rollout_ref": {"actor": {"clip_ratio_high": 0.28, "optim": {"lr": None}}}}),
    ("skyrl", {"trainer": {"algorithm": {"advantage_estimator": "grpo"}}}),
    ("slime", "--use-tis --tis-clip 2.0 --kl-coef 0"),
    ("areal", {"actor": {"eps_clip": 0.2, "kl_ctl": 0.0}}),
])
def test_settings_tether_does_the_same_way_change_nothing(framework, config):
    """GRPO, no KL in the reward, a zero kl_coef and a null (Tether's value stays): no run key, nothing not applied."""
    assert training_rows(framework, config) == {}
