"""Hugging Face checkpoint directories: the model config they describe, and writing one atomically.

A checkpoint directory holds ``config.json``, ``*.safetensors``, ``generation_config.json`` and the tokenizer's
files: what transformers, vLLM, SGLang and mlx-lm load. `model_config_from_checkpoint` builds the learner's
`ModelConfig` from one (the learner and the embedded server both start from it); `write_hf_checkpoint` writes one
from parameters named by `learner.model.param_paths` (``Trainer.host_weights()``, an orbax checkpoint's arrays) or from
a
live `Transformer`, for export and for engines that load weights from disk.

Writes are atomic: everything goes into a temporary sibling directory, every file and the directory are fsynced, and
the directory is renamed onto the target, so a reader never sees a half-written checkpoint (with ``overwrite=True``
the old directory is first renamed aside, then deleted: between the two renames the target is briefly absent).

Example::

    config = model_config_from_checkpoint("/models/Qwen2.5-0.5B-Instruct", param_dtype="bfloat16")
    write_hf_checkpoint("exports/step_100", trainer.host_weights(), config, tokenizer="/models/Qwen2.5-0.5B-Instruct",
                        eos_token_ids=(151645, 151643), dtype="bfloat16")
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import uuid
from collections.abc import Mapping, Sequence

import numpy as np
from flax import nnx

from learner.checkpoints.safetensors_io import config_from_hf, config_to_hf, hf_tensors, write_safetensors
from learner.model.param_paths import named_leaves
from learner.model.transformer import ModelConfig, Transformer

__all__ = [
    "TOKENIZER_FILES",
    "model_config_from_checkpoint",
    "write_hf_checkpoint",
]

# Files of a Hugging Face tokenizer, copied when the tokenizer is given as a directory (whichever exist).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json")
_DTYPES = ("float32", "bfloat16", "float16")


def model_config_from_checkpoint(path: str | os.PathLike, **overrides) -> ModelConfig:
    """The `ModelConfig` of the Hugging Face checkpoint directory ``path`` (its ``config.json``).

    Args:
        path: a directory with ``config.json``.
        **overrides: ModelConfig fields to set (``param_dtype``, ``dtype``, a shorter ``max_seq_len``, ...).

    Raises:
        FileNotFoundError: no ``config.json`` in ``path``.
        ValueError: the config describes something the model does not implement (naming the field).
    """
    config_file = pathlib.Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in {path}: expected a Hugging Face checkpoint directory")
    try:
        return config_from_hf(json.loads(config_file.read_text()), **overrides)
    except ValueError as error:
        raise ValueError(f"{config_file}: {error}") from None


def _write_file(path: pathlib.Path, data: bytes) -> None:
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def _fsync_directory(path: pathlib.Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _token_ids(ids: Sequence[int]) -> int | list[int] | None:
    """config.json's spelling of stop ids: one int, a list, or None."""
    ids = [int(i) for i in ids]
    return None if not ids else ids[0] if len(ids) == 1 else ids


def _write_tokenizer(tokenizer, directory: pathlib.Path) -> dict | None:
    """Writes the tokenizer's files into ``directory``; returns the source's generation_config.json, if any."""
    if tokenizer is None:
        return None
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(str(directory))
        return None
    source = pathlib.Path(tokenizer)
    files = [source / name for name in TOKENIZER_FILES if (source / name).is_file()]
    if not files:
        raise FileNotFoundError(f"tokenizer={str(source)!r}: none of {', '.join(TOKENIZER_FILES)} there")
    for file in files:
        _write_file(directory / file.name, file.read_bytes())
    generation = source / "generation_config.json"
    return json.loads(generation.read_text()) if generation.is_file() else None


def write_hf_checkpoint(directory: str | os.PathLike, weights: Mapping[str, np.ndarray] | Transformer,
                        config: ModelConfig, *, tokenizer=None, eos_token_ids: Sequence[int] = (),
                        bos_token_id: int | None = None, dtype: str = "float32", model_type: str | None = None,
                        overwrite: bool = False) -> pathlib.Path:
    """Writes a Hugging Face checkpoint directory atomically (see the module docstring); returns its path.

    Args:
        directory: the checkpoint directory to create; its parent is created if missing.
        weights: ``{parameter path: array}`` (`learner.model.param_paths` naming, e.g. ``Trainer.host_weights()``) or a
            `Transformer` whose parameters are written.
        config: the model's config (written as config.json, `learner.checkpoints.safetensors_io.config_to_hf`).
        tokenizer: None; an object with ``save_pretrained(directory)`` (a transformers tokenizer); or a directory
            whose tokenizer files (`TOKENIZER_FILES`, whichever exist) are copied, with its
            ``generation_config.json`` as the base of ours.
        eos_token_ids: stop token ids, written to config.json and generation_config.json ``eos_token_id``.
        bos_token_id: written likewise when given.
        dtype: tensor dtype: "float32", "bfloat16" or "float16" (config.json ``torch_dtype`` and ``dtype``).
        model_type: "llama", "mistral", "qwen2" or "qwen3"; None: the one `config_to_hf` infers.
        overwrite: replace an existing ``directory``; False refuses it.

    Raises:
        FileExistsError: ``directory`` exists and ``overwrite`` is False.
        KeyError / ValueError: the weights do not match ``config`` (naming the parameter), or a bad argument.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: must be one of {', '.join(_DTYPES)}")
    directory = pathlib.Path(directory)
    if directory.exists() and not overwrite:
        raise FileExistsError(f"{directory} exists; pass overwrite=True to replace it")
    if isinstance(weights, Transformer):
        weights = {path: np.asarray(leaf) for path, leaf in named_leaves(nnx.state(weights, nnx.Param)).items()}
    tensors = hf_tensors(weights, config, dtype)  # before any file is written: bad weights leave nothing behind
    hf_config = config_to_hf(config, model_type) | {"torch_dtype": dtype, "dtype": dtype,
                                                    "bos_token_id": bos_token_id,
                                                    "eos_token_id": _token_ids(eos_token_ids)}
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = directory.parent / f".{directory.name}.tmp-{uuid.uuid4().hex}"
    staging.mkdir()
    try:
        write_safetensors(tensors, staging / "model.safetensors", metadata={"format": "pt"})
        _write_file(staging / "config.json", json.dumps(hf_config, indent=2).encode())
        generation = _write_tokenizer(tokenizer, staging) or {}
        generation |= {key: value for key, value in (("bos_token_id", bos_token_id),
                                                     ("eos_token_id", _token_ids(eos_token_ids))) if value is not None}
        _write_file(staging / "generation_config.json", json.dumps(generation, indent=2).encode())
        for file in staging.iterdir():  # the tensors' and a tokenizer's save_pretrained's files
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
        _fsync_directory(staging)
        old = None
        if directory.exists():
            old = directory.parent / f".{directory.name}.old-{uuid.uuid4().hex}"
            directory.rename(old)
        staging.rename(directory)
        _fsync_directory(directory.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return directory
