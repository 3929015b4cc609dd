"""Safetensors I/O: HF layout round trip, strict errors, and a NumPy float64 reference forward on HF weights."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from learner.checkpoints.safetensors_io import (
    config_from_hf,
    config_to_hf,
    hf_name_map,
    hf_tensors,
    load_safetensors,
    save_safetensors,
)
from learner.model.param_paths import named_leaves
from learner.model.transformer import Llama3RopeScaling, Transformer, model_config

LLAMA3 = Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)
CONFIGS = {"qwen2_untied": model_config("tiny"),
           "llama_tied": model_config("tiny", qkv_bias=False, tie_embeddings=True, rope_theta=500_000.0),
           # Qwen3's per-head q/k norms with Llama 3's RoPE remapping (no real model has both; each is tested here).
           "qk_norm_llama3_rope": model_config("tiny", qkv_bias=False, qk_norm=True, rope_scaling=LLAMA3)}


def _hf_shapes(cfg):
    d, f, h, k, dh, v = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                         cfg.vocab_size)
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (v, d)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                   p + "self_attn.q_proj.weight": (h * dh, d), p + "self_attn.k_proj.weight": (k * dh, d),
                   p + "self_attn.v_proj.weight": (k * dh, d), p + "self_attn.o_proj.weight": (d, h * dh),
                   p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                   p + "mlp.down_proj.weight": (d, f)}
        if cfg.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (h * dh,), p + "self_attn.k_proj.bias": (k * dh,),
                       p + "self_attn.v_proj.bias": (k * dh,)}
        if cfg.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (dh,), p + "self_attn.k_norm.weight": (dh,)}
    return shapes


def _random_hf_weights(cfg, seed=0):
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in _hf_shapes(cfg).items():
        if name.endswith("norm.weight"):
            weights[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            weights[name] = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    return weights


def _reference_logits(w, cfg, tokens):
    """Llama/Qwen2/Qwen3 forward from the formulas, float64, HF weight layout, one unpadded sequence."""
    w = {name: value.astype(np.float64) for name, value in w.items()}
    t, h, k, dh = len(tokens), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def rms_norm(x, scale):
        return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + cfg.rms_norm_eps) * scale

    def rope(x):  # x [T, heads, Dh]
        inv_freq = cfg.rope_theta ** (-np.arange(0, dh, 2) / dh)
        if cfg.rope_scaling is not None:  # Llama 3.1 (Meta's apply_scaling), per frequency
            s = cfg.rope_scaling
            old = s.original_max_position_embeddings
            scaled = []
            for freq in inv_freq:
                wavelen = 2 * math.pi / freq
                if wavelen < old / s.high_freq_factor:
                    scaled.append(freq)
                elif wavelen > old / s.low_freq_factor:
                    scaled.append(freq / s.factor)
                else:
                    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
                    scaled.append((1 - smooth) * freq / s.factor + smooth * freq)
            inv_freq = np.array(scaled)
        angle = np.arange(t)[:, None] * inv_freq[None, :]
        cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
        x1, x2 = x[..., : dh // 2], x[..., dh // 2:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def linear(x, name):
        y = x @ w[name + ".weight"].T
        return y + w[name + ".bias"] if name + ".bias" in w else y

    x = w["model.embed_tokens.weight"][tokens]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = rms_norm(x, w[p + "input_layernorm.weight"])
        q = linear(a, p + "self_attn.q_proj").reshape(t, h, dh)
        key = linear(a, p + "self_attn.k_proj").reshape(t, k, dh)
        if cfg.qk_norm:
            q, key = rms_norm(q, w[p + "self_attn.q_norm.weight"]), rms_norm(key, w[p + "self_attn.k_norm.weight"])
        q, key = rope(q), rope(key)
        val = linear(a, p + "self_attn.v_proj").reshape(t, k, dh)
        heads = []
        for head in range(h):
            kv = head // (h // k)
            scores = q[:, head] @ key[:, kv].T / np.sqrt(dh)
            scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            heads.append((probs / probs.sum(-1, keepdims=True)) @ val[:, kv])
        x = x + linear(np.concatenate(heads, axis=-1), p + "self_attn.o_proj")
        m = rms_norm(x, w[p + "post_attention_layernorm.weight"])
        gate = linear(m, p + "mlp.gate_proj")
        x = x + linear(gate / (1 + np.exp(-gate)) * linear(m, p + "mlp.up_proj"), p + "mlp.down_proj")
    x = rms_norm(x, w["model.norm.weight"])
    head = w["model.embed_tokens.weight"] if cfg.tie_embeddings else w["lm_head.weight"]
    return x @ head.T


def _empty_model(cfg):
    return Transformer(cfg, rngs=nnx.Rngs(123))


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_loaded_model_matches_float64_reference(tmp_path, kind):
    cfg = CONFIGS[kind]
    weights = _random_hf_weights(cfg)
    safetensors.numpy.save_file(weights, str(tmp_path / "model.safetensors"))
    model = _empty_model(cfg)
    load_safetensors(model, tmp_path / "model.safetensors")
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, 12)
    logits = jax.jit(lambda m, t: m.logits(m(t, jnp.arange(12)[None])))(model, jnp.asarray(tokens[None]))
    np.testing.assert_allclose(logits[0], _reference_logits(weights, cfg, tokens), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_export_round_trips_hf_tensors(tmp_path, kind):
    cfg = CONFIGS[kind]
    weights = _random_hf_weights(cfg, seed=2)
    safetensors.numpy.save_file(weights, str(tmp_path / "in.safetensors"))
    model = _empty_model(cfg)
    load_safetensors(model, tmp_path / "in.safetensors")
    save_safetensors(model, tmp_path / "out.safetensors")
    exported = safetensors.numpy.load_file(str(tmp_path / "out.safetensors"))
    assert exported.keys() == weights.keys()
    for name, value in weights.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)


def test_export_then_load_restores_model_params(tmp_path):
    source = Transformer(CONFIGS["qwen2_untied"], rngs=nnx.Rngs(5))
    save_safetensors(source, tmp_path / "m.safetensors")
    target = _empty_model(CONFIGS["qwen2_untied"])
    load_safetensors(target, tmp_path)  # a directory of shards works too
    for a, b in zip(jax.tree.leaves(nnx.state(source)), jax.tree.leaves(nnx.state(target)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_sharded_checkpoint_directory_loads(tmp_path):
    cfg = CONFIGS["llama_tied"]
    weights = _random_hf_weights(cfg, seed=3)
    names = sorted(weights)
    for shard, shard_names in enumerate((names[::2], names[1::2]), start=1):
        safetensors.numpy.save_file({n: weights[n] for n in shard_names},
                                    str(tmp_path / f"model-0000{shard}-of-00002.safetensors"))
    model = _empty_model(cfg)
    load_safetensors(model, tmp_path)
    np.testing.assert_array_equal(model.embed.embedding[...], weights["model.embed_tokens.weight"])


def test_bfloat16_checkpoint_is_cast_to_param_dtype(tmp_path):
    cfg = CONFIGS["llama_tied"]
    weights = {n: v.astype(jnp.bfloat16) for n, v in _random_hf_weights(cfg).items()}
    safetensors.numpy.save_file(weights, str(tmp_path / "m.safetensors"))
    model = _empty_model(cfg)
    load_safetensors(model, tmp_path / "m.safetensors")
    assert model.final_norm.scale[...].dtype == jnp.float32
    np.testing.assert_array_equal(model.final_norm.scale[...], weights["model.norm.weight"].astype(np.float32))


def test_missing_tensor_error_names_it(tmp_path):
    weights = _random_hf_weights(CONFIGS["qwen2_untied"])
    del weights["model.layers.1.self_attn.k_proj.bias"]
    safetensors.numpy.save_file(weights, str(tmp_path / "m.safetensors"))
    with pytest.raises(KeyError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_safetensors(_empty_model(CONFIGS["qwen2_untied"]), tmp_path / "m.safetensors")


def test_misshaped_tensor_error_names_it_and_shapes(tmp_path):
    weights = _random_hf_weights(CONFIGS["qwen2_untied"])
    weights["model.layers.0.mlp.up_proj.weight"] = weights["model.layers.0.mlp.up_proj.weight"].T.copy()
    safetensors.numpy.save_file(weights, str(tmp_path / "m.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*\(64, 128\).*\(128, 64\)"):
        load_safetensors(_empty_model(CONFIGS["qwen2_untied"]), tmp_path / "m.safetensors")


def test_unknown_tensor_error_names_it(tmp_path):
    cfg = CONFIGS["qwen2_untied"]
    weights = _random_hf_weights(cfg) | {"model.layers.2.input_layernorm.weight": np.ones(64, np.float32)}
    safetensors.numpy.save_file(weights, str(tmp_path / "m.safetensors"))
    with pytest.raises(KeyError, match=r"model\.layers\.2\.input_layernorm\.weight"):
        load_safetensors(_empty_model(cfg), tmp_path / "m.safetensors")


def test_name_map_covers_every_parameter():
    for cfg in CONFIGS.values():
        assert set(hf_name_map(cfg).values()) == set(named_leaves(nnx.state(_empty_model(cfg), nnx.Param)))
        assert set(hf_name_map(cfg)) == set(_hf_shapes(cfg))


def test_config_from_hf_qwen2_0_5b():
    qwen = {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
            "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-06, "tie_word_embeddings": True, "max_position_embeddings": 32768}
    assert config_from_hf(qwen) == model_config("qwen2-0.5b")


@pytest.mark.parametrize("name", ["tiny", "small", "100m", "qwen2-0.5b", "llama-1b", "llama-8b"])
def test_config_to_hf_round_trips(name):
    config = model_config(name)
    assert config_from_hf(config_to_hf(config)) == config


def test_hf_tensors_refuse_missing_extra_and_misshaped_parameters():
    cfg = CONFIGS["qwen2_untied"]
    weights = {path: np.asarray(leaf) for path, leaf in named_leaves(nnx.state(_empty_model(cfg), nnx.Param)).items()}
    with pytest.raises(KeyError, match=r"'layers/0/attn/q_proj/bias' is missing"):
        hf_tensors({k: v for k, v in weights.items() if k != "layers/0/attn/q_proj/bias"}, cfg)
    with pytest.raises(KeyError, match=r"'layers/9/attn_norm/scale' is not a parameter"):
        hf_tensors(weights | {"layers/9/attn_norm/scale": np.ones(64)}, cfg)
    with pytest.raises(ValueError, match=r"'final_norm/scale' has shape \(63,\), expected \(64,\)"):
        hf_tensors(weights | {"final_norm/scale": np.ones(63)}, cfg)
