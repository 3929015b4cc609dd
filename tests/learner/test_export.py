"""Hugging Face checkpoints written by Tether: `write_hf_checkpoint` and ``python -m learner.export``.

An export is checked by three readers: Tether itself (same parameters, bit for bit in float32), transformers' config,
generation-config and tokenizer loaders (no torch needed), and mlx-lm, a second implementation of the model, whose
float32 log-probabilities must equal Tether's to 1e-5 (two float32 implementations of a 2-layer model differ by
~1e-6: summation order).
"""

import dataclasses
import importlib
import json
import os
import pathlib
import stat

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
import safetensors.numpy
from flax import nnx

from learner.checkpoints.checkpointer import CheckpointConfig, Checkpointer
from learner.checkpoints.hf_checkpoint import model_config_from_checkpoint, write_hf_checkpoint
from learner.checkpoints.reading import read_checkpoint_params
from learner.checkpoints.safetensors_io import load_safetensors, write_safetensors
from learner.export import export_run, main
from learner.model.lora import LoraConfig, LoRAParam, base_identity
from learner.model.param_paths import named_leaves, update_named
from learner.model.transformer import Llama3RopeScaling, ModelConfig, Transformer, model_config
from learner.rl.config import load_config, to_dict
from learner.rl.prompt_stream import DataPosition
from learner.update.train_state import create_train_state

VOCAB = ["<pad>", "<s>", "</s>", "<|im_end|>"] + [f"w{i}" for i in range(60)]
BOS, EOS, IM_END = 1, 2, 3
ARCHITECTURES = {
    # Llama 3 RoPE scaling, GQA, untied head.
    "llama": model_config("tiny", vocab_size=64, qkv_bias=False, num_layers=2, rope_theta=500_000.0,
                          rope_scaling=Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                         original_max_position_embeddings=32)),
    "qwen2": model_config("tiny", vocab_size=64, tie_embeddings=True, rope_theta=1_000_000.0),
    "qwen3": model_config("tiny", vocab_size=64, qkv_bias=False, qk_norm=True, head_dim=32),
    "mistral": model_config("tiny", vocab_size=64, qkv_bias=False, num_kv_heads=1),
}
TOKENS = np.array([1, 7, 30, 12, 55, 9, 41, 3, 22, 17, 60, 5, 33, 2], np.int32)


def _weights(model: Transformer) -> dict[str, np.ndarray]:
    """What ``Trainer.host_weights()`` returns: parameters by path."""
    return {name: np.asarray(leaf) for name, leaf in named_leaves(nnx.state(model, nnx.Param)).items()}


def _logprobs(config: ModelConfig, weights: dict[str, np.ndarray]) -> np.ndarray:
    """Tether's float32 log-probabilities of TOKENS under ``weights``."""
    model = Transformer(config, rngs=nnx.Rngs(0))
    update_named(model, weights)
    logits = model.logits(model(jnp.asarray(TOKENS[None]), jnp.arange(TOKENS.size)[None]))[0]
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))


@pytest.fixture(scope="module")
def tokenizer():
    """A transformers tokenizer over a word-level vocabulary (no download)."""
    tokenizers = importlib.import_module("tokenizers")
    transformers = importlib.import_module("transformers")
    model = tokenizers.models.WordLevel({token: i for i, token in enumerate(VOCAB)}, unk_token="<pad>")
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>")


def _make_run(tmp_path, source, config: ModelConfig, steps: dict[int, int]):
    """A run directory whose checkpoints hold the params of ``Transformer(config, rngs=Rngs(seed))`` per step."""
    run_dir = tmp_path / "run"
    run_config = to_dict(load_config(None, [f"run_dir={run_dir}", f"model.hf_path={source}"]))
    params = {}
    with Checkpointer(CheckpointConfig(str(run_dir / "checkpoints"), keep_last=None, async_save=False)) as saver:
        for step, seed in steps.items():
            model = Transformer(config, rngs=nnx.Rngs(seed))
            saver.save(step, create_train_state(model, optax.adam(1e-3)), policy_version=step, config=run_config)
            params[step] = _weights(model)
    return run_dir, params


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def exported(request, tmp_path_factory, tokenizer):
    """(architecture, config, source dir, export dir, the exported step's params)."""
    architecture, config = request.param, ARCHITECTURES[request.param]
    tmp_path = tmp_path_factory.mktemp(architecture)
    source = write_hf_checkpoint(tmp_path / "source", Transformer(config, rngs=nnx.Rngs(0)), config,
                                 tokenizer=tokenizer, eos_token_ids=(EOS, IM_END), bos_token_id=BOS,
                                 model_type=architecture)
    run_dir, params = _make_run(tmp_path, source, config, {5: 1})
    out = tmp_path / "export"
    main([str(run_dir), str(out)])
    return architecture, config, source, out, params[5]


def test_export_reloads_in_tether_with_the_checkpoints_parameters(exported):
    _, config, _, out, params = exported
    assert model_config_from_checkpoint(out) == config
    model = Transformer(config, rngs=nnx.Rngs(9))
    load_safetensors(model, out)
    loaded = _weights(model)
    assert loaded.keys() == params.keys()
    for name, value in params.items():
        np.testing.assert_array_equal(loaded[name], value, err_msg=name)


def test_export_loads_in_transformers_with_architecture_ids_and_tokenizer(exported, tokenizer):
    transformers = importlib.import_module("transformers")
    architecture, config, source, out, _ = exported
    hf_config = transformers.AutoConfig.from_pretrained(out)
    assert hf_config.model_type == architecture
    assert hf_config.architectures == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                        "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}[architecture]]
    assert (hf_config.bos_token_id, hf_config.eos_token_id) == (BOS, [EOS, IM_END])
    assert (hf_config.num_key_value_heads, hf_config.head_dim) == (config.num_kv_heads, config.head_dim)
    assert hf_config.rope_parameters["rope_theta"] == config.rope_theta
    if config.rope_scaling is not None:
        assert hf_config.rope_parameters["rope_type"] == "llama3"
        assert hf_config.rope_parameters["factor"] == config.rope_scaling.factor
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert (generation.bos_token_id, generation.eos_token_id) == (BOS, [EOS, IM_END])
    text = "w3 w17 </s>"
    assert transformers.PreTrainedTokenizerFast.from_pretrained(out)(text)["input_ids"] == [7, 21, EOS]
    # AutoTokenizer picks its class by model_type (Qwen2Tokenizer for qwen2, ...): the same for source and export.
    auto = transformers.AutoTokenizer
    assert auto.from_pretrained(out)(text)["input_ids"] == auto.from_pretrained(source)(text)["input_ids"]
    assert {path.name for path in out.iterdir()} >= {"tokenizer.json", "tokenizer_config.json"}


def test_export_logprobs_in_mlx_lm_equal_tether(exported):
    mx = importlib.import_module("mlx.core")
    mlx_utils = importlib.import_module("mlx_lm.utils")
    _, config, _, out, params = exported
    model, _ = mlx_utils.load_model(out)
    logits = model(mx.array(TOKENS)[None]).astype(mx.float32)
    mlx_logprobs = np.asarray(logits - mx.logsumexp(logits, axis=-1, keepdims=True))[0]
    np.testing.assert_allclose(mlx_logprobs, _logprobs(config, params), atol=1e-5, rtol=0)


def test_bfloat16_export_holds_the_rounded_parameters(exported, tmp_path):
    _, config, _, out, params = exported
    run_dir = out.parent / "run"
    bf16 = export_run(run_dir, tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    tensors = safetensors.numpy.load_file(str(bf16 / "model.safetensors"))
    assert {tensor.dtype for tensor in tensors.values()} == {np.dtype(ml_dtypes.bfloat16)}
    model = Transformer(config, rngs=nnx.Rngs(9))
    load_safetensors(model, bf16)
    for name, value in _weights(model).items():
        np.testing.assert_array_equal(value, params[name].astype(ml_dtypes.bfloat16).astype(np.float32))


def test_export_picks_the_newest_verified_checkpoint(tmp_path, tokenizer):
    config = ARCHITECTURES["qwen2"]
    source = write_hf_checkpoint(tmp_path / "source", Transformer(config, rngs=nnx.Rngs(0)), config,
                                 tokenizer=tokenizer)
    run_dir, params = _make_run(tmp_path, source, config, {1: 1, 2: 2})
    newest = run_dir / "checkpoints" / "2"
    damaged = next(path for path in sorted((newest / "state").rglob("*")) if path.is_file() and path.stat().st_size)
    damaged.write_bytes(damaged.read_bytes()[:-1] + bytes([damaged.read_bytes()[-1] ^ 1]))
    with pytest.warns(UserWarning, match="skipping checkpoint 2"):
        out = export_run(run_dir, tmp_path / "out")
    model = Transformer(config, rngs=nnx.Rngs(9))
    load_safetensors(model, out)
    np.testing.assert_array_equal(_weights(model)["final_norm/scale"], params[1]["final_norm/scale"])
    np.testing.assert_array_equal(_weights(model)["embed/embedding"], params[1]["embed/embedding"])
    with pytest.raises(ValueError, match="checkpoint 2 fails its manifest"):
        export_run(run_dir, tmp_path / "out2", step=2)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint 7 .*have \[1, 2\]"):
        export_run(run_dir, tmp_path / "out3", step=7)
    with pytest.raises(FileExistsError, match="overwrite"):
        export_run(run_dir, out, step=1)
    assert not (tmp_path / "out2").exists() and not (tmp_path / "out3").exists()


def test_read_checkpoint_params_reads_a_run_with_a_kl_reference(tmp_path):
    config = ARCHITECTURES["qwen2"]
    policy, reference = Transformer(config, rngs=nnx.Rngs(1)), Transformer(config, rngs=nnx.Rngs(2))
    state = create_train_state(policy, optax.adam(1e-3))
    with Checkpointer(CheckpointConfig(str(tmp_path / "checkpoints"), async_save=False)) as saver:
        saver.save(1, {"train": state, "reference": nnx.state(reference, nnx.Param)}, policy_version=1)
    read, expected = read_checkpoint_params(tmp_path / "checkpoints" / "1"), _weights(policy)
    assert read.keys() == expected.keys()
    for name, value in expected.items():
        np.testing.assert_array_equal(read[name], value, err_msg=name)


def test_export_logs_no_warning(tmp_path, tokenizer, caplog, monkeypatch):
    """The checkpoint is read as it was written (orbax's step bookkeeping is in ``<step>/``, not in ``state/`` or
    ``metadata/``): no 'Metadata file does not exist' warning, nor any other, with paths relative to the cwd."""
    config = ARCHITECTURES["qwen2"]
    source = write_hf_checkpoint(tmp_path / "source", Transformer(config, rngs=nnx.Rngs(0)), config,
                                 tokenizer=tokenizer)
    _, params = _make_run(tmp_path, source, config, {3: 1})
    monkeypatch.chdir(tmp_path)
    with caplog.at_level("WARNING"):
        main(["run", "out"])
    assert [record.getMessage() for record in caplog.records if record.levelname != "INFO"] == []
    model = Transformer(config, rngs=nnx.Rngs(9))
    load_safetensors(model, tmp_path / "out")
    np.testing.assert_array_equal(_weights(model)["embed/embedding"], params[3]["embed/embedding"])


# --- write_hf_checkpoint ------------------------------------------------------------------------------------------

CONFIG = ARCHITECTURES["qwen2"]


@pytest.fixture(scope="module")
def weights():
    return _weights(Transformer(CONFIG, rngs=nnx.Rngs(3)))


def test_existing_directory_is_refused_unless_overwrite(tmp_path, weights):
    target = write_hf_checkpoint(tmp_path / "ckpt", weights, CONFIG, eos_token_ids=(EOS,))
    (target / "stale.txt").write_text("from the previous version")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        write_hf_checkpoint(target, weights, CONFIG)
    write_hf_checkpoint(target, weights, CONFIG, eos_token_ids=(IM_END,), overwrite=True)
    assert not (target / "stale.txt").exists()
    assert json.loads((target / "config.json").read_text())["eos_token_id"] == IM_END  # one id: an int
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ckpt"]  # no temporary or old directory left


@pytest.mark.parametrize("problem", ["missing parameter", "tokenizer without files"])
def test_a_failed_write_leaves_nothing_behind(tmp_path, weights, problem):
    (tmp_path / "empty_tokenizer").mkdir()
    with pytest.raises((KeyError, FileNotFoundError)):
        if problem == "missing parameter":
            write_hf_checkpoint(tmp_path / "ckpt", {k: v for k, v in weights.items() if k != "final_norm/scale"},
                                CONFIG)
        else:  # fails after the tensors are written
            write_hf_checkpoint(tmp_path / "ckpt", weights, CONFIG, tokenizer=tmp_path / "empty_tokenizer")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["empty_tokenizer"]


def test_tokenizer_directory_files_and_generation_config_are_carried_over(tmp_path, weights, tokenizer):
    source = tmp_path / "source"
    tokenizer.save_pretrained(source)
    (source / "chat_template.jinja").write_text("{{ messages }}")
    (source / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "eos_token_id": EOS}))
    (source / "model.safetensors").write_bytes(b"not copied")
    target = write_hf_checkpoint(tmp_path / "ckpt", weights, CONFIG, tokenizer=source, eos_token_ids=(EOS, IM_END),
                                 bos_token_id=BOS)
    copied = {path.name for path in source.iterdir()} - {"generation_config.json", "model.safetensors"}
    for name in copied:
        assert (target / name).read_bytes() == (source / name).read_bytes(), name
    assert json.loads((target / "generation_config.json").read_text()) == {
        "temperature": 0.7, "eos_token_id": [EOS, IM_END], "bos_token_id": BOS}
    assert safetensors.numpy.load_file(str(target / "model.safetensors")).keys() >= {"model.embed_tokens.weight"}


def test_weights_by_path_and_model_write_the_same_tensors(tmp_path):
    model = Transformer(CONFIG, rngs=nnx.Rngs(4))
    from_model = write_hf_checkpoint(tmp_path / "a", model, CONFIG)
    from_weights = write_hf_checkpoint(tmp_path / "b", _weights(model), CONFIG)
    a = safetensors.numpy.load_file(str(from_model / "model.safetensors"))
    b = safetensors.numpy.load_file(str(from_weights / "model.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(a[name], b[name]) for name in a)


def test_bad_dtype_is_refused(tmp_path, weights):
    with pytest.raises(ValueError, match="dtype='int8'"):
        write_hf_checkpoint(tmp_path / "ckpt", weights, CONFIG, dtype="int8")


# --- exports that load anywhere (issue #39, item 5) ---------------------------------------------------------------


@pytest.fixture()
def lora_run(tmp_path, tokenizer):
    """A LoRA run as the CLI leaves it: ``model.hf_path`` relative to the run's working directory (``tmp_path``), and
    checkpoints with a ``data`` item (the prompt stream's position)."""
    base = write_hf_checkpoint(tmp_path / "base", Transformer(CONFIG, rngs=nnx.Rngs(0)), CONFIG, tokenizer=tokenizer,
                               eos_token_ids=(EOS,), bos_token_id=BOS)
    lora = LoraConfig(rank=4, alpha=8.0)
    model = Transformer(dataclasses.replace(CONFIG, lora=lora), rngs=nnx.Rngs(1))
    rng = np.random.default_rng(2)  # non-zero B, so the adapter changes the base's output
    nnx.update(model, jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.1, x.dtype),
                                   nnx.state(model, LoRAParam)))
    run_config = to_dict(load_config(None, ["model.hf_path='base'", "model.lora.rank=4", "model.lora.alpha=8.0"]))
    with Checkpointer(CheckpointConfig(str(tmp_path / "run" / "checkpoints"), async_save=False)) as saver:
        saver.save(2, create_train_state(model, optax.adam(1e-3)), policy_version=2, config=run_config,
                   data_iterator=DataPosition({"epoch": 0, "index": 8}),
                   extra_metadata={"lora_base": base_identity(str(base), "tiny", 0)})
    return tmp_path, base, model


def _modes(directory: pathlib.Path) -> dict[str, str]:
    return {path.name: oct(stat.S_IMODE(path.stat().st_mode)) for path in directory.iterdir()}


def test_exports_load_from_anywhere_are_0644_and_log_no_warning(lora_run, caplog, monkeypatch):
    """A PEFT export names its base by absolute path (the run's relative ``model.hf_path`` resolved where the export
    runs), every file of either export is 0644 under umask 022 (safetensors 0.8 writes 0600 by itself), and reading
    a checkpoint with a ``data`` item logs nothing (orbax warned twice of the item it had no handler for)."""
    tmp_path, base, _ = lora_run
    monkeypatch.chdir(tmp_path)
    umask = os.umask(0o022)
    try:
        with caplog.at_level("WARNING"):
            main(["run", "peft"])
            main(["run", "merged", "--merged"])
            main(["run", "named", "--base-model", "Qwen/Qwen2.5-0.5B", "--allow-other-base"])
    finally:
        os.umask(umask)
    assert [record.getMessage() for record in caplog.records if record.levelname != "INFO"] == []
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.resolve())
    assert json.loads((tmp_path / "named" / "adapter_config.json").read_text())["base_model_name_or_path"] == (
        "Qwen/Qwen2.5-0.5B")
    assert _modes(tmp_path / "peft") == {"adapter_config.json": "0o644", "adapter_model.safetensors": "0o644"}
    merged = _modes(tmp_path / "merged")
    assert {"model.safetensors", "config.json", "generation_config.json"} <= merged.keys()
    assert set(merged.values()) == {"0o644"}, merged


def test_an_existing_safetensors_file_keeps_its_mode_and_memory_mapped_source(tmp_path):
    path = tmp_path / "weights.safetensors"
    write_safetensors({"w": np.arange(6, dtype=np.float32)}, path)
    path.chmod(0o640)
    loaded = safetensors.numpy.load_file(str(path))
    write_safetensors({"w": loaded["w"] * 2}, path)
    assert oct(stat.S_IMODE(path.stat().st_mode)) == "0o640"
    np.testing.assert_array_equal(safetensors.numpy.load_file(str(path))["w"], np.arange(6) * 2)


def test_peft_loads_the_adapter_from_another_working_directory(lora_run, monkeypatch):
    """PEFT's own loader (``AutoPeftModelForCausalLM``, with torch) reads the export from a directory that is neither
    the run's nor the export's, and computes the merged export's logits."""
    # peft needs torch, which the test extras leave out (a plain pip install pulls a CUDA build of several GB)
    peft = pytest.importorskip("peft", reason="PEFT is optional; .ci/run installs it with torch's CPU build")
    torch = pytest.importorskip("torch", reason="peft's dependency; .ci/run installs its CPU build")
    transformers = importlib.import_module("transformers")
    tmp_path, _, _ = lora_run
    monkeypatch.chdir(tmp_path)
    main(["run", "peft"])
    main(["run", "merged", "--merged"])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    adapted = peft.AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "peft")).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        ids = torch.tensor(TOKENS[None].astype(np.int64))
        np.testing.assert_allclose(adapted(ids).logits.numpy(), merged(ids).logits.numpy(), atol=1e-4)


def _named_model_run(tmp_path, *overrides):
    """A run directory of the default config's named model (no model.hf_path) holding checkpoint 3."""
    run_dir = tmp_path / "run"
    run_config = load_config(REPO_ROOT_CONFIG, [f"run_dir={json.dumps(str(run_dir))}", *overrides])
    model = Transformer(model_config(run_config.model.name), rngs=nnx.Rngs(0))
    with Checkpointer(CheckpointConfig(str(run_dir / "checkpoints"), async_save=False)) as saver:
        saver.save(3, create_train_state(model, optax.adam(1e-3)), policy_version=3, config=to_dict(run_config))
    return run_dir, run_config


REPO_ROOT_CONFIG = pathlib.Path(__file__).resolve().parents[2] / "configs" / "default.toml"


def test_the_default_runs_export_round_trips_its_tasks_tokenizer_in_transformers(tmp_path):
    """The README's run has no model.hf_path: the export writes its task's tokenizer (ids, eos), and transformers'
    AutoTokenizer reads a prompt of the task to the ids the run trained on, and back."""
    from learner.tasks import load_task

    transformers = importlib.import_module("transformers")
    run_dir, run_config = _named_model_run(tmp_path)
    main([str(run_dir), str(tmp_path / "out")])
    task = load_task(run_config.task.name, run_config.task.args)
    prompt_ids = task.prompts()[0]["prompt_ids"]  # bos, the question, the separator
    text = task.tokenizer.decode(prompt_ids, skip_special_tokens=True)
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert loaded.encode(text, add_special_tokens=False) == task.tokenizer.encode(text).tolist()
    assert loaded.decode(prompt_ids.tolist()) == "<bos>" + text + "<sep>"
    assert loaded.eos_token_id == task.tokenizer.eos_id
    assert json.loads((tmp_path / "out" / "config.json").read_text())["eos_token_id"] == task.tokenizer.eos_id
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text())["eos_token_id"] == 2


def test_an_export_whose_task_does_not_load_is_one_error_line(tmp_path, capsys):
    run_dir, _ = _named_model_run(tmp_path, 'task.name="no_such_module:task"')
    with pytest.raises(SystemExit, match=r"^error: the run's task 'no_such_module:task' does not load here "):
        main([str(run_dir), str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
