"""The front doors read the frameworks' own config files unedited (tests/fixtures/frameworks, README there names
repository, path and commit): verl's resolved ``_generated_ppo_trainer.yaml``, its Hydra composition files
``ppo_trainer.yaml``, ``actor/actor.yaml``, ``actor/dp_actor.yaml`` and ``algorithm/rollout_correction.yaml``,
SkyRL's ``ppo_base_config.yaml``, a slime launch script and an AReaL example. Keys outside the loss and keys newer
than the reader's framework commit are listed (``UnknownKeyWarning``), not fatal; a misspelt loss key and an
unknown key inside a loss block still raise. Hydra composition against the file's folder is here; the ``defaults``
entries it leaves are test_hydra_defaults'. Two files' losses are compared with the reference ports on the batch of
test_front_doors.
"""

from __future__ import annotations

import pathlib
import warnings

import numpy as np
import pytest

import corrections
from corrections import CorrectionConfig, ImportanceWeights, Objective, RejectionRule, UnknownKeyWarning
from learner.rl.framework_files import read_composed, read_file
from tests.corrections.test_front_doors import ATOL, RTOL, batch, run
from tests.support.reference_ports import areal, verl

# The keys outside the loss the front doors list are tested in tests/corrections/test_front_doors.py, not here.
pytestmark = pytest.mark.filterwarnings("ignore::corrections.TrainingKeysWarning")
FILES = pathlib.Path(__file__).parents[2] / "fixtures" / "frameworks"
VERL_DEFAULT = CorrectionConfig(objective=Objective("ppo", dual_clip=3.0), denominator="kept")
# use_kl_loss=True kl_loss_coef=0.001 kl_loss_type=low_var_kl entropy_coeff=0
VERL_GRPO_KL = CorrectionConfig(objective=Objective("ppo", dual_clip=3.0), denominator="kept", kl_coef=0.001,
                                kl_estimator="low_var_kl")
EXPECTED = {
    "verl/_generated_ppo_trainer.yaml": VERL_DEFAULT,
    "verl/ppo_trainer.yaml": VERL_DEFAULT,
    "verl/actor/actor.yaml": VERL_DEFAULT,
    "verl/actor/dp_actor.yaml": VERL_DEFAULT,
    "verl/algorithm/rollout_correction.yaml": VERL_DEFAULT,
    "skyrl/ppo_base_config.yaml": CorrectionConfig(kl_coef=0.001),  # SkyRL's KL loss is on by default
    "areal/gsm8k_grpo.yaml": CorrectionConfig(objective=Objective("ppo", clip_low=0.4, clip_high=0.4),
                                              importance=ImportanceWeights("token", high=None),
                                              rejection=(RejectionRule("token_k1", None, 5.0),)),
    # verl's launch scripts: their Hydra overrides over verl's defaults
    "verl/examples/grpo_trainer/run_qwen2-7b.sh": VERL_GRPO_KL,
    "verl/examples/grpo_trainer/run_qwen3-8b_npu.sh": VERL_GRPO_KL,
    "verl/examples/ppo_trainer/run_deepseek7b_llm.sh": VERL_DEFAULT,  # use_kl_loss=False
    "verl/examples/gspo_trainer/run_qwen3_32b_gspo_npu.sh": CorrectionConfig(
        objective=Objective("gspo", clip_low=0.0003, clip_high=0.0004), reduction="seq-mean-token-mean",
        denominator="kept"),  # clip_ratio_c=10.0 is vanilla PPO's dual clip, not read by GSPO (as in verl)
    "slime/run-qwen3-4B.sh": CorrectionConfig(objective=Objective("ppo", clip_low=0.2, clip_high=0.28),
                                              reduction="seq-mean-token-mean"),
}


def read_through_door(name: str):
    """(config, listed keys) of a fixture file read and given to its framework's front door."""
    door = getattr(corrections, f"from_{name.split('/')[0]}")  # the folder names the framework
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnknownKeyWarning)
        config = door(read_file(FILES / name))
    return config, [w.message.path for w in caught if w.category is UnknownKeyWarning]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_real_file_gives_the_frameworks_loss_config(name):
    """Each file through its front door, and (YAML) through config_from_dict's recognition: the loss config of the
    file's settings (the defaults of verl's files are verl's defaults: PPO with dual clip 3.0 over kept tokens)."""
    config, _ = read_through_door(name)
    assert config == EXPECTED[name]
    data = read_file(FILES / name)
    if isinstance(data, dict):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnknownKeyWarning)
            assert corrections.config_from_dict(data) == config


def test_keys_outside_the_loss_and_newer_keys_are_listed():
    """The resolved verl config: its ten sections and keys the reader does not know (verl's data, critic, ... and
    ``sum_pi_squared_checkpointing``, newer than verl 1dda039b) are listed once each, not fatal."""
    _, listed = read_through_door("verl/_generated_ppo_trainer.yaml")
    assert listed == ["verl.data", "verl.reward_manager", "verl.critic", "verl.reward_model",
                      "verl.custom_reward_function", "verl.trainer", "verl.global_profiler", "verl.transfer_queue",
                      "verl.ray_kwargs", "verl.actor_rollout_ref.actor.sum_pi_squared_checkpointing"]
    _, listed = read_through_door("slime/run-qwen3-4B.sh")
    assert "slime.tensor_model_parallel_size" in listed and "slime.eps_clip" not in listed


@pytest.mark.filterwarnings("ignore::corrections.UnknownKeyWarning")
def test_a_misspelt_loss_key_or_an_unknown_key_in_a_loss_block_still_raises():
    data = read_file(FILES / "verl/_generated_ppo_trainer.yaml")
    data["actor_rollout_ref"]["actor"]["clip_ratio_hgh"] = 0.28
    with pytest.raises(ValueError, match="unknown key 'clip_ratio_hgh'; did you mean 'clip_ratio_high'"):
        corrections.from_verl(data)
    data = read_file(FILES / "verl/_generated_ppo_trainer.yaml")
    data["algorithm"]["rollout_correction"]["rollout_is_new_option"] = True  # a newer verl's loss setting
    with pytest.raises(ValueError, match="rollout_correction: unknown key 'rollout_is_new_option'"):
        corrections.from_verl(data)


def test_hydra_composition_is_resolved_against_its_folder():
    """ppo_trainer.yaml's defaults pull actor/dp_actor.yaml (which pulls actor/actor.yaml) into
    actor_rollout_ref.actor and algorithm/rollout_correction.yaml into algorithm.rollout_correction, the file's own
    keys last (``_self_``); entries whose files are not in the folder stay listed under ``defaults`` in
    ``read_composed``, and ``read_file`` settles them (outside the loss here: dropped)."""
    data = read_composed(FILES / "verl/ppo_trainer.yaml")
    actor = data["actor_rollout_ref"]["actor"]
    assert actor["clip_ratio_c"] == 3.0 and actor["strategy"] == "fsdp"  # actor.yaml's, then dp_actor's own
    assert actor["_target_"] == "verl.workers.config.FSDPActorConfig"  # dp_actor's _self_ after actor.yaml
    assert actor["rollout_n"] == 1  # ${oc.select:actor_rollout_ref.rollout.n,1}: no rollout block, the default
    assert data["algorithm"]["rollout_correction"]["loss_type"] == "ppo_clip"
    assert data["algorithm"]["adv_estimator"] == "gae"
    assert {"critic@critic": "dp_critic"} in data["defaults"]
    assert actor["defaults"] == [{"../optim@optim": "fsdp"}, {"../engine@fsdp_config": "fsdp"}]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnknownKeyWarning)
        settled = read_file(FILES / "verl/ppo_trainer.yaml")
    assert set(settled) == set(data) - {"defaults"}
    assert settled["actor_rollout_ref"]["actor"] == {k: v for k, v in actor.items() if k != "defaults"}


def test_areal_example_gives_areals_loss():
    """AReaL's gsm8k_grpo.yaml (decoupled PPO, eps_clip 0.4, rejection_sampling ratio <= 5): compute's loss on the
    front-door batch equals the AReaL port's ppo_actor_loss_fn with that rejection sampling."""
    n = batch().n
    config, _ = read_through_door("areal/gsm8k_grpo.yaml")
    want, _ = areal.ppo_actor_loss_fn_rs(n["lp"], n["old"], n["roll"], n["A"], 0.4, n["m"],
                                         rejection_sampling=dict(metric="ratio", upper=5.0, level="token",
                                                                 action="mask", agg="mean", lower=None))
    np.testing.assert_allclose(run(config).loss, want, rtol=RTOL, atol=ATOL)


def test_verl_resolved_config_gives_verls_loss():
    """verl's resolved defaults: vanilla PPO, clip 0.2, dual clip 3.0, token-mean, no KL loss; verl's port."""
    n = batch().n
    config, _ = read_through_door("verl/_generated_ppo_trainer.yaml")
    want, _ = verl.compute_policy_loss_vanilla(n["old"], n["lp"], n["A"], n["m"], "token-mean", clip_ratio_low=0.2,
                                               clip_ratio_high=0.2, clip_ratio_c=3.0)
    np.testing.assert_allclose(run(config).loss, want, rtol=RTOL, atol=ATOL)
