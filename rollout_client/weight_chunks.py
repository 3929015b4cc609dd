"""Streaming weights as WeightsChunk messages, and assembling them back.

Shared by the client (which splits) and the server (which assembles), so the two
ends agree on the byte layout: C order, little-endian, dtype named by numpy. Each
byte is copied once on each side: into its chunk message (slices of the array's own
memory, never a whole-tensor copy first) and out of it into the tensor preallocated
at its first chunk (`WeightsAssembler`, fed as the chunks arrive).
"""

from collections.abc import Iterable, Iterator, Mapping

import ml_dtypes  # noqa: F401  (registers bfloat16 and friends with numpy)
import numpy as np

from rollout_client.protocol import pb

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024


def split_weights(weights: Mapping[str, np.ndarray], policy_version: int,
                  chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[pb.WeightsChunk]:
    """Yields a header, then every tensor in pieces of at most `chunk_bytes`."""
    yield pb.WeightsChunk(header=pb.WeightsHeader(policy_version=policy_version, num_tensors=len(weights)))
    for name, array in weights.items():
        array = np.asarray(array)
        data = np.ascontiguousarray(array, array.dtype.newbyteorder("<")).reshape(-1).view(np.uint8)
        for offset in range(0, max(data.size, 1), chunk_bytes):
            yield pb.WeightsChunk(tensor=pb.TensorChunk(
                name=name, dtype=array.dtype.name, shape=array.shape, offset=offset,
                data=data[offset:offset + chunk_bytes].tobytes()))


class WeightsAssembler:
    """Inverse of `split_weights`, one chunk at a time: `add` each chunk as it arrives, then `result`.

    Raises (from `add` and `result`):
      ValueError: naming the field of the first malformed chunk.
    """

    def __init__(self):
        self._header: pb.WeightsHeader | None = None
        self._tensors: dict[str, np.ndarray] = {}  # preallocated at the first chunk
        self._filled: dict[str, int] = {}  # bytes received per tensor

    def add(self, chunk: pb.WeightsChunk) -> None:
        if self._header is None:
            if not chunk.HasField("header"):
                raise ValueError("header: the first WeightsChunk must be a header")
            self._header = chunk.header
            return
        if not chunk.HasField("tensor"):
            raise ValueError("header: only the first WeightsChunk may be a header")
        piece = chunk.tensor
        try:
            dtype = np.dtype(piece.dtype)
        except TypeError:
            raise ValueError(f"tensor.dtype: unknown dtype {piece.dtype!r} for {piece.name!r}") from None
        tensor = self._tensors.get(piece.name)
        if tensor is None:
            tensor = self._tensors[piece.name] = np.empty(tuple(piece.shape), dtype.newbyteorder("<"))
            self._filled[piece.name] = 0
        elif (tensor.dtype, tensor.shape) != (dtype.newbyteorder("<"), tuple(piece.shape)):
            raise ValueError(f"tensor.shape: {piece.name!r} changed dtype or shape between chunks")
        filled = self._filled[piece.name]
        if piece.offset != filled:
            raise ValueError(f"tensor.offset: {piece.name!r} expected {filled}, got {piece.offset}")
        if filled + len(piece.data) > tensor.nbytes:
            raise ValueError(f"tensor.data: {piece.name!r} has more than the {tensor.nbytes} bytes its shape and "
                             "dtype need")
        tensor.reshape(-1).view(np.uint8)[filled:filled + len(piece.data)] = np.frombuffer(piece.data, np.uint8)
        self._filled[piece.name] = filled + len(piece.data)

    def result(self) -> tuple[int, dict[str, np.ndarray]]:
        """``(policy_version, weights)`` once every chunk was added."""
        if self._header is None:
            raise ValueError("header: the first WeightsChunk must be a header")
        if len(self._tensors) != self._header.num_tensors:
            raise ValueError(f"header.num_tensors: {self._header.num_tensors} announced, {len(self._tensors)} sent")
        for name, tensor in self._tensors.items():
            if self._filled[name] != tensor.nbytes:
                raise ValueError(f"tensor.data: {name!r} has {self._filled[name]} bytes, shape and dtype need "
                                 f"{tensor.nbytes}")
        weights = {name: tensor.astype(tensor.dtype.newbyteorder("="), copy=False)
                   for name, tensor in self._tensors.items()}
        return self._header.policy_version, weights


def assemble_weights(chunks: Iterable[pb.WeightsChunk]) -> tuple[int, dict[str, np.ndarray]]:
    """Inverse of `split_weights`: returns (policy_version, weights).

    Raises:
      ValueError: naming the field of the first malformed chunk.

    >>> version, weights = assemble_weights(split_weights({"w": np.arange(6.0).reshape(2, 3)}, 7, 16))
    >>> version, weights["w"].tolist()
    (7, [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])
    """
    assembler = WeightsAssembler()
    for chunk in chunks:
        assembler.add(chunk)
    return assembler.result()
