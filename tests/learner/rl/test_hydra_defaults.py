"""The Hydra ``defaults`` entries a composed file leaves (their files are not in its folder) are settled by the
learner before the front door: entries outside the loss are listed and dropped, verl's stock entries of the loss
blocks carry verl's defaults, any other entry for a loss block is refused with the command that composes the file,
whether the file is read directly, recognised by ``config_from_dict`` or given to a run."""

from __future__ import annotations

import pathlib
import warnings

import pytest
import yaml

import corrections
from corrections import CorrectionConfig, Objective, UnknownKeyWarning
from learner.rl import framework_config
from learner.rl.framework_files import read_file
from learner.rl.framework_keys import NOT_USED
from learner.rl.hydra_defaults import settle_defaults

# What each test checks is recorded by ``listed``; the other keys the files hold are test_framework_files'.
pytestmark = [pytest.mark.filterwarnings("ignore::corrections.UnknownKeyWarning"),
              pytest.mark.filterwarnings("ignore::corrections.TrainingKeysWarning")]
FILES = pathlib.Path(__file__).parents[2] / "fixtures" / "frameworks"
VERL_DEFAULT = CorrectionConfig(objective=Objective("ppo", dual_clip=3.0), denominator="kept")
VERL_COMMAND = r"python -m verl\.trainer\.main_ppo --config-path DIR --config-name NAME --cfg job --resolve"
SKYRL_COMMAND = r"python -c \"from hydra import compose, initialize_config_dir;"


def listed(call):
    """What ``call()`` returns, and the paths and messages of the UnknownKeyWarnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnknownKeyWarning)
        warnings.simplefilter("ignore", corrections.TrainingKeysWarning)
        out = call()
    return out, [(w.message.path, str(w.message)) for w in caught if w.category is UnknownKeyWarning]


def test_a_raw_hydra_file_settles_to_verls_defaults():
    """ppo_trainer.yaml as yaml.safe_load reads it (no composition): its algorithm block has no rollout_correction
    (verl's stock entry fills it), yet it is verl's (actor_rollout_ref); settled, it gives verl's defaults."""
    data = yaml.safe_load((FILES / "verl/ppo_trainer.yaml").read_text())
    settled, _ = listed(lambda: settle_defaults(data))
    assert "defaults" not in settled and "defaults" in data  # the input is not changed
    assert corrections.config_from_dict(settled) == VERL_DEFAULT


def test_entries_outside_the_loss_are_listed_once_and_dropped():
    """ppo_trainer.yaml composed: the entries whose files are not in the folder (data, critic, ... and the actor
    file's optim and engine) are listed, each once, by the block they fill; the loss is verl's default."""
    data, warned = listed(lambda: read_file(FILES / "verl/ppo_trainer.yaml"))
    assert [path for path, _ in warned] == ["verl.defaults"] * 7 + ["verl.actor_rollout_ref.actor.defaults"] * 2
    assert warned[-1][1] == ("verl.actor_rollout_ref.actor.defaults: {'../engine@fsdp_config': 'fsdp'} fills "
                             "actor_rollout_ref.actor.fsdp_config, outside the loss; not used.")
    assert "defaults" not in data and "defaults" not in data["actor_rollout_ref"]["actor"]
    assert corrections.from_verl(data) == VERL_DEFAULT
    _, warned = listed(lambda: read_file(FILES / "skyrl/ppo_base_config.yaml"))
    assert [path for path, _ in warned] == ["skyrl.defaults"] * 3


@pytest.mark.parametrize("files, framework, message", [
    ({"my_ppo.yaml": "defaults:\n  - actor@actor_rollout_ref.actor: my_actor\n  - _self_\n"
                     "algorithm:\n  adv_estimator: grpo\n"},
     "verl", r"verl\.defaults: \{'actor@actor_rollout_ref\.actor': 'my_actor'\} composes actor_rollout_ref\.actor "
             rf"\(which sets the loss\) from a file that was not read; compose and resolve the config first: "
             rf"{VERL_COMMAND}"),
    ({"my_ppo.yaml": "defaults:\n  - actor@actor_rollout_ref.actor: mine\n  - _self_\n",
      "actor/mine.yaml": "defaults:\n  - ../optim@optim: fsdp\n  - ../pl@policy_loss: custom\n  - _self_\n"},
     "verl", r"verl\.actor_rollout_ref\.actor\.defaults: \{'\.\./pl@policy_loss': 'custom'\} composes "
             rf"actor_rollout_ref\.actor\.policy_loss \(which sets the loss\) .*{VERL_COMMAND}"),
    ({"my_ppo.yaml": "defaults:\n  - algo@trainer.algorithm: mine\n  - _self_\ntrainer:\n  epochs: 2\n"},
     "skyrl", rf"skyrl\.defaults: \{{'algo@trainer\.algorithm': 'mine'\}} composes trainer\.algorithm .*"
              rf"{SKYRL_COMMAND}"),
])
def test_an_entry_for_a_loss_block_is_refused_with_the_command(tmp_path, files, framework, message):
    """A user's composition whose loss block comes from their own file, not given: the loss cannot be known, so the
    reader names the command that composes and resolves the config, read directly, recognised by config_from_dict
    (the entry's block says whose file it is: ``algorithm`` alone would be SkyRL's), or given to a run."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    path = tmp_path / "my_ppo.yaml"
    with pytest.raises(ValueError, match=message):
        read_file(path)
    with pytest.raises(ValueError, match=message):
        read_file(path, framework)
    with pytest.raises(ValueError, match=rf"^corrections\.from_{framework}='{path}': {message}"):
        framework_config.migrate(framework, str(path))


def test_the_run_table_keeps_one_row_per_defaults_list():
    """A run reads the same loss as read_file and the front door; its table shows each defaults list left (not
    used as files) where it was."""
    path = FILES / "verl/ppo_trainer.yaml"
    migration = framework_config.migrate("verl", str(path))
    data, _ = listed(lambda: read_file(path))
    assert migration.corrections == corrections.from_verl(data) == VERL_DEFAULT
    rows = {row.key: row for row in migration.rows}
    assert rows["defaults"].value[-1] == {"reward_model@reward_model": "dp_reward_loop"}
    assert rows["actor_rollout_ref.actor.defaults"].tether.startswith(f"{NOT_USED} as files (Hydra defaults")


def test_frameworks_without_hydra_defaults_are_left_to_their_front_door():
    """slime's arguments and an AReaL block are returned as they are: AReaL's reader lists a ``defaults`` key as
    one it does not know, as before."""
    assert settle_defaults(["--use-tis"]) == ["--use-tis"]
    block = {"defaults": ["x"], "actor": {"use_decoupled_loss": True, "eps_clip": 0.2}}
    assert settle_defaults(block) == block
    config, warned = listed(lambda: corrections.from_areal(block))
    assert warned == [("areal.defaults", "areal.defaults: not a key this reader knows; not used.")]
    assert config == corrections.from_areal(actor={"use_decoupled_loss": True, "eps_clip": 0.2})
