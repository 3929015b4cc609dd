"""LoRA adapters as a PEFT adapter directory: ``adapter_config.json`` + ``adapter_model.safetensors``.

The layout is PEFT's for a LoRA adapter on a transformers causal LM (``PeftModel.save_pretrained``; tensor names as
``peft.utils.save_and_load.get_peft_model_state_dict`` returns them, the adapter name removed; read at
huggingface/peft commit 000b5847eb29dc424dbbf7d9e071b21b83889563):

* ``base_model.model.<module>.lora_A.weight``: ``[r, in_features]`` (``nn.Linear(in_features, r).weight``);
* ``base_model.model.<module>.lora_B.weight``: ``[out_features, r]``;

``<module>`` the transformers module name of the projection (``model.layers.0.self_attn.q_proj``), and PEFT computes
``x W^T + (lora_alpha / r) * x A^T B^T``: with ``A^T`` our ``a`` flattened to ``[in, r]`` and ``B^T`` our ``b``
flattened to ``[r, out]``, the head axes flattened in the order `learner.checkpoints.safetensors_io` flattens the
kernels.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping

import numpy as np

from learner.checkpoints.safetensors_io import hf_name_map, write_safetensors
from learner.model.lora import LoraConfig, adapter_parts
from learner.model.transformer import ModelConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_tensors(adapters: Mapping[str, np.ndarray], config: ModelConfig) -> dict[str, np.ndarray]:
    """``{path: array}`` of the adapters (``.../lora/a``, ``.../lora/b``) -> PEFT's ``{name: tensor}`` (float32).

    Example:
        >>> from learner.model.transformer import model_config
        >>> tensors = peft_tensors({"layers/0/attn/o_proj/lora/a": np.zeros((4, 16, 2)),
        ...                         "layers/0/attn/o_proj/lora/b": np.zeros((2, 64))}, model_config("tiny"))
        >>> {name: value.shape for name, value in tensors.items()}  # doctest: +NORMALIZE_WHITESPACE
        {'base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight': (2, 64),
         'base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight': (64, 2)}
    """
    module_of = {path.removesuffix("/kernel"): name.removesuffix(".weight")
                 for name, path in hf_name_map(config).items() if path.endswith("/kernel")}
    tensors = {}
    for path, array in adapters.items():
        parts = adapter_parts(path)
        if parts is None:
            raise ValueError(f"{path!r} is not a LoRA adapter path (.../lora/a or .../lora/b)")
        prefix, which = parts
        array = np.asarray(array, np.float32)
        if which == "a":  # [in..., r] -> [r, in]
            name, tensor = "lora_A", array.reshape(-1, array.shape[-1]).T
        else:  # [r, out...] -> [out, r]
            name, tensor = "lora_B", array.reshape(array.shape[0], -1).T
        tensors[f"base_model.model.{module_of[prefix]}.{name}.weight"] = np.ascontiguousarray(tensor)
    return dict(sorted(tensors.items()))


def peft_adapter_config(adapters: Mapping[str, np.ndarray], lora: LoraConfig, config: ModelConfig,
                        base_model_name_or_path: str | None) -> dict:
    """PEFT's ``LoraConfig`` of these adapters as ``adapter_config.json`` data.

    ``base_model_name_or_path``: a Hub name, written as it is, or a local directory, written as its absolute path
    (transformers takes an existing directory for a local checkpoint), so the adapter loads from any working
    directory.

    ``target_modules`` are the projections' short names (``"q_proj"``) when every layer has the same ones, else the
    full module names (PEFT matches a list entry against a module name or its dotted suffix).
    """
    modules = sorted({name.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
                      for name in peft_tensors(adapters, config)})
    short = sorted({module.rsplit(".", 1)[1] for module in modules})
    uniform = len(modules) == len(short) * config.num_layers
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": (str(pathlib.Path(base_model_name_or_path).resolve())
                                    if base_model_name_or_path and pathlib.Path(base_model_name_or_path).is_dir()
                                    else base_model_name_or_path),
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0,
        "target_modules": short if uniform else modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def write_peft_adapter(directory: str | pathlib.Path, adapters: Mapping[str, np.ndarray], lora: LoraConfig,
                       config: ModelConfig, base_model_name_or_path: str | None = None,
                       overwrite: bool = False) -> pathlib.Path:
    """Writes the PEFT adapter directory (see the module docstring); returns it."""
    directory = pathlib.Path(directory)
    if directory.exists() and any(directory.iterdir()) and not overwrite:
        raise FileExistsError(f"{directory} exists and is not empty; pass overwrite=True (--overwrite) to replace it")
    directory.mkdir(parents=True, exist_ok=True)
    write_safetensors(peft_tensors(adapters, config), directory / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    (directory / ADAPTER_CONFIG).write_text(
        json.dumps(peft_adapter_config(adapters, lora, config, base_model_name_or_path), indent=2) + "\n")
    return directory
