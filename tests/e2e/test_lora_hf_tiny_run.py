"""configs/lora_hf_tiny.toml end to end (issue #32, items 3-6): LoRA on the tiny random Qwen2 of
learner.tools.make_hf_tiny, a few RL steps against a real engine given the merged weights after every update, the
checkpoints (adapters only, the base's identity), a resume against another base, and both exports.

What is independent of the code under test: the PEFT adapter is checked against the merged export through PEFT's
own formula ``W + (lora_alpha / r) * B @ A`` in NumPy float64 over the Hugging Face tensors (names and shapes as
PEFT's ``get_peft_model_state_dict`` writes them), and the merged export by mlx-lm, a second implementation of the
model, against the learner's LoRA logits. Like test_hf_tiny_run.py: no warm-up, small batches, the MLX engine by
default (the embedded reference server, a second JAX process, marked slow).
"""

import hashlib
import json
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from learner.checkpoints.reading import read_checkpoint_params
from learner.rl import CheckpointHook, MetricsHook, Run, load_config
from learner.tools.make_hf_tiny import make_hf_tiny

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG = REPO_ROOT / "configs" / "lora_hf_tiny.toml"
STEPS = 2
KL_TOLERANCE = 1e-4  # float32 engine at staleness 0, merged weights: rounding only
ENGINES = {"mlx": ("server.engine='mlx'", "rollout.logprob_mode='raw'"), "tether": ()}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_hf_tiny(tmp_path_factory.mktemp("lora_hf_tiny") / "files")


def _config(files, run_dir, *extra, model=None):
    return load_config(CONFIG, [
        f"model.hf_path={json.dumps(str(model or files.model))}", f"task.args.path={json.dumps(str(files.train))}",
        f"task.args.validation.path={json.dumps(str(files.test))}", f"run_dir={json.dumps(str(run_dir))}",
        f"loop.steps={STEPS}", "warmup.steps=2", "warmup.batch_size=16", "rollout.prompts_per_step=4",
        "rollout.num_samples=4",
        "server.max_batch_size=16", "update.fast_compile=true", "checkpoints.every=1", *extra])


def _export(run_dir, out_dir, *flags):
    done = subprocess.run([sys.executable, "-m", "learner.export", str(run_dir), str(out_dir), *flags], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return out_dir


def _sha256(directory: pathlib.Path) -> str:
    digest = hashlib.sha256()
    for file in [directory / "config.json", *sorted(directory.glob("*.safetensors"))]:
        digest.update(file.name.encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


# ~100 s against the MLX engine on the shared 2-core machine (two warm-up and two RL steps with a KL term, three
# checkpoints, both exports, a refused resume): slow, as the default suite's budget is tight; the pieces have fast
# tests of their own (tests/learner/model/test_lora.py, tests/rollout_client/engines).
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["mlx", "tether"])
def test_lora_run_publishes_merged_weights_checkpoints_adapters_and_exports_peft(engine, files, tmp_path):
    import mlx.core as mx
    import mlx_lm

    run_dir = tmp_path / "run"
    # a KL term: its reference is the frozen base with the adapters off, not a stored copy of the weights
    config = _config(files, run_dir, *ENGINES[engine], "corrections.overrides={kl_coef = 0.001}")
    with Run(config, hooks=[MetricsHook(), CheckpointHook(config.checkpoints.every)]) as run:
        records = list(run.steps())
        trainer = run.trainer
        assert trainer.reference is None and trainer.checkpoint_tree() is trainer.state
        # one copy of the base on the learner's mesh (make_hf_tiny's model, on one device, also lives in this process)
        embedding = trainer.frozen["embed"]["embedding"][...]
        devices = embedding.sharding.device_set
        assert sum(array.shape == embedding.shape and array.sharding.device_set == devices
                   for array in jax.live_arrays()) == 1
        model = nnx.merge(trainer.graphdef, jax.device_get(trainer.state.params), jax.device_get(trainer.frozen))
        adapters = trainer.host_adapters()
    assert [record.step for record in records] == list(range(1, STEPS + 1))
    for record in records:  # the engine samples from the merged weights the learner trains (unmerged)
        assert record.metrics["rollout_corr/staleness_max"] == 0
        assert record.metrics["actor/kl_loss"] != 0  # the adapters moved the policy away from the base
        assert abs(record.metrics["rollout_corr/kl"]) < KL_TOLERANCE, record.metrics["rollout_corr/kl"]
    assert min(float(np.max(np.abs(array))) for name, array in adapters.items() if name.endswith("/b")) > 1e-3

    # Checkpoints: the adapters and their optimizer state, the base's identity; not the base.
    step_dir = run_dir / "checkpoints" / str(STEPS)
    saved = read_checkpoint_params(step_dir)
    assert saved.keys() == adapters.keys() and all("/lora/" in name for name in saved)
    for name, array in adapters.items():
        np.testing.assert_array_equal(saved[name], array)
    metadata = json.loads(next((step_dir / "metadata").glob("*")).read_text())
    assert metadata["lora_base"] == {"path": str(files.model.resolve()), "sha256": _sha256(files.model),
                                     "model": None, "seed": None}

    # PEFT adapter: PEFT's names and shapes, its config keys; merged with PEFT's formula it is the merged export.
    peft = _export(run_dir, tmp_path / "peft")
    adapter_config = json.loads((peft / "adapter_config.json").read_text())
    assert {key: adapter_config[key] for key in ("peft_type", "task_type", "r", "lora_alpha", "bias",
                                                 "base_model_name_or_path")} == {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 16, "lora_alpha": 32.0, "bias": "none",
        "base_model_name_or_path": str(files.model)}
    assert sorted(adapter_config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    tensors = safetensors.numpy.load_file(str(peft / "adapter_model.safetensors"))
    assert len(tensors) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
    merged = _export(run_dir, tmp_path / "merged", "--merged")
    base = safetensors.numpy.load_file(str(next(files.model.glob("*.safetensors"))))
    exported = safetensors.numpy.load_file(str(merged / "model.safetensors"))
    assert exported.keys() == base.keys()
    changed = 0
    for name, weight in base.items():
        module = name.removesuffix(".weight")
        a_name, b_name = f"base_model.model.{module}.lora_A.weight", f"base_model.model.{module}.lora_B.weight"
        if a_name not in tensors:
            np.testing.assert_array_equal(exported[name], weight, err_msg=name)
            continue
        a, b = tensors[a_name].astype(np.float64), tensors[b_name].astype(np.float64)
        assert a.shape == (16, weight.shape[1]) and b.shape == (weight.shape[0], 16), name  # [r, in], [out, r]
        expected = weight.astype(np.float64) + 32.0 / 16 * b @ a
        np.testing.assert_allclose(exported[name], expected, rtol=1e-6, atol=1e-6, err_msg=name)
        changed += 1
    assert changed == 14

    # mlx-lm computes the learner's LoRA logits from the merged export.
    mlx_model, _ = mlx_lm.load(str(merged))
    ids = run.task.validation_records()[0]["prompt_ids"].tolist()
    mlx_logits = np.asarray(mlx_model(mx.array(ids)[None]).astype(mx.float32))[0]
    tokens = jnp.asarray(ids, jnp.int32)[None]
    positions = jnp.arange(len(ids), dtype=jnp.int32)[None]
    learner_logits = np.asarray(model.logits(model(tokens, positions)))[0]
    np.testing.assert_allclose(mlx_logits, learner_logits, atol=1e-4, rtol=0)

    # A resume against another base (one weight changed, same path layout) is refused, naming the keys.
    other = tmp_path / "other_base"
    shutil.copytree(files.model, other)
    weights_file = next(other.glob("*.safetensors"))
    changed_weights = safetensors.numpy.load_file(str(weights_file))
    changed_weights["model.norm.weight"] = changed_weights["model.norm.weight"] + 1
    safetensors.numpy.save_file(changed_weights, str(weights_file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"LoRA adapters of the base .* model.hf_path"):
        with Run(_config(files, run_dir, *ENGINES[engine], "loop.steps=3", model=other)):
            pass
