"""Hugging Face Llama / Qwen2 safetensors checkpoints <-> `learner.model.Transformer` parameters.

Hugging Face stores linear weights as ``[out, in]``; the model stores kernels as ``[in, out]`` with attention heads as
their own axis (q: ``[D, H, Dh]``, o: ``[H, Dh, D]``). `hf_name_map` is the name map; the conversion of each tensor
follows from its parameter path (kernels are transposed then reshaped, biases reshaped, the rest copied).

Loading is strict: a missing, mis-shaped or unknown tensor raises an error naming it. Tensors are read through the
safetensors numpy API (bfloat16 via ml_dtypes), a file or a directory of shards at a time.
"""

from __future__ import annotations

import json
import math
import pathlib

import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx
from safetensors import safe_open

from learner.model import ModelConfig, Transformer

ParamPath = tuple[str | int, ...]

# Tensors some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_name_map(config: ModelConfig) -> dict[str, ParamPath]:
    """Hugging Face tensor name -> model parameter path, for every parameter of the model.

    Example:
        >>> from learner.model import model_config
        >>> hf_name_map(model_config("tiny"))["model.layers.1.self_attn.q_proj.bias"]
        ('layers', 1, 'attn', 'q_proj', 'bias')
    """
    names: dict[str, ParamPath] = {"model.embed_tokens.weight": ("embed", "embedding"),
                                   "model.norm.weight": ("final_norm", "scale")}
    if not config.tie_embeddings:
        names["lm_head.weight"] = ("lm_head", "kernel")
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        names[prefix + "input_layernorm.weight"] = ("layers", i, "attn_norm", "scale")
        names[prefix + "post_attention_layernorm.weight"] = ("layers", i, "mlp_norm", "scale")
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names[prefix + f"self_attn.{proj}.weight"] = ("layers", i, "attn", proj, "kernel")
        if config.qkv_bias:
            for proj in ("q_proj", "k_proj", "v_proj"):
                names[prefix + f"self_attn.{proj}.bias"] = ("layers", i, "attn", proj, "bias")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names[prefix + f"mlp.{proj}.weight"] = ("layers", i, "mlp", proj, "kernel")
    return names


def _kernel_in_axes(path: ParamPath) -> int:
    return 2 if path[-2] == "o_proj" else 1  # o_proj contracts (heads, head_dim)


def _hf_shape(path: ParamPath, shape: tuple[int, ...]) -> tuple[int, ...]:
    if path[-1] == "kernel":
        n_in = _kernel_in_axes(path)
        return (math.prod(shape[n_in:]), math.prod(shape[:n_in]))
    if path[-1] == "bias":
        return (math.prod(shape),)
    return tuple(shape)


def _to_model_layout(array: np.ndarray, path: ParamPath, shape: tuple[int, ...]) -> np.ndarray:
    return (array.T if path[-1] == "kernel" else array).reshape(shape)


def _to_hf_layout(array: np.ndarray, path: ParamPath, hf_shape: tuple[int, ...]) -> np.ndarray:
    if path[-1] == "kernel":
        return np.ascontiguousarray(array.reshape(hf_shape[::-1]).T)
    return array.reshape(hf_shape)


def _safetensors_files(path: str | pathlib.Path) -> list[pathlib.Path]:
    path = pathlib.Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"no safetensors file at {path}")
    return files


def _params_by_path(model: Transformer) -> dict[ParamPath, nnx.Variable]:
    return dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))


def load_safetensors(model: Transformer, path: str | pathlib.Path) -> None:
    """Loads a Hugging Face Llama / Qwen2 checkpoint into ``model`` in place, cast to its ``param_dtype``.

    Args:
        model: a model whose config matches the checkpoint (see `config_from_hf`).
        path: a ``.safetensors`` file or a directory of them (sharded checkpoints).

    Raises:
        KeyError: a tensor is missing, or the checkpoint has a tensor the model does not know.
        ValueError: a tensor has the wrong shape.
    """
    files = _safetensors_files(path)
    name_map = hf_name_map(model.config)
    params = _params_by_path(model)
    dtype = jnp.dtype(model.config.param_dtype)
    seen = set()
    for file in files:
        with safe_open(file, framework="numpy") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and model.config.tie_embeddings):
                    continue
                if name not in name_map:
                    raise KeyError(f"tensor {name!r} in {file} has no parameter in the model (config mismatch?)")
                param_path = name_map[name]
                shape = params[param_path].shape
                expected = _hf_shape(param_path, shape)
                got = tuple(f.get_slice(name).get_shape())
                if got != expected:
                    raise ValueError(f"tensor {name!r} in {file} has shape {got}, expected {expected}")
                params[param_path][...] = jnp.asarray(_to_model_layout(f.get_tensor(name), param_path, shape)
                                                      .astype(dtype))
                seen.add(name)
    missing = sorted(set(name_map) - seen)
    if missing:
        raise KeyError(f"tensor {missing[0]!r} missing from {path} ({len(missing)} missing in all)")


def save_safetensors(model: Transformer, path: str | pathlib.Path, dtype: str | None = None) -> None:
    """Writes the model's parameters as one Hugging Face-layout ``.safetensors`` file (inverse of the loader).

    Args:
        model: the model to export.
        path: output file.
        dtype: tensor dtype in the file (e.g. "bfloat16"); defaults to the parameter dtype.
    """
    params = _params_by_path(model)
    tensors = {}
    for name, param_path in hf_name_map(model.config).items():
        array = np.asarray(params[param_path][...])
        if dtype is not None:
            array = array.astype(jnp.dtype(dtype))
        tensors[name] = _to_hf_layout(array, param_path, _hf_shape(param_path, array.shape))
    safetensors.numpy.save_file(tensors, str(path))


def save_hf_checkpoint(model: Transformer, directory: str | pathlib.Path) -> pathlib.Path:
    """Writes ``config.json`` and ``model.safetensors``: a checkpoint directory that ``model.hf_path`` loads.

    Returns the directory. The config is `config_to_hf`'s, so loading it back gives the same `ModelConfig`.
    """
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config_to_hf(model.config), indent=2))
    save_safetensors(model, directory / "model.safetensors")
    return directory


def config_to_hf(config: ModelConfig) -> dict:
    """The Hugging Face ``config.json`` dict of a `ModelConfig` (inverse of `config_from_hf`, up to dtypes).

    Example:
        >>> from learner.model import model_config
        >>> tiny = model_config("tiny")
        >>> config_to_hf(tiny)["model_type"], config_from_hf(config_to_hf(tiny)) == tiny
        ('qwen2', True)
    """
    return {
        "model_type": "qwen2" if config.qkv_bias else "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "max_position_embeddings": config.max_seq_len,
        "torch_dtype": config.param_dtype,
    }


def config_from_hf(hf_config: dict, **overrides) -> ModelConfig:
    """Builds a ModelConfig from a Hugging Face ``config.json`` dict (model_type "llama" or "qwen2").

    Args:
        hf_config: the parsed config.json.
        **overrides: ModelConfig fields to set (e.g. ``dtype="bfloat16"``, a shorter ``max_seq_len``).

    Example:
        >>> config_from_hf({"model_type": "qwen2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        ...                 "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}).qkv_bias
        True
    """
    model_type = hf_config.get("model_type")
    if model_type not in ("llama", "qwen2"):
        raise ValueError(f"config.json model_type {model_type!r} is not supported (llama, qwen2)")
    for unsupported in ("rope_scaling", "attention_bias", "mlp_bias"):  # Llama's attention_bias includes o_proj
        if hf_config.get(unsupported):
            raise ValueError(f"config.json {unsupported}={hf_config[unsupported]!r} is not supported")
    num_heads = hf_config["num_attention_heads"]
    fields = dict(
        vocab_size=hf_config["vocab_size"],
        hidden_size=hf_config["hidden_size"],
        intermediate_size=hf_config["intermediate_size"],
        num_layers=hf_config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf_config.get("num_key_value_heads", num_heads),
        head_dim=hf_config.get("head_dim") or hf_config["hidden_size"] // num_heads,
        rope_theta=float(hf_config.get("rope_theta", 10_000.0)),
        rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2",
        max_seq_len=hf_config.get("max_position_embeddings", 2048),
    )
    return ModelConfig(**(fields | overrides))
