"""Weights handed to an engine on the same host through one file in shared memory, in the safetensors layout.

Streaming weights over gRPC copies every byte several times (serialised, chunked, sent, assembled). An engine this
process launched on the same host reads them from memory instead: `SharedWeightsFile` writes them into one file in
a private directory of shared memory (``/dev/shm`` where there is one, else the temporary directory), which the
engine serves as its ``--weights-dir``; the publish is then ``UpdateWeights(path, SAFETENSORS)``, and the engine's
reader (`rollout_client.server.weights_io.read_safetensors`) maps the file, so the only copies are this write and
the engine's own (to its device). The file stays mapped and is rewritten in place at each publish: a fresh file's
pages are allocated and zeroed first, which costs ~8x a memcpy.

The layout is safetensors' (an 8-byte little-endian header length, a JSON header, the tensors back to back), so any
safetensors reader can read it. A publish holds the engine paused until it has loaded the weights, and the next
write starts only after that, so the engine never reads a half-written file.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import mmap
import os
import pathlib
import shutil
import tempfile
from collections.abc import Mapping

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
import numpy as np

# numpy dtype name <-> safetensors dtype code.
SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "bfloat16": "BF16", "float16": "F16", "int64": "I64",
                      "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
FILE_NAME = "weights.safetensors"
_PIECE_BYTES = 16 << 20  # one memcpy per piece; the pieces of a write are copied in parallel (numpy drops the GIL)


@functools.cache
def _copier() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="shared-weights")


def shared_memory_dir(prefix: str = "tether-weights-") -> pathlib.Path:
    """A new private (0700) directory in shared memory: ``/dev/shm`` where it exists, else the temporary directory
    (the page cache serves it there)."""
    shm = pathlib.Path("/dev/shm")
    return pathlib.Path(tempfile.mkdtemp(prefix=prefix, dir=shm if shm.is_dir() else None))


def safetensors_header(layout: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> tuple[bytes, dict[str, int]]:
    """The file's first bytes (length and JSON header, padded to a multiple of 8) and each tensor's byte offset
    in the file, for tensors ``{name: (shape, dtype)}`` stored in this order.

    >>> head, offsets = safetensors_header({"w": ((2,), np.dtype("float32"))})
    >>> len(head) % 8, offsets["w"] == len(head)
    (0, True)
    """
    header, offsets, position = {}, {}, 0
    for name, (shape, dtype) in layout.items():
        dtype = np.dtype(dtype)
        if dtype.name not in SAFETENSORS_DTYPES:
            raise ValueError(f"weights[{name!r}]: dtype {dtype.name} has no safetensors code")
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype.name], "shape": list(shape),
                        "data_offsets": [position, position + size]}
        offsets[name] = position
        position += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    head = len(text).to_bytes(8, "little") + text
    return head, {name: len(head) + offset for name, offset in offsets.items()}


class SharedWeightsFile:
    """One safetensors file in ``directory``, mapped once and rewritten in place by `write`.

    Args:
      directory: where the file lives (`shared_memory_dir`); removed by `close` when ``owns_directory``.
      owns_directory: `close` removes ``directory`` with the file.
    """

    def __init__(self, directory: pathlib.Path, owns_directory: bool = True):
        self.directory = pathlib.Path(directory)
        self.path = self.directory / FILE_NAME
        self._owns_directory = owns_directory
        self._map: mmap.mmap | None = None
        self._layout: dict | None = None
        self._offsets: dict[str, int] = {}

    def write(self, weights: Mapping[str, np.ndarray]) -> str:
        """Writes ``weights`` (C-order, little-endian) into the file; returns its name inside ``directory``."""
        arrays = {name: np.asarray(array) for name, array in weights.items()}
        layout = {name: (array.shape, array.dtype) for name, array in arrays.items()}
        if layout != self._layout:
            self._allocate(layout)
        pieces = []  # (target, source) byte ranges of at most _PIECE_BYTES, copied by several threads
        for name, array in arrays.items():
            source = np.ascontiguousarray(array, array.dtype.newbyteorder("<")).reshape(-1).view(np.uint8)
            target = np.ndarray(source.shape, np.uint8, self._map, self._offsets[name])
            pieces += [(target[start:start + _PIECE_BYTES], source[start:start + _PIECE_BYTES])
                       for start in range(0, source.size, _PIECE_BYTES)]
        list(_copier().map(lambda piece: np.copyto(*piece), pieces))
        del pieces  # no view of the map may outlive the write: `close` unmaps it
        return FILE_NAME

    def _allocate(self, layout: dict) -> None:
        """(Re)creates the file for tensors of ``layout`` and maps it."""
        self._unmap()
        head, self._offsets = safetensors_header(layout)
        size = len(head) + sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
                               for shape, dtype in layout.values())
        descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(descriptor, size)
            self._map = mmap.mmap(descriptor, size)
        finally:
            os.close(descriptor)
        self._map[:len(head)] = head
        self._layout = layout

    def _unmap(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
            self._layout = None

    def close(self) -> None:
        """Unmaps the file and deletes it (with ``directory`` when owned)."""
        self._unmap()
        if self._owns_directory:
            shutil.rmtree(self.directory, ignore_errors=True)
        else:
            self.path.unlink(missing_ok=True)
