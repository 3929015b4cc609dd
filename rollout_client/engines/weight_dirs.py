"""Versioned checkpoint directories for engines that load weights from disk (MLX by restart, SGLang, vLLM).

Each published policy version is a Hugging Face checkpoint directory ``weights_dir/v<version, 12 digits>`` (names
sort by version), written atomically by the learner's `CheckpointWriter`, so an engine never reads a half-written
one. Old versions are deleted once a newer one is served.
"""

from __future__ import annotations

import pathlib
import re
import shutil
from collections.abc import Callable, Mapping

import numpy as np

# (directory, weights): writes a Hugging Face checkpoint directory (config.json, safetensors, tokenizer files) at
# `directory` atomically, replacing one there (e.g. `learner.checkpoints.hf_checkpoint.write_hf_checkpoint` with
# overwrite).
CheckpointWriter = Callable[[pathlib.Path, Mapping[str, np.ndarray]], object]

_VERSION_DIR = re.compile(r"^v\d{12}$")


def version_dir(weights_dir: pathlib.Path, policy_version: int) -> pathlib.Path:
    """Where ``policy_version``'s checkpoint goes.

    >>> version_dir(pathlib.Path("w"), 42).as_posix()
    'w/v000000000042'
    """
    return weights_dir / f"v{policy_version:012d}"


def collect_garbage(weights_dir: pathlib.Path, served: pathlib.Path, keep: int) -> None:
    """Deletes version directories older than ``served`` but the ``keep - 1`` newest of them; never ``served`` or a
    newer one (``keep`` counts the served one)."""
    older = sorted(path for path in weights_dir.iterdir()
                   if _VERSION_DIR.match(path.name) and path.is_dir() and path.name < served.name)
    for path in older[:max(len(older) - (keep - 1), 0)]:
        shutil.rmtree(path, ignore_errors=True)
