"""Reads weights from a path on the server, in a format the engine has a reader for.

Weights are a flat mapping from parameter path (joined by "/") to numpy array, the
same form the client streams. Every engine reads safetensors files (`read_safetensors`);
an engine adds readers for its own formats (the learner's model generator: orbax).

A client names weights by a path inside the server's weights directory (``--weights-dir``; without one, the server
takes no weights from paths). Only regular files and directories of them are read, never FIFOs, devices or links
out of the directory, so a caller can neither block the server on a read nor probe the rest of the file system; and
errors name the path only relative to that directory.
"""

import json
import math
import mmap
import os
import pathlib
import stat
from collections.abc import Callable, Mapping

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
import numpy as np

from rollout_client.protocol import pb
from rollout_client.shared_weights import SAFETENSORS_DTYPES

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
    """The tensors of one ``.safetensors`` file, by name: read-only views of the file mapped in memory (no copy).

    A learner on the same host rewrites its shared-memory file in place (`rollout_client.shared_weights`) once the
    engine has loaded it: an engine copies what it keeps (`Generator.load_weights`).

    Raises:
      ValueError: the header is malformed, names an unknown dtype, or a tensor's bytes lie outside the file or do
        not match its shape.
    """
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size < 8:
            raise ValueError("header: shorter than its 8-byte length")
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # one fault for the whole file where supported
        mapped = mmap.mmap(handle.fileno(), size, flags=flags, prot=mmap.PROT_READ)
    header_size = int.from_bytes(mapped[:8], "little")
    if header_size > size - 8:
        raise ValueError(f"header: {header_size} bytes announced, the file has {size}")
    try:
        header = json.loads(mapped[8:8 + header_size])
    except ValueError as error:
        raise ValueError(f"header: not JSON ({error})") from None
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = np.dtype(_SAFETENSORS_NUMPY[entry["dtype"]])
            shape = tuple(int(n) for n in entry["shape"])
            begin, end = (int(n) for n in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"header[{name!r}]: needs a known dtype, a shape and data_offsets") from None
        if not 0 <= begin <= end <= size - 8 - header_size or end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"header[{name!r}]: data_offsets {[begin, end]} do not fit its shape {list(shape)} "
                             "inside the file")
        tensors[name] = np.ndarray(shape, dtype.newbyteorder("<"), mapped, 8 + header_size + begin)
    return tensors


_SAFETENSORS_NUMPY = {code: name for name, code in SAFETENSORS_DTYPES.items()}
