"""Hugging Face models: golden logits of transformers (and mlx-lm) on tiny random checkpoints, and config.json parsing.

The fixtures under tests/fixtures/hf_golden were made by scripts/make_golden_logits.py with torch 2.13.0 and
transformers 5.12.1 (float32, eager attention); no torch is needed here. Float32 logits of a 2-layer model computed
by two implementations agree to ~1e-6 (summation order differs); the tolerance 1e-4 leaves room for that, while
every bug class these cases guard against (a wrong RoPE theta or scaling, a missing norm or bias, GQA head mapping)
moves the logits by more than 1e-2 (`test_golden_logits_detect_a_wrong_rope`).
"""

import dataclasses
import importlib
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from learner.checkpoints.hf_checkpoint import model_config_from_checkpoint
from learner.checkpoints.safetensors_io import config_from_hf, config_to_hf, load_safetensors
from learner.model.transformer import Llama3RopeScaling, ModelConfig, Transformer, model_config

GOLDEN = pathlib.Path(__file__).resolve().parents[2] / "fixtures" / "hf_golden"
CASES = sorted(path.name for path in GOLDEN.iterdir() if (path / "golden.npz").is_file())


def _golden(case: str) -> tuple[np.ndarray, np.ndarray]:
    data = np.load(GOLDEN / case / "golden.npz")
    return data["input_ids"], data["logits"]


@jax.jit
def _logits(model: Transformer, input_ids: jax.Array) -> jax.Array:
    positions = jnp.arange(input_ids.shape[0])[None]
    return model.logits(model(input_ids[None], positions))[0]


def _tether_logits(config: ModelConfig, case: str) -> np.ndarray:
    model = Transformer(config, rngs=nnx.Rngs(0))
    load_safetensors(model, GOLDEN / case)
    return np.asarray(_logits(model, jnp.asarray(_golden(case)[0])))


@pytest.fixture(scope="module")
def tether_logits() -> dict[str, np.ndarray]:
    return {case: _tether_logits(model_config_from_checkpoint(GOLDEN / case), case) for case in CASES}


def test_fixtures_cover_every_architecture_and_rope_spelling():
    configs = {case: json.loads((GOLDEN / case / "config.json").read_text()) for case in CASES}
    assert {config["model_type"] for config in configs.values()} == {"llama", "mistral", "qwen2", "qwen3"}
    assert any("rope_parameters" in config and "rope_theta" not in config for config in configs.values())
    assert any(config.get("rope_scaling", {}).get("rope_type") == "llama3" for config in configs.values())
    assert sum(file.stat().st_size for file in GOLDEN.rglob("*") if file.is_file()) < 2 * 2**20


@pytest.mark.parametrize("case", CASES)
def test_tether_logits_equal_transformers(tether_logits, case):
    np.testing.assert_allclose(tether_logits[case], _golden(case)[1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("case, wrong", [
    ("llama3_rope_scaling", {"rope_scaling": None}),  # Llama 3 scaling ignored (the old llama-1b comment)
    ("llama3_rope_parameters", {"rope_theta": 10_000.0}),  # rope_parameters ignored (the old loader)
    ("qwen2_rope_parameters", {"rope_theta": 10_000.0}),
])
def test_golden_logits_detect_a_wrong_rope(tether_logits, case, wrong):
    right = model_config_from_checkpoint(GOLDEN / case)
    assert np.abs(_tether_logits(dataclasses.replace(right, **wrong), case) - tether_logits[case]).max() > 1e-2


MLX_IGNORES_ROPE_PARAMETERS = pytest.mark.xfail(
    strict=True, reason="mlx-lm 0.31.3 reads only rope_theta / rope_scaling, not transformers 5's rope_parameters: "
                        "it runs this checkpoint with the default theta and no scaling (exports write both spellings)")


@pytest.mark.parametrize("case", [pytest.param(case, marks=MLX_IGNORES_ROPE_PARAMETERS)
                                  if case == "llama3_rope_parameters" else case for case in CASES])
def test_mlx_lm_raw_logprobs_equal_tether(tether_logits, case):
    mx = importlib.import_module("mlx.core")
    mlx_utils = importlib.import_module("mlx_lm.utils")
    model, _ = mlx_utils.load_model(GOLDEN / case)
    logits = model(mx.array(_golden(case)[0])[None]).astype(mx.float32)
    mlx_logprobs = np.asarray(logits - mx.logsumexp(logits, axis=-1, keepdims=True))[0]
    tether_logprobs = np.asarray(jax.nn.log_softmax(tether_logits[case], axis=-1))
    np.testing.assert_allclose(mlx_logprobs, tether_logprobs, atol=1e-5, rtol=0)


# --- config.json parsing ------------------------------------------------------------------------------------------

# Real config.json files, as published (fields that do not affect the model left out).
LLAMA_3_2_1B = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "head_dim": 64, "hidden_act": "silu",
                "hidden_size": 2048, "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
                "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
                "pretraining_tp": 1, "rms_norm_eps": 1e-05,
                "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                 "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 128256}
QWEN2_5_0_5B_INSTRUCT = {"architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": 896,
                         "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21,
                         "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
                         "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
                         "sliding_window": 32768, "tie_word_embeddings": True, "use_sliding_window": False,
                         "vocab_size": 151936}
QWEN3_0_6B = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "head_dim": 128, "hidden_act": "silu",
              "hidden_size": 1024, "intermediate_size": 3072, "max_position_embeddings": 40960,
              "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
              "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
              "sliding_window": None, "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936}
MISTRAL_7B_V0_1 = {"architectures": ["MistralForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
                   "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
                   "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                   "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
                   "tie_word_embeddings": False, "vocab_size": 32000}


def test_llama_3_2_1b_is_the_named_config_with_its_rope_scaling():
    assert config_from_hf(LLAMA_3_2_1B, max_seq_len=8192) == model_config("llama-1b")


def test_qwen2_5_instruct_config_without_sliding_window_in_use():
    assert config_from_hf(QWEN2_5_0_5B_INSTRUCT) == model_config("qwen2-0.5b")


def test_qwen3_config_has_qk_norm_and_no_bias():
    config = config_from_hf(QWEN3_0_6B)
    assert (config.qk_norm, config.qkv_bias, config.head_dim, config.num_kv_heads) == (True, False, 128, 8)


def test_mistral_sliding_window_is_refused_unless_sequences_fit_in_it():
    with pytest.raises(ValueError, match=r"sliding_window=4096 .*max_seq_len=32768.*max_seq_len <= 4096"):
        config_from_hf(MISTRAL_7B_V0_1)
    assert config_from_hf(MISTRAL_7B_V0_1, max_seq_len=4096).max_seq_len == 4096
    absent = {key: value for key, value in MISTRAL_7B_V0_1.items() if key != "sliding_window"}
    with pytest.raises(ValueError, match="sliding_window=4096"):  # transformers' default when the key is absent
        config_from_hf(absent)
    assert config_from_hf(MISTRAL_7B_V0_1 | {"sliding_window": None}).max_seq_len == 32768


def test_qwen_sliding_window_is_refused_only_where_a_layer_slides():
    sliding = QWEN2_5_0_5B_INSTRUCT | {"use_sliding_window": True, "sliding_window": 4096}
    with pytest.raises(ValueError, match=r"sliding_window=4096 \(layers 21\.\.23\)"):
        config_from_hf(sliding)
    assert config_from_hf(sliding | {"max_window_layers": 24}).num_layers == 24  # no layer slides
    with pytest.raises(ValueError, match=r"layers 0\.\.0"):
        config_from_hf(sliding | {"layer_types": ["sliding_attention"] + ["full_attention"] * 23})


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "linear", "longrope"])
@pytest.mark.parametrize("spelling", ["rope_scaling", "rope_parameters"])
def test_unimplemented_rope_types_are_refused_by_name(rope_type, spelling):
    config = LLAMA_3_2_1B | {"rope_scaling": None, spelling: {"rope_type": rope_type, "factor": 4.0}}
    with pytest.raises(ValueError, match=f"RoPE type '{rope_type}'"):
        config_from_hf(config)


def test_legacy_type_key_of_rope_scaling_is_read():
    legacy = LLAMA_3_2_1B | {"rope_scaling": {k: v for k, v in LLAMA_3_2_1B["rope_scaling"].items()
                                              if k != "rope_type"} | {"type": "llama3"}}
    assert config_from_hf(legacy, max_seq_len=8192) == model_config("llama-1b")


def test_rope_parameters_spelling_equals_the_legacy_one():
    rope = dict(LLAMA_3_2_1B["rope_scaling"], rope_theta=500000.0)
    current = {k: v for k, v in LLAMA_3_2_1B.items() if k not in ("rope_scaling", "rope_theta")}
    assert config_from_hf(current | {"rope_parameters": rope}) == config_from_hf(LLAMA_3_2_1B)


def test_llama3_original_context_defaults_to_max_position_embeddings():
    rope = {k: v for k, v in LLAMA_3_2_1B["rope_scaling"].items() if k != "original_max_position_embeddings"}
    config = config_from_hf(LLAMA_3_2_1B | {"rope_scaling": rope})
    assert config.rope_scaling.original_max_position_embeddings == 131072


@pytest.mark.parametrize("field, value, message", [
    ("model_type", "gemma", "model_type='gemma' is not supported"),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("attention_bias", True, "attention_bias=true is not implemented for llama"),
    ("mlp_bias", True, "mlp_bias=True"),
    ("partial_rotary_factor", 0.5, "partial_rotary_factor=0.5"),
    ("quantization_config", {"quant_method": "awq"}, "quantization_config"),
    ("rope_theta", 10000.0, "rope_theta=10000.0 contradicts rope_parameters.rope_theta=500000.0"),
    ("rope_parameters", {"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}},
     "one RoPE per layer type"),
])
def test_unimplemented_fields_are_refused_by_name(field, value, message):
    config = LLAMA_3_2_1B | {field: value}
    if field == "rope_theta":  # rope_parameters with another theta than the top-level one
        config["rope_parameters"] = dict(LLAMA_3_2_1B["rope_scaling"], rope_theta=500000.0)
    with pytest.raises(ValueError, match=message):
        config_from_hf(config)


def test_qwen3_attention_bias_is_refused_and_qwen2_ignores_the_key():
    with pytest.raises(ValueError, match="attention_bias=true is not implemented for qwen3"):
        config_from_hf(QWEN3_0_6B | {"attention_bias": True})
    assert config_from_hf(QWEN2_5_0_5B_INSTRUCT | {"attention_bias": True}).qkv_bias  # transformers' Qwen2 too


def test_absent_fields_take_transformers_defaults_per_model_type():
    minimal = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 1,
               "num_attention_heads": 32}
    qwen3 = config_from_hf(minimal | {"model_type": "qwen3"})
    assert (qwen3.head_dim, qwen3.num_kv_heads, qwen3.max_seq_len) == (128, 32, 32768)
    llama = config_from_hf(minimal | {"model_type": "llama"})
    assert (llama.head_dim, llama.num_kv_heads, llama.max_seq_len, llama.rope_theta) == (2, 32, 2048, 10000.0)


def test_checkpoint_directory_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        model_config_from_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_2_1B | {"mlp_bias": True}))
    with pytest.raises(ValueError, match=r"config\.json: config\.json mlp_bias"):
        model_config_from_checkpoint(tmp_path)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_config_to_hf_round_trips_every_architecture(model_type):
    scaling = Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=64)
    config = model_config("tiny", qkv_bias=model_type == "qwen2", qk_norm=model_type == "qwen3",
                          rope_scaling=scaling if model_type == "llama" else None)
    hf = config_to_hf(config, model_type)
    assert hf["model_type"] == model_type and config_from_hf(hf) == config


def test_config_to_hf_refuses_an_architecture_that_cannot_hold_the_config():
    with pytest.raises(ValueError, match="model_type='llama' cannot represent"):
        config_to_hf(model_config("tiny"), "llama")  # tiny has q/k/v biases: Qwen2


# --- run configs for Hugging Face models --------------------------------------------------------------------------

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("name", ["gsm8k_qwen2.5.toml", "hf_model_template.toml"])
def test_hf_run_configs_load_and_their_task_args_fit_the_dataset_task(name):
    import inspect

    from learner.rl.config import load_config
    from learner.tasks._dataset_task import DatasetTask

    config = load_config(REPO_ROOT / "configs" / name)
    assert config.model.hf_path and config.task.name == "dataset" and config.warmup.steps == 0
    inspect.signature(DatasetTask).bind(**config.task.args)  # every key is an argument of the task
    validation = config.task.args.get("validation", {})
    assert set(validation) <= {"path", "format", "split", "fraction", "every", "max_prompts"}


def test_gsm8k_recipe_scores_with_the_gsm8k_reward_under_the_chat_template():
    from learner.rl.config import load_config

    config = load_config(REPO_ROOT / "configs" / "gsm8k_qwen2.5.toml")
    args = config.task.args
    assert args["rewards"] == ["gsm8k"] and args["answer_column"] == "answer"
    assert "####" in args["prompt_format"] and "{question}" in args["prompt_format"]
    assert config.server.dtype == "bfloat16" and config.corrections.preset == "decoupled_geo_rs_token_tis"
