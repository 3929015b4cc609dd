"""Streaming weights as WeightsChunk messages, and assembling them back.

Shared by the client (which splits) and the server (which assembles), so the two
ends agree on the byte layout: C order, little-endian, dtype named by numpy.
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
        data = array.astype(array.dtype.newbyteorder("<"), order="C", copy=False).tobytes()
        for offset in range(0, max(len(data), 1), chunk_bytes):
            yield pb.WeightsChunk(tensor=pb.TensorChunk(
                name=name, dtype=array.dtype.name, shape=array.shape, offset=offset,
                data=data[offset:offset + chunk_bytes]))


def assemble_weights(chunks: Iterable[pb.WeightsChunk]) -> tuple[int, dict[str, np.ndarray]]:
    """Inverse of `split_weights`: returns (policy_version, weights).

    Raises:
      ValueError: naming the field of the first malformed chunk.

    >>> version, weights = assemble_weights(split_weights({"w": np.arange(6.0).reshape(2, 3)}, 7, 16))
    >>> version, weights["w"].tolist()
    (7, [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])
    """
    iterator = iter(chunks)
    first = next(iterator, None)
    if first is None or not first.HasField("header"):
        raise ValueError("header: the first WeightsChunk must be a header")
    buffers: dict[str, bytearray] = {}
    layouts: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}
    for chunk in iterator:
        if not chunk.HasField("tensor"):
            raise ValueError("header: only the first WeightsChunk may be a header")
        piece = chunk.tensor
        try:
            layout = (np.dtype(piece.dtype), tuple(piece.shape))
        except TypeError:
            raise ValueError(f"tensor.dtype: unknown dtype {piece.dtype!r} for {piece.name!r}") from None
        buffer = buffers.setdefault(piece.name, bytearray())
        if layouts.setdefault(piece.name, layout) != layout:
            raise ValueError(f"tensor.shape: {piece.name!r} changed dtype or shape between chunks")
        if piece.offset != len(buffer):
            raise ValueError(f"tensor.offset: {piece.name!r} expected {len(buffer)}, got {piece.offset}")
        buffer += piece.data
    if len(buffers) != first.header.num_tensors:
        raise ValueError(f"header.num_tensors: {first.header.num_tensors} announced, {len(buffers)} sent")
    weights = {}
    for name, buffer in buffers.items():
        dtype, shape = layouts[name]
        expected = int(np.prod(shape)) * dtype.itemsize
        if len(buffer) != expected:
            raise ValueError(f"tensor.data: {name!r} has {len(buffer)} bytes, shape and dtype need {expected}")
        weights[name] = np.frombuffer(buffer, dtype.newbyteorder("<")).astype(dtype).reshape(shape)
    return first.header.policy_version, weights
