"""Per-token arrays <-> the packed bytes fields of rollout.v1 messages.

Server and client both use these, so the layout is defined once: token ids are
little-endian int32, logprobs little-endian float32, 4 bytes per token each (see
rollout.proto). Packing is one copy; `np.frombuffer(data, dtype)` reads them back
without copying.
"""

import numpy as np

TOKEN_ID_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")
BYTES_PER_TOKEN = 4


def pack(array: np.ndarray, dtype: np.dtype) -> bytes:
    """`array` as the little-endian bytes of `dtype` (TOKEN_ID_DTYPE or LOGPROB_DTYPE).

    >>> np.frombuffer(pack(np.array([1, -2]), TOKEN_ID_DTYPE), TOKEN_ID_DTYPE).tolist()
    [1, -2]
    """
    return np.asarray(array).astype(dtype, copy=False).tobytes()
