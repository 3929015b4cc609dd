"""Reads weights from a path on the server, in a format the engine has a reader for.

Weights are a flat mapping from parameter path (joined by "/") to numpy array, the
same form the client streams. Every engine reads safetensors files (`read_safetensors`);
an engine adds readers for its own formats (the learner's model engine: orbax).

A client names weights by a path inside the server's weights directory (``--weights-dir``; without one, the server
takes no weights from paths). Only regular files and directories of them are read, never FIFOs, devices or links
out of the directory, so a caller can neither block the server on a read nor probe the rest of the file system; and
errors name the path only relative to that directory.
"""

import os
import pathlib
import stat
from collections.abc import Callable, Mapping

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
import numpy as np

from rollout_client.protocol import pb

# pb.WeightsFormat -> a function reading the weights at a path as {parameter path: array}.
WeightReaders = Mapping[int, Callable[[str], dict[str, np.ndarray]]]


class PathsDisabledError(Exception):
    """The server has no weights directory, so it takes no weights from paths."""


def load_weights(path: str, weights_format: int, readers: WeightReaders,
                 weights_dir: pathlib.Path | None) -> dict[str, np.ndarray]:
    """Loads the weights at `path` inside `weights_dir` with the reader of `weights_format`.

    Raises:
      PathsDisabledError: `weights_dir` is None.
      ValueError: naming the bad field; the path only relative to `weights_dir`.

    >>> load_weights(__file__, pb.WEIGHTS_FORMAT_ORBAX, {pb.WEIGHTS_FORMAT_SAFETENSORS: read_safetensors}, None)
    Traceback (most recent call last):
    ...
    ValueError: format: this engine reads WEIGHTS_FORMAT_SAFETENSORS, got WEIGHTS_FORMAT_ORBAX
    """
    if not path:
        raise ValueError("path: must not be empty")
    if weights_format not in readers:
        accepted = " or ".join(pb.WeightsFormat.Name(known) for known in readers)
        raise ValueError(f"format: this engine reads {accepted}, got {pb.WeightsFormat.Name(weights_format)}")
    target, shown = weights_path(path, weights_dir)
    try:
        return readers[weights_format](str(target))
    except Exception as error:  # Readers' messages carry absolute paths; only the kind of failure is passed on.
        raise ValueError(f"path: {shown!r} could not be read as {pb.WeightsFormat.Name(weights_format)} "
                         f"({type(error).__name__})") from None


def weights_path(path: str, weights_dir: pathlib.Path | None) -> tuple[pathlib.Path, str]:
    """The resolved file or directory that `path` names inside `weights_dir`, and its name relative to it.

    Raises:
      PathsDisabledError: `weights_dir` is None.
      ValueError: `path` is outside `weights_dir` (also through a link), missing, or not a regular file or a
        directory of regular files and directories.
    """
    if weights_dir is None:
        raise PathsDisabledError("path: this server takes no weights from paths (it was started without "
                                 "--weights-dir); stream them instead")
    root = weights_dir.resolve()
    target = (root / path).resolve()
    if not target.is_relative_to(root):
        raise ValueError("path: must name a file inside the server's weights directory")
    shown = str(target.relative_to(root))
    if not target.exists():
        raise ValueError(f"path: {shown!r} does not exist in the server's weights directory")
    mode = target.stat().st_mode
    if stat.S_ISDIR(mode):
        for folder, names, files in os.walk(target):
            for name in names + files:
                entry_mode = os.lstat(os.path.join(folder, name)).st_mode
                if not (stat.S_ISREG(entry_mode) or stat.S_ISDIR(entry_mode)):
                    raise ValueError(f"path: {shown!r} holds something that is not a regular file or a directory")
    elif not stat.S_ISREG(mode):
        raise ValueError(f"path: {shown!r} is not a regular file or a directory")
    return target, shown


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """The tensors of one ``.safetensors`` file, by name."""
    import safetensors.numpy

    return dict(safetensors.numpy.load_file(path))
