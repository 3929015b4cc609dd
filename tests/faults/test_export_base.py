"""``python -m learner.export`` of a LoRA run verifies its base (issue #49, item 1): the checkpoint records the base's
sha256 (``lora_base``); a base changed in place (one tensor x1.01), or a ``--base-model`` that cannot be checked, is
refused with one ``error:`` line unless ``--allow-other-base`` acknowledges it; and the export's other refusals (a
missing step, a checkpoint failing its manifest, no verified checkpoint) are one line too (real subprocesses)."""

import dataclasses
import json
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import safetensors.numpy
from flax import nnx

from learner.checkpoints.checkpointer import CheckpointConfig, Checkpointer
from learner.checkpoints.hf_checkpoint import write_hf_checkpoint
from learner.export import main
from learner.model.lora import LoraConfig, LoRAParam, base_identity
from learner.model.transformer import Transformer, model_config
from learner.rl.config import load_config, to_dict
from learner.update.train_state import create_train_state
from tests.faults.test_error_lines import error_line

CONFIG = model_config("tiny", vocab_size=64, tie_embeddings=True)


def _save_lora_run(tmp_path, base, *, record_base=True):
    lora = LoraConfig(rank=4, alpha=8.0)
    model = Transformer(dataclasses.replace(CONFIG, lora=lora), rngs=nnx.Rngs(1))
    rng = np.random.default_rng(2)
    nnx.update(model, jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.1, x.dtype),
                                   nnx.state(model, LoRAParam)))
    run_config = to_dict(load_config(None, [f"model.hf_path={json.dumps(str(base))}", "model.lora.rank=4",
                                            "model.lora.alpha=8.0"]))
    run_dir = tmp_path / "run"
    with Checkpointer(CheckpointConfig(str(run_dir / "checkpoints"), keep_last=None, async_save=False)) as saver:
        for step in (4, 6):
            saver.save(step, create_train_state(model, optax.adam(1e-3)), policy_version=step, config=run_config,
                       extra_metadata={"lora_base": base_identity(str(base), "tiny", 0)} if record_base else None)
    return run_dir


@pytest.fixture()
def lora_run(tmp_path):
    """(tmp_path, base directory, run directory): a LoRA run on a Hugging Face base, checkpoints 4 and 6."""
    base = write_hf_checkpoint(tmp_path / "base", Transformer(CONFIG, rngs=nnx.Rngs(0)), CONFIG)
    return tmp_path, base, _save_lora_run(tmp_path, base)


def _scale_one_tensor(base, factor=1.01):
    """Changes the base in place as a user might by mistake: one tensor x``factor``, same names and shapes."""
    path = base / "model.safetensors"
    tensors = safetensors.numpy.load_file(str(path))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] * np.float32(factor)
    safetensors.numpy.save_file(tensors, str(path))


def _export_command(run_dir, out, *flags):
    return [sys.executable, "-m", "learner.export", str(run_dir), str(out), *flags]


def test_an_unchanged_base_exports_and_a_local_copy_of_it_is_accepted_as_base_model(lora_run):
    tmp_path, base, run_dir = lora_run
    main([str(run_dir), str(tmp_path / "merged"), "--merged"])
    main([str(run_dir), str(tmp_path / "peft")])
    copy = shutil.copytree(base, tmp_path / "copy")
    main([str(run_dir), str(tmp_path / "named"), "--base-model", str(copy)])
    assert json.loads((tmp_path / "named" / "adapter_config.json").read_text())["base_model_name_or_path"] == (
        str(copy))


@pytest.mark.parametrize("flags", [["--merged"], []], ids=["merged", "peft"])
def test_a_base_changed_in_place_is_refused_in_one_line_unless_acknowledged(lora_run, flags):
    tmp_path, base, run_dir = lora_run
    trained_on = base_identity(str(base), "tiny", 0)["sha256"]
    _scale_one_tensor(base)
    now = base_identity(str(base), "tiny", 0)["sha256"]
    line = error_line(_export_command(run_dir, tmp_path / "out", *flags))
    assert line == (f"error: model.hf_path {base} is not the base the LoRA adapters were trained on (sha256 {now}, "
                    f"trained on {trained_on}): restore that base, or pass --allow-other-base to export anyway")
    assert not (tmp_path / "out").exists()
    main([str(run_dir), str(tmp_path / "out"), *flags, "--allow-other-base"])
    assert (tmp_path / "out").is_dir()


def test_a_base_model_that_cannot_be_checked_must_be_acknowledged(lora_run):
    tmp_path, base, run_dir = lora_run
    line = error_line(_export_command(run_dir, tmp_path / "out", "--base-model", "Qwen/Qwen2.5-0.5B"))
    assert line.startswith("error: --base-model 'Qwen/Qwen2.5-0.5B' is not a local checkpoint, so it cannot be "
                           "checked against the base the adapters were trained on ("), line
    assert line.endswith("): pass --allow-other-base to export anyway if it is that base"), line
    main([str(run_dir), str(tmp_path / "out"), "--base-model", "Qwen/Qwen2.5-0.5B", "--allow-other-base"])
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "Qwen/Qwen2.5-0.5B"


def test_a_checkpoint_recording_no_base_is_refused_unless_acknowledged(tmp_path):
    base = write_hf_checkpoint(tmp_path / "base", Transformer(CONFIG, rngs=nnx.Rngs(0)), CONFIG)
    run_dir = _save_lora_run(tmp_path, base, record_base=False)
    line = error_line(_export_command(run_dir, tmp_path / "out", "--merged"))
    assert line == (f"error: the checkpoint records no LoRA base (lora_base; saved by an older version), so "
                    f"model.hf_path {base} cannot be checked: pass --allow-other-base to export anyway")


def test_the_exports_other_refusals_are_one_line_each(lora_run):
    tmp_path, _, run_dir = lora_run
    checkpoints = run_dir / "checkpoints"
    assert error_line(_export_command(run_dir, tmp_path / "out", "--step", "5")) == (
        f"error: no checkpoint 5 in {checkpoints} (have [4, 6])")
    assert error_line(_export_command(tmp_path / "nowhere", tmp_path / "out")) == (
        f"error: no checkpoints directory {tmp_path / 'nowhere' / 'checkpoints'}: is this a run directory?")
    for step in (4, 6):  # corrupt one byte of every checkpoint's state
        state = max((checkpoints / str(step) / "state").rglob("*"), key=lambda path: path.stat().st_size)
        data = bytearray(state.read_bytes())
        data[len(data) // 2] ^= 0xFF
        state.write_bytes(bytes(data))
    assert error_line(_export_command(run_dir, tmp_path / "out", "--step", "6")).startswith(
        "error: checkpoint 6 fails its manifest: ")
    assert error_line(_export_command(run_dir, tmp_path / "out")) == (
        f"error: no checkpoint in {checkpoints} has a manifest that verifies (have [4, 6])")
