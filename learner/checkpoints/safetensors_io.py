"""Hugging Face checkpoints <-> `learner.model.Transformer`: safetensors tensors and the ``config.json`` dict.

Hugging Face stores linear weights as ``[out, in]``; the model stores kernels as ``[in, out]`` with attention heads as
their own axis (q: ``[D, H, Dh]``, o: ``[H, Dh, D]``). `hf_name_map` maps Hugging Face tensor names to parameter paths
(`learner.model.param_paths`); the conversion of each tensor follows from its path (kernels are transposed then
reshaped,
biases reshaped, the rest copied).

Loading is strict: a missing, mis-shaped or unknown tensor raises an error naming it. Tensors are read through the
safetensors numpy API (bfloat16 via ml_dtypes), a file or a directory of shards at a time.

`config_from_hf` reads the config.json of the architectures the model implements (model_type llama, mistral, qwen2,
qwen3) in every spelling transformers has used for RoPE (top-level ``rope_theta``, legacy ``rope_scaling``,
transformers 5's ``rope_parameters``) and refuses, naming the field, everything the model does not implement (other
RoPE types, sliding windows in use, biases other than Qwen2's q/k/v bias, activations other than SiLU, ...).
`config_to_hf` is its inverse. Directory-level reading and writing (tokenizer files, generation config, atomic
writes) is `learner.checkpoints.hf_checkpoint`'s.
"""

from __future__ import annotations

import math
import os
import pathlib
import stat
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx
from safetensors import safe_open

from learner.model.param_paths import named_leaves, update_named
from learner.model.transformer import Llama3RopeScaling, ModelConfig, Transformer

__all__ = [
    "ARCHITECTURES",
    "config_from_hf",
    "config_to_hf",
    "hf_name_map",
    "hf_tensors",
    "load_safetensors",
    "save_safetensors",
]

# model_type -> the transformers class name written to config.json "architectures".
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}

# Tensors some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_name_map(config: ModelConfig) -> dict[str, str]:
    """Hugging Face tensor name -> parameter path (`learner.model.param_paths`), for every parameter of the model.

    Example:
        >>> from learner.model.transformer import model_config
        >>> hf_name_map(model_config("tiny"))["model.layers.1.self_attn.q_proj.bias"]
        'layers/1/attn/q_proj/bias'
    """
    names = {"model.embed_tokens.weight": "embed/embedding", "model.norm.weight": "final_norm/scale"}
    if not config.tie_embeddings:
        names["lm_head.weight"] = "lm_head/kernel"
    for i in range(config.num_layers):
        hf, path = f"model.layers.{i}.", f"layers/{i}/"
        names[hf + "input_layernorm.weight"] = path + "attn_norm/scale"
        names[hf + "post_attention_layernorm.weight"] = path + "mlp_norm/scale"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names[hf + f"self_attn.{proj}.weight"] = path + f"attn/{proj}/kernel"
        if config.qkv_bias:
            for proj in ("q_proj", "k_proj", "v_proj"):
                names[hf + f"self_attn.{proj}.bias"] = path + f"attn/{proj}/bias"
        if config.qk_norm:
            for norm in ("q_norm", "k_norm"):
                names[hf + f"self_attn.{norm}.weight"] = path + f"attn/{norm}/scale"
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names[hf + f"mlp.{proj}.weight"] = path + f"mlp/{proj}/kernel"
    return names


def _parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    return {path: tuple(leaf.shape) for path, leaf in named_leaves(nnx.state(abstract, nnx.Param)).items()}


def _hf_shape(path: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if path.endswith("/kernel"):
        n_in = 2 if path.endswith("o_proj/kernel") else 1  # o_proj contracts (heads, head_dim)
        return (math.prod(shape[n_in:]), math.prod(shape[:n_in]))
    if path.endswith("/bias"):
        return (math.prod(shape),)
    return tuple(shape)


def _to_model_layout(array: np.ndarray, path: str, shape: tuple[int, ...]) -> np.ndarray:
    return (array.T if path.endswith("/kernel") else array).reshape(shape)


def _to_hf_layout(array: np.ndarray, path: str, hf_shape: tuple[int, ...]) -> np.ndarray:
    if path.endswith("/kernel"):
        return np.ascontiguousarray(array.reshape(hf_shape[::-1]).T)
    return array.reshape(hf_shape)


def _safetensors_files(path: str | pathlib.Path) -> list[pathlib.Path]:
    path = pathlib.Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"no safetensors file at {path}")
    return files


def load_safetensors(model: Transformer, path: str | pathlib.Path) -> None:
    """Loads a Hugging Face checkpoint's tensors into ``model`` in place, cast to its ``param_dtype``.

    Args:
        model: a model whose config matches the checkpoint (see `config_from_hf`).
        path: a ``.safetensors`` file or a directory of them (sharded checkpoints).

    Raises:
        KeyError: a tensor is missing, or the checkpoint has a tensor the model does not know.
        ValueError: a tensor has the wrong shape.
    """
    name_map = hf_name_map(model.config)
    shapes = _parameter_shapes(model.config)
    dtype = jnp.dtype(model.config.param_dtype)
    arrays = {}
    for file in _safetensors_files(path):
        with safe_open(file, framework="numpy") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and model.config.tie_embeddings):
                    continue
                if name not in name_map:
                    raise KeyError(f"tensor {name!r} in {file} has no parameter in the model (config mismatch?)")
                param_path = name_map[name]
                expected = _hf_shape(param_path, shapes[param_path])
                got = tuple(f.get_slice(name).get_shape())
                if got != expected:
                    raise ValueError(f"tensor {name!r} in {file} has shape {got}, expected {expected}")
                arrays[param_path] = _to_model_layout(f.get_tensor(name), param_path, shapes[param_path]).astype(dtype)
    missing = sorted(name for name, param_path in name_map.items() if param_path not in arrays)
    if missing:
        raise KeyError(f"tensor {missing[0]!r} missing from {path} ({len(missing)} missing in all)")
    update_named(model, arrays)


def hf_tensors(weights: Mapping[str, np.ndarray], config: ModelConfig, dtype: str | None = None
               ) -> dict[str, np.ndarray]:
    """The Hugging Face tensors (names, layout) of parameters given by path, e.g. ``Trainer.host_weights()``.

    Args:
        weights: ``{parameter path: array}``, exactly the parameters of a model with ``config``.
        config: the model's config.
        dtype: tensor dtype (e.g. "bfloat16"); None keeps each array's.

    Raises:
        KeyError: a parameter is missing from ``weights``, or ``weights`` has one the model does not.
        ValueError: an array has the wrong shape.
    """
    shapes = _parameter_shapes(config)
    for problem, names in (("missing from the weights", set(shapes) - set(weights)),
                           ("not a parameter of the model", set(weights) - set(shapes))):
        if names:
            raise KeyError(f"parameter {sorted(names)[0]!r} is {problem} ({len(names)} in all; config mismatch?)")
    tensors = {}
    for name, param_path in hf_name_map(config).items():
        array = np.asarray(weights[param_path])
        if array.shape != shapes[param_path]:
            raise ValueError(f"parameter {param_path!r} has shape {array.shape}, expected {shapes[param_path]}")
        if dtype is not None:
            array = array.astype(jnp.dtype(dtype))
        tensors[name] = _to_hf_layout(array, param_path, _hf_shape(param_path, array.shape))
    return tensors


def save_safetensors(model: Transformer, path: str | pathlib.Path, dtype: str | None = None) -> None:
    """Writes the model's parameters as one Hugging Face-layout ``.safetensors`` file (inverse of the loader).

    Args:
        model: the model to export.
        path: output file.
        dtype: tensor dtype in the file (e.g. "bfloat16"); defaults to the parameter dtype.
    """
    weights = {path: np.asarray(leaf) for path, leaf in named_leaves(nnx.state(model, nnx.Param)).items()}
    write_safetensors(hf_tensors(weights, model.config, dtype), path)


def write_safetensors(tensors: Mapping[str, np.ndarray], path: str | pathlib.Path,
                      metadata: Mapping[str, str] | None = None) -> None:
    """``safetensors.numpy.save_file`` whose file gets the permissions of any other new file (0644 under umask 022).

    safetensors 0.8 writes through a temporary file, created 0600, and renames it into place
    (safetensors/safetensors#782), so an export would be readable by its owner only. The file is created first as an
    ordinary one (appending, so that tensors memory-mapped from an existing file stay intact), and its mode restored
    after the write; an existing file keeps its own.
    """
    with open(path, "ab") as file:
        mode = stat.S_IMODE(os.fstat(file.fileno()).st_mode)
    safetensors.numpy.save_file(dict(tensors), str(path), metadata=None if metadata is None else dict(metadata))
    os.chmod(path, mode)


def _model_type(config: ModelConfig, model_type: str | None) -> str:
    """The HF model_type that represents ``config`` (checked against the one asked for)."""
    if config.qkv_bias and config.qk_norm:
        raise ValueError("no Hugging Face architecture has both qkv_bias (Qwen2) and qk_norm (Qwen3)")
    inferred = "qwen3" if config.qk_norm else "qwen2" if config.qkv_bias else "llama"
    if model_type is None:
        return inferred
    compatible = {"qwen3": ("qwen3",), "qwen2": ("qwen2",), "llama": ("llama", "mistral")}[inferred]
    if model_type not in compatible:
        raise ValueError(f"model_type={model_type!r} cannot represent this ModelConfig (qkv_bias={config.qkv_bias}, "
                         f"qk_norm={config.qk_norm}); use {' or '.join(compatible)}")
    return model_type


def config_to_hf(config: ModelConfig, model_type: str | None = None) -> dict:
    """The Hugging Face ``config.json`` dict of a `ModelConfig` (inverse of `config_from_hf`, dtype aside).

    RoPE is written in both spellings, legacy (``rope_theta``, ``rope_scaling``: what mlx-lm and transformers 4 read)
    and transformers 5's ``rope_parameters``, with the same values.

    Args:
        config: the model.
        model_type: "llama", "mistral", "qwen2" or "qwen3"; None picks qwen3 (qk_norm), qwen2 (qkv_bias) or llama.

    Example:
        >>> from learner.model.transformer import model_config
        >>> tiny = model_config("tiny")
        >>> config_to_hf(tiny)["architectures"], config_from_hf(config_to_hf(tiny)) == tiny
        (['Qwen2ForCausalLM'], True)
    """
    model_type = _model_type(config, model_type)
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        rope = {"rope_type": "llama3", "rope_theta": config.rope_theta, "factor": config.rope_scaling.factor,
                "low_freq_factor": config.rope_scaling.low_freq_factor,
                "high_freq_factor": config.rope_scaling.high_freq_factor,
                "original_max_position_embeddings": config.rope_scaling.original_max_position_embeddings}
    hf = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "max_position_embeddings": config.max_seq_len,
        "rope_theta": config.rope_theta,
        "rope_scaling": None if config.rope_scaling is None else {k: v for k, v in rope.items() if k != "rope_theta"},
        "rope_parameters": rope,
    }
    if model_type in ("llama", "qwen3"):
        hf["attention_bias"] = False
    if model_type == "llama":
        hf["mlp_bias"] = False
    if model_type in ("qwen2", "qwen3"):
        hf["use_sliding_window"] = False
    hf["sliding_window"] = None
    return hf


# transformers 5.12.1's defaults for fields a config.json may leave out, per model_type.
_DEFAULTS = {
    "llama": {"num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 2048},
    "mistral": {"num_key_value_heads": 8, "head_dim": None, "max_position_embeddings": 4096 * 32,
                "sliding_window": 4096},
    "qwen2": {"num_key_value_heads": 32, "head_dim": None, "max_position_embeddings": 32768,
              "sliding_window": 4096, "max_window_layers": 28},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768,
              "sliding_window": 4096, "max_window_layers": 28},
}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_ROPE_TYPES = ("default", "llama3")


def _field(hf_config: Mapping, key: str, default=None):
    """``hf_config[key]``, or the model_type's transformers default when the key is absent."""
    return hf_config[key] if key in hf_config else _DEFAULTS[hf_config["model_type"]].get(key, default)


def _rope(hf_config: Mapping) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, Llama-3 scaling) from every spelling: ``rope_theta``, ``rope_scaling``, ``rope_parameters``."""
    legacy, current = hf_config.get("rope_scaling"), hf_config.get("rope_parameters")
    if current and all(isinstance(value, Mapping) for value in current.values()):
        raise ValueError(f"config.json rope_parameters with one RoPE per layer type ({sorted(current)}) is not "
                         "implemented: the model has one RoPE for all layers")
    if legacy and current and any(key in current and current[key] != value for key, value in legacy.items()):
        raise ValueError(f"config.json rope_scaling={legacy!r} contradicts rope_parameters={current!r}")
    rope = dict(current or {}) | dict(legacy or {})  # transformers 5 lets rope_scaling win
    top_theta = hf_config.get("rope_theta")
    if top_theta is not None and rope.get("rope_theta") is not None and top_theta != rope["rope_theta"]:
        raise ValueError(f"config.json rope_theta={top_theta} contradicts rope_parameters.rope_theta="
                         f"{rope['rope_theta']}")
    theta = float(rope.get("rope_theta") or top_theta or 10_000.0)
    partial = rope.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"config.json partial_rotary_factor={partial} is not implemented (RoPE on every dimension)")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"config.json RoPE type {rope_type!r} (rope_parameters / rope_scaling) is not implemented; "
                         f"implemented: {', '.join(_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        if key not in rope:
            raise ValueError(f"config.json llama3 RoPE scaling lacks {key!r}")
    original = hf_config.get("original_max_position_embeddings",  # transformers gives the top-level key priority
                             rope.get("original_max_position_embeddings", _field(hf_config, "max_position_embeddings")))
    return theta, Llama3RopeScaling(factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                                    high_freq_factor=float(rope["high_freq_factor"]),
                                    original_max_position_embeddings=int(original))


def _check_sliding_window(hf_config: Mapping, num_layers: int, max_seq_len: int) -> None:
    """Refuses a sliding window that could mask a key: some layer slides and the window is shorter than
    max_seq_len (a query attends to the ``sliding_window`` most recent keys, itself included)."""
    model_type = hf_config["model_type"]
    window = _field(hf_config, "sliding_window")
    if model_type in ("qwen2", "qwen3") and not hf_config.get("use_sliding_window", False):
        window = None
    layer_types = hf_config.get("layer_types")
    if layer_types is None:
        first = _field(hf_config, "max_window_layers", 0) if model_type in ("qwen2", "qwen3") else 0
        layer_types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                       for i in range(num_layers)]
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"config.json layer_types {unknown} are not implemented (full_attention only)")
    sliding = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    if sliding and window is not None and window < max_seq_len:
        raise ValueError(f"config.json sliding_window={window} (layers {sliding[0]}..{sliding[-1]}) is not "
                         f"implemented: with max_seq_len={max_seq_len} a query could lose keys beyond the window. "
                         f"Pass max_seq_len <= {window} to use the model within its window")


def config_from_hf(hf_config: Mapping, **overrides) -> ModelConfig:
    """Builds a ModelConfig from a Hugging Face ``config.json`` dict (model_type llama, mistral, qwen2, qwen3).

    Fields a config leaves out take transformers' defaults for its model_type. Anything the model does not
    implement is refused with a ValueError naming the field (see the module docstring).

    Args:
        hf_config: the parsed config.json.
        **overrides: ModelConfig fields to set (e.g. ``dtype="bfloat16"``, a shorter ``max_seq_len``).

    Example:
        >>> config_from_hf({"model_type": "qwen2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        ...                 "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}).qkv_bias
        True
        >>> config_from_hf({"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        ...                 "num_hidden_layers": 1, "num_attention_heads": 4,
        ...                 "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: config.json RoPE type 'yarn' (rope_parameters / rope_scaling) is not implemented; ...
    """
    model_type = hf_config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"config.json model_type={model_type!r} is not supported; supported: "
                         f"{', '.join(ARCHITECTURES)}")
    missing = [key for key in _REQUIRED if key not in hf_config]
    if missing:
        raise ValueError(f"config.json lacks {missing[0]!r}")
    if hf_config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act={hf_config['hidden_act']!r} is not implemented (silu only)")
    if hf_config.get("attention_bias") and model_type != "qwen2":  # qwen2 ignores the key
        raise ValueError(f"config.json attention_bias=true is not implemented for {model_type}: the model has no "
                         "o_proj bias (q/k/v biases only as Qwen2 has them)")
    for unsupported in ("mlp_bias", "quantization_config"):
        if hf_config.get(unsupported):
            raise ValueError(f"config.json {unsupported}={hf_config[unsupported]!r} is not implemented")
    rope_theta, rope_scaling = _rope(hf_config)
    num_heads = hf_config["num_attention_heads"]
    fields = dict(
        vocab_size=hf_config["vocab_size"],
        hidden_size=hf_config["hidden_size"],
        intermediate_size=hf_config["intermediate_size"],
        num_layers=hf_config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=_field(hf_config, "num_key_value_heads") or num_heads,
        head_dim=_field(hf_config, "head_dim") or hf_config["hidden_size"] // num_heads,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
        max_seq_len=_field(hf_config, "max_position_embeddings"),
    )
    config = ModelConfig(**(fields | overrides))
    _check_sliding_window(hf_config, config.num_layers, config.max_seq_len)
    return config
