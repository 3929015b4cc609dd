"""A run from a framework's config file: ``corrections.from_verl = "path"`` (and from_skyrl, from_slime,
from_areal). Every key of the file gets one row (their key, their value, Tether's key, "not used" or "not applied"
with the reason); the settings Tether has elsewhere become run-config keys, between the TOML file and ``--set``;
a real training subprocess prints the mapping once, writes it into the run directory and trains with it.
"""

from __future__ import annotations

import json
import pathlib
import re
import warnings

import pytest
import yaml

import corrections
from learner.checkpoints.checkpointer import CheckpointConfig, Checkpointer
from learner.reporting.metrics_writers import read_metrics
from learner.rl import framework_config, framework_keys, load_config
from learner.rl.config import correction_config
from learner.rl.framework_files import read_file
from tests.e2e.test_main_job import DEFAULT_CONFIG, run_training

FILES = pathlib.Path(__file__).parents[2] / "fixtures" / "frameworks"


# What every verl file that leaves these keys out gets: verl's defaults at b178a3cd, mapped.
VERL_DEFAULT_RUN = {"update.ppo_epochs": 1, "optimizer.learning_rate": 1e-6, "optimizer.weight_decay": 0.01,
                    "optimizer.warmup_steps": 0, "optimizer.end_learning_rate": None, "optimizer.max_grad_norm": 1.0,
                    "rollout.temperature": 1.0, "rollout.top_p": 1.0, "rollout.top_k": 0}


def rows(m: framework_config.Migration) -> dict:
    return {row.key: (row.value, row.tether) for row in m.rows}


@pytest.mark.filterwarnings("ignore::corrections.UnknownKeyWarning", "ignore::corrections.TrainingKeysWarning")
@pytest.mark.parametrize("framework, name, run", [
    ("verl", "verl/_generated_ppo_trainer.yaml", {
        "update.ppo_epochs": 1, "update.num_minibatches": 4, "optimizer.learning_rate": 1e-6,
        "optimizer.weight_decay": 0.01, "optimizer.warmup_steps": 0, "optimizer.end_learning_rate": None,
        "optimizer.max_grad_norm": 1.0, "rollout.num_samples": 1, "rollout.temperature": 1.0, "rollout.top_p": 1.0,
        "rollout.top_k": 0, "rollout.prompts_per_step": 1024, "rollout.max_new_tokens": 512}),
    # verl's launch scripts: the keys they leave out take verl's defaults (ppo_epochs 1, weight decay 0.01, no
    # warmup, constant schedule, grad_clip 1.0, temperature 1, top_p 1, top_k -1, n 1)
    ("verl", "verl/examples/grpo_trainer/run_qwen2-7b.sh", {
        **VERL_DEFAULT_RUN, "update.num_minibatches": 4, "rollout.num_samples": 5, "rollout.prompts_per_step": 1024,
        "rollout.max_new_tokens": 1024}),  # 1024 prompts / 256 per mini-batch
    ("verl", "verl/examples/grpo_trainer/run_qwen3-8b_npu.sh", {
        **VERL_DEFAULT_RUN, "update.num_minibatches": 4, "rollout.num_samples": 5, "rollout.prompts_per_step": 256,
        "rollout.max_new_tokens": 1024}),  # 256 / 64
    ("verl", "verl/examples/ppo_trainer/run_deepseek7b_llm.sh", {
        **VERL_DEFAULT_RUN, "update.num_minibatches": 4, "rollout.num_samples": 1, "rollout.prompts_per_step": 1024,
        "rollout.max_new_tokens": 512}),  # no rollout.n: verl's 1
    ("verl", "verl/examples/gspo_trainer/run_qwen3_32b_gspo_npu.sh", {
        **VERL_DEFAULT_RUN, "update.num_minibatches": 4, "rollout.num_samples": 16, "rollout.prompts_per_step": 256,
        "rollout.max_new_tokens": 16384, "optimizer.warmup_steps": 10, "optimizer.weight_decay": 0.1}),
    ("skyrl", "skyrl/ppo_base_config.yaml", {
        "update.ppo_epochs": 1, "update.num_minibatches": 4, "optimizer.learning_rate": 1e-6,
        "optimizer.weight_decay": 0.01, "optimizer.warmup_steps": 0, "optimizer.end_learning_rate": None,
        "optimizer.max_grad_norm": 1.0, "rollout.num_samples": 5, "rollout.temperature": 1.0, "rollout.top_p": 1.0,
        "rollout.top_k": 0, "rollout.min_p": 0.0, "rollout.prompts_per_step": 1024, "rollout.max_new_tokens": 1024}),
    ("slime", "slime/run-qwen3-4B.sh", {
        "loop.steps": 3000, "rollout.prompts_per_step": 32, "rollout.num_samples": 8, "rollout.max_new_tokens": 8192,
        "rollout.temperature": 1.0, "update.num_minibatches": 1, "optimizer.learning_rate": 1e-6,
        "optimizer.end_learning_rate": None, "optimizer.weight_decay": 0.1}),
    ("areal", "areal/gsm8k_grpo.yaml", {
        "update.num_minibatches": 1, "optimizer.learning_rate": 1.7e-5, "optimizer.weight_decay": 0.017,
        "optimizer.max_grad_norm": 1.0, "optimizer.end_learning_rate": None, "rollout.num_samples": 4,
        "rollout.temperature": 1.0, "rollout.max_new_tokens": 1024, "rollout.prompts_per_step": 256}),
])
def test_training_settings_map_to_run_keys(framework, name, run):
    """The real files' training settings as run-config values (verl: 1024 prompts / 256 per mini-batch = 4
    updates; slime: 32 prompts x 8 samples / global batch 256 = 1; top_k -1 is Tether's 0; a constant schedule is
    end_learning_rate None), and the loss as the front door gives it."""
    m = framework_config.migrate(framework, str(FILES / name))
    assert m.run == run
    assert m.corrections == getattr(corrections, f"from_{framework}")(read_file(FILES / name))


@pytest.mark.parametrize("framework, name", [("verl", "verl/_generated_ppo_trainer.yaml"),
                                             ("slime", "slime/run-qwen3-4B.sh")])
def test_a_run_maps_the_training_settings_without_the_front_doors_warning(framework, name):
    """The front door's TrainingKeysWarning is for direct calls; a run applies those settings and prints its table."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", corrections.TrainingKeysWarning)
        m = framework_config.migrate.__wrapped__(framework, str(FILES / name))  # not the cached result
    assert m.run["optimizer.learning_rate"] == 1e-6


def test_every_key_gets_one_row():
    """verl's resolved config: the loss keys name their CorrectionConfig field, mapped keys their run key, settings
    Tether does otherwise say why, whole sections outside the loss are one row each, unknown keys are marked."""
    m = framework_config.migrate("verl", str(FILES / "verl/_generated_ppo_trainer.yaml"))
    table = rows(m)
    assert len(table) == len(m.rows)  # each key once
    assert table["actor_rollout_ref.actor.clip_ratio_c"] == (3.0, "corrections.objective.dual_clip")
    assert table["algorithm.rollout_correction.rollout_is"] == (None, "corrections.importance.level")
    assert table["actor_rollout_ref.actor.ppo_epochs"] == (1, "update.ppo_epochs")
    assert table["algorithm.adv_estimator"] == ("gae", f"not applied: {framework_keys.GRPO}")
    assert table["algorithm.use_kl_in_reward"] == (False, "not used (Tether does the same)")
    assert table["critic"][1] == "not used (unknown to Tether's reader)"
    assert table["actor_rollout_ref.actor.sum_pi_squared_checkpointing"][1] == "not used (unknown to Tether's reader)"
    assert table["trainer.total_training_steps"] == (None, "not used (null: Tether's loop.steps stays)")
    assert table["actor_rollout_ref.actor.strategy"] == ("fsdp", "not used")
    slime = rows(framework_config.migrate("slime", str(FILES / "slime/run-qwen3-4B.sh")))
    assert slime["--eps-clip-high"] == (0.28, "corrections.objective.clip_high")
    assert slime["--adam-beta2"] == (0.98, f"not applied: {framework_keys.BETAS}")
    areal = rows(framework_config.migrate("areal", str(FILES / "areal/gsm8k_grpo.yaml")))
    assert areal["actor.optimizer.warmup_steps_proportion"][1].startswith("not applied: set optimizer.warmup_steps")
    assert m.table().splitlines()[1] == "their key\ttheir value\tTether"


def test_precedence_toml_then_framework_file_then_set(tmp_path):
    """configs/default.toml sets ppo_epochs 2, learning rate 1e-3 and the corrections preset with kl_coef 0.05; the
    verl file replaces them (epochs 1, 1e-6, verl's loss); --set replaces the file's values in turn."""
    path = str(FILES / "verl/_generated_ppo_trainer.yaml")
    sets = [f"corrections.from_verl={json.dumps(path)}", "rollout.num_samples=4", "rollout.max_new_tokens=4"]
    config = load_config(DEFAULT_CONFIG, sets)
    assert config.update.ppo_epochs == 1 and config.optimizer.learning_rate == 1e-6
    assert config.corrections.overrides == {}
    assert correction_config(config) == framework_config.migrate("verl", path).corrections
    config = load_config(DEFAULT_CONFIG, [*sets, "update.ppo_epochs=3", "corrections.overrides={kl_coef = 0.2}"])
    assert config.update.ppo_epochs == 3 and correction_config(config).kl_coef == 0.2
    assert correction_config(config).denominator == "kept"  # the rest stays verl's


def test_bad_mapped_value_names_the_file_and_the_fix(tmp_path):
    path = str(FILES / "verl/_generated_ppo_trainer.yaml")
    with pytest.raises(ValueError, match=r"rollout.num_samples=1: must be >= 2 \(corrections.from_verl=.* sets "
                                         r"rollout.num_samples from actor_rollout_ref.rollout.n=1; --set"):
        load_config(DEFAULT_CONFIG, [f"corrections.from_verl={json.dumps(path)}"])
    with pytest.raises(ValueError, match=r"^corrections.from_skyrl='missing.yaml': missing.yaml: no such file"):
        load_config(None, ["corrections.from_skyrl='missing.yaml'"])
    broken = tmp_path / "broken.yaml"
    broken.write_text("trainer: [1, 2\n")
    with pytest.raises(ValueError, match=rf"^corrections.from_verl='{broken}': {broken}: not valid YAML"):
        load_config(None, [f"corrections.from_verl={json.dumps(str(broken))}"])
    with pytest.raises(ValueError, match="from_verl and from_areal are both set"):
        load_config(None, [f"corrections.from_verl={json.dumps(path)}", "corrections.from_areal='x.yaml'"])


@pytest.mark.slow  # 24 s on a quiet 2-core run: out of the default run's 15 minutes
def test_run_from_a_verl_launch_script(tmp_path):
    """A user's verl launch script (GRPO, 4 prompts x 4 samples, 2-token responses, 2 mini-batches, learning rate
    5e-4 in a shell variable, KL loss 0.02, clip-higher 0.28; the rest verl's defaults) trains in a real subprocess
    (one step, no warm-up: the cheapest real run): the mapping is printed once and written to
    run_dir/framework_config.tsv, the rollout follows the script (16 samples, at most 2 tokens each, where the task
    alone allows 3), and the run's saved config holds the mapped values."""
    path = tmp_path / "run_grpo.sh"
    path.write_text("set -x\nLR=${LR:-5e-4}\n\npython3 -m verl.trainer.main_ppo \\\n"
                    "    algorithm.adv_estimator=grpo data.train_batch_size=4 data.max_response_length=2 \\\n"
                    "    actor_rollout_ref.rollout.n=4 actor_rollout_ref.actor.ppo_mini_batch_size=2 \\\n"
                    "    actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.02 \\\n"
                    "    actor_rollout_ref.actor.clip_ratio_high=0.28 actor_rollout_ref.actor.optim.lr=$LR $@\n")
    run_dir = tmp_path / "run"
    stdout = run_training(run_dir, f"corrections.from_verl={json.dumps(str(path))}", "loop.steps=1",
                          "warmup.steps=0")
    table = (run_dir / framework_config.MAPPING_FILE).read_text()
    assert stdout.count("their key\ttheir value\tTether") == 1 and table in stdout
    assert "actor_rollout_ref.actor.optim.lr\t0.0005\toptimizer.learning_rate" in table
    assert "actor_rollout_ref.actor.kl_loss_coef\t0.02\tcorrections.kl_coef" in table
    assert "actor_rollout_ref.actor.ppo_epochs\t1 (verl's default: not in the file)\tupdate.ppo_epochs" in table
    assert re.search(rf"\| corrections +\| from_verl={re.escape(str(path))} ", stdout)  # the summary, not the preset
    # the loss it built, each value with its source: the file's key, verl's default, or from_verl's own
    assert "objective.clip_high\t0.28\tactor_rollout_ref.actor.clip_ratio_high\n" in table
    assert ("objective.clip_low\t0.2\tverl's default (actor_rollout_ref.actor.clip_ratio, "
            "actor_rollout_ref.actor.clip_ratio_low: not in the file)\n") in table
    assert "objective.dual_clip\t3.0\tverl's default (actor_rollout_ref.actor.clip_ratio_c: not in the file)" in table
    assert "denominator\t'kept'\tfrom_verl's value (no verl key sets it)" in table
    (record,) = read_metrics(run_dir / "metrics.jsonl")
    assert record["rollout_corr/tis_clipfrac"] == 0.0  # no truncated IS configured
    assert record["rollout/samples"] == 16 and 1 <= record["rollout/completion_tokens_mean"] <= 2
    with Checkpointer(CheckpointConfig(str(run_dir / "checkpoints"))) as checkpointer:
        assert checkpointer.latest_step() == 1
        saved = checkpointer.read_metadata()["config"]
    assert saved["update"]["num_minibatches"] == 2 and saved["update"]["ppo_epochs"] == 1
    assert saved["optimizer"]["learning_rate"] == 5e-4 and saved["optimizer"]["end_learning_rate"] is None
    assert saved["rollout"]["max_new_tokens"] == 2 and saved["corrections"]["from_verl"] == str(path)
    config = correction_config(load_config(DEFAULT_CONFIG, [f"corrections.from_verl={json.dumps(str(path))}"]))
    assert config.kl_coef == 0.02 and config.objective.clip_high == 0.28 and config.denominator == "kept"


NESTED_VERL = """\
actor_rollout_ref:
  rollout:
    n: 5
  actor:
    optim:
      lr: 1.0e-06
    ppo_mini_batch_size: 2
    use_kl_loss: true
    kl_loss_coef: 0.001
data:
  train_batch_size: 4
  max_response_length: 4
"""
DOTTED_VERL = """\
actor_rollout_ref.rollout.n: 5
actor_rollout_ref.actor.optim.lr: 1.0e-06
actor_rollout_ref.actor.ppo_mini_batch_size: 2
actor_rollout_ref.actor.use_kl_loss: true
actor_rollout_ref.actor.kl_loss_coef: 0.001
data.train_batch_size: 4
data.max_response_length: 4
"""


@pytest.mark.filterwarnings("ignore::corrections.UnknownKeyWarning", "ignore::corrections.TrainingKeysWarning")
def test_the_loss_table_names_each_fields_source_and_a_mini_batch_not_applied_says_why(tmp_path):
    """Every CorrectionConfig field gets one row: an override, the file's key, verl's default, from_verl's own."""
    path = tmp_path / "verl.yaml"
    path.write_text("actor_rollout_ref:\n  rollout:\n    n: 4\n  actor:\n    ppo_mini_batch_size: 3\n"
                    "    clip_ratio_high: 0.28\ndata:\n  train_batch_size: 4\n")
    config = load_config(DEFAULT_CONFIG, [f"corrections.from_verl={json.dumps(str(path))}",
                                          "corrections.overrides={entropy_coef=0.01}"])
    table = framework_config.loss_table(config.corrections).splitlines()
    fields = [line.split("\t")[0] for line in table[2:]]
    assert fields == list(framework_config._flat(corrections.config_to_dict(correction_config(config))))
    rows_by_field = {line.split("\t")[0]: line.split("\t")[1:] for line in table[2:]}
    assert rows_by_field["objective.clip_high"] == ["0.28", "actor_rollout_ref.actor.clip_ratio_high"]
    assert rows_by_field["entropy_coef"] == ["0.01", "corrections.overrides (the run config)"]
    assert rows_by_field["importance"][0] == "none" and rows_by_field["importance"][1].startswith("verl's default (")
    mini_batch = rows(framework_config.migrate("verl", str(path)))["actor_rollout_ref.actor.ppo_mini_batch_size"]
    assert mini_batch[1] == ("not applied: data.train_batch_size = 4 is not a multiple of it, so it gives no whole "
                             "number of mini-batches; update.num_minibatches keeps the run config's value (set it)")
    framework_config.report(config.corrections, tmp_path, config)
    written = (tmp_path / framework_config.MAPPING_FILE).read_text()
    assert ("# actor_rollout_ref.actor.ppo_mini_batch_size not applied: the run uses update.num_minibatches = "
            f"{config.update.num_minibatches}\n") in written


def test_dotted_keys_mean_the_nested_keys_everywhere(tmp_path):
    """A YAML of dotted keys (as Hydra's command line writes them) gives the run mapping, the loss and the table of
    the nested YAML: n, the learning rate, the batch and mini-batches were dropped, and every key listed "not used"
    under a doubled prefix (actor_rollout_ref.actor.actor_rollout_ref.rollout.n)."""
    (tmp_path / "nested.yaml").write_text(NESTED_VERL)
    (tmp_path / "dotted.yaml").write_text(DOTTED_VERL)
    nested, dotted = (framework_config.migrate("verl", str(tmp_path / name)) for name in ("nested.yaml", "dotted.yaml"))
    assert dotted.run == nested.run and dotted.rows == nested.rows and dotted.corrections == nested.corrections
    assert {key: dotted.run[key] for key in ("rollout.num_samples", "optimizer.learning_rate", "update.num_minibatches",
                                             "rollout.prompts_per_step", "rollout.max_new_tokens")} == {
        "rollout.num_samples": 5, "optimizer.learning_rate": 1e-6, "update.num_minibatches": 2,
        "rollout.prompts_per_step": 4, "rollout.max_new_tokens": 4}
    assert rows(dotted)["actor_rollout_ref.rollout.n"] == (5, "rollout.num_samples")
    assert dotted.corrections.kl_coef == 0.001
    assert not [row.key for row in dotted.rows if row.key.count("actor_rollout_ref") > 1]
    assert corrections.from_verl(yaml.safe_load(DOTTED_VERL)) == dotted.corrections  # the front door, as before


def test_missing_keys_take_verls_defaults_in_the_run(tmp_path):
    """A nested verl YAML without lr_scheduler_type over configs/default.toml (cosine to end_learning_rate 2e-4):
    verl's constant schedule applies (it was refused: end_learning_rate=0.0002 exceeds peak 1e-06), and the table
    marks each value the file left to verl's defaults."""
    path = tmp_path / "my_verl.yaml"
    path.write_text(NESTED_VERL)
    config = load_config(DEFAULT_CONFIG, [f"corrections.from_verl={json.dumps(str(path))}"])
    assert config.optimizer.end_learning_rate is None and config.optimizer.learning_rate == 1e-6
    assert config.update.ppo_epochs == 1 and config.optimizer.weight_decay == 0.01  # default.toml: 2 and 0.0
    m = framework_config.migrate("verl", str(path))
    defaulted = {row.key: row.value for row in m.rows if row.default}
    assert defaulted["actor_rollout_ref.actor.optim.lr_scheduler_type"] == "constant"
    assert defaulted["actor_rollout_ref.actor.ppo_epochs"] == 1 and "actor_rollout_ref.rollout.n" not in defaulted
    assert "actor_rollout_ref.actor.optim.lr_scheduler_type\t'constant' (verl's default: not in the file)\t" \
           "optimizer.end_learning_rate" in m.table()


def test_a_value_that_clashes_with_the_run_config_names_both_keys(tmp_path):
    path = tmp_path / "my_verl.yaml"
    path.write_text(NESTED_VERL.replace("      lr: 1.0e-06\n", "      lr: 1.0e-06\n      lr_warmup_steps: 10\n"))
    with pytest.raises(ValueError) as error:
        load_config(DEFAULT_CONFIG, [f"corrections.from_verl={json.dumps(str(path))}", "loop.steps=2"])
    assert str(error.value) == (
        "optimizer.warmup_steps=10: must be fewer than the run's 4 optimizer updates (loop.steps x "
        f"update.num_minibatches x update.ppo_epochs) (corrections.from_verl='{path}' sets optimizer.warmup_steps "
        "from actor_rollout_ref.actor.optim.lr_warmup_steps=10, update.num_minibatches from "
        "actor_rollout_ref.actor.ppo_mini_batch_size=2, update.ppo_epochs from actor_rollout_ref.actor.ppo_epochs=1 "
        "(verl's default); the run config sets loop.steps; --set a key to replace its value)")


def test_verls_ppo_example_needs_groups_and_says_where_n_comes_from():
    """verl's PPO example has no rollout.n: verl's default 1, which GRPO cannot use; the error says it is verl's
    default, and --set gives the groups."""
    path = str(FILES / "verl/examples/ppo_trainer/run_deepseek7b_llm.sh")
    with pytest.raises(ValueError, match=re.escape(
            f"rollout.num_samples=1: must be >= 2 (corrections.from_verl='{path}' sets rollout.num_samples from "
            "actor_rollout_ref.rollout.n=1 (verl's default); --set a key to replace its value)")):
        load_config(DEFAULT_CONFIG, [f"corrections.from_verl={json.dumps(path)}"])
    config = load_config(DEFAULT_CONFIG, [f"corrections.from_verl={json.dumps(path)}", "rollout.num_samples=4"])
    assert config.rollout.num_samples == 4 and config.rollout.prompts_per_step == 1024
    not_applied = f"not applied: {framework_keys.GRPO}"
    assert rows(framework_config.migrate("verl", path))["algorithm.adv_estimator"] == ("gae", not_applied)


@pytest.mark.parametrize("framework, name", [("verl", "verl/_generated_ppo_trainer.yaml"),
                                             ("skyrl", "skyrl/ppo_base_config.yaml")])
def test_the_default_tables_are_the_frameworks_own_files(framework, name):
    """Each default the run mapping fills in is the value of the framework's own resolved defaults file (SkyRL's
    YAML writes weight_decay as '1e-2', which PyYAML reads as text)."""
    data = read_file(FILES / name)
    for key, value in framework_keys.MAPS[framework].defaults.items():
        node = data
        for part in key.split("."):
            node = node[part]
        assert node == value or float(node) == value, key


def test_a_variable_the_script_does_not_set_is_named_where_a_number_goes(tmp_path):
    """``$N`` is not set in the script (an environment variable at launch): its text cannot be a sample count."""
    path = tmp_path / "run.sh"
    path.write_text("python3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.n=$N data.train_batch_size=4\n")
    with pytest.raises(ValueError, match=re.escape(f"corrections.from_verl='{path}': actor_rollout_ref.rollout.n='$N': "
                                                   "not a value for rollout.num_samples.")):
        load_config(DEFAULT_CONFIG, [f"corrections.from_verl={json.dumps(str(path))}"])


def test_a_launch_script_given_to_the_other_framework_says_which():
    verl_script = str(FILES / "verl/examples/grpo_trainer/run_qwen2-7b.sh")
    slime_script = str(FILES / "slime/run-qwen3-4B.sh")
    with pytest.raises(ValueError, match=re.escape(f"corrections.from_slime='{verl_script}': not a slime launch "
                                                   "script; give a YAML file or a verl launch script to its own key")):
        load_config(None, [f"corrections.from_slime={json.dumps(verl_script)}"])
    with pytest.raises(ValueError, match=re.escape(f"corrections.from_verl='{slime_script}': a slime launch script; "
                                                   "use corrections.from_slime.")):
        load_config(None, [f"corrections.from_verl={json.dumps(slime_script)}"])
