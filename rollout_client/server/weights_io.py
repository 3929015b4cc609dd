"""Reads weights from a path on the server, in a format the engine has a reader for.

Weights are a flat mapping from parameter path (joined by "/") to numpy array, the
same form the client streams. Every engine reads safetensors files (`read_safetensors`);
an engine adds readers for its own formats (the learner's model engine: orbax).
"""

import pathlib
from collections.abc import Callable
from collections.abc import Mapping

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
import numpy as np

from rollout_client.protocol import pb

# pb.WeightsFormat -> a function reading the weights at a path as {parameter path: array}.
WeightReaders = Mapping[int, Callable[[str], dict[str, np.ndarray]]]


def load_weights(path: str, weights_format: int, readers: WeightReaders) -> dict[str, np.ndarray]:
    """Loads the weights at `path` with the reader of `weights_format`; raises ValueError naming the bad field.

    >>> load_weights(__file__, pb.WEIGHTS_FORMAT_ORBAX, {pb.WEIGHTS_FORMAT_SAFETENSORS: read_safetensors})
    Traceback (most recent call last):
    ...
    ValueError: format: this engine reads WEIGHTS_FORMAT_SAFETENSORS, got WEIGHTS_FORMAT_ORBAX
    """
    if not path:
        raise ValueError("path: must not be empty")
    if not pathlib.Path(path).exists():
        raise ValueError(f"path: {path!r} does not exist on the server")
    if weights_format not in readers:
        accepted = " or ".join(pb.WeightsFormat.Name(known) for known in readers)
        raise ValueError(f"format: this engine reads {accepted}, got {pb.WeightsFormat.Name(weights_format)}")
    return readers[weights_format](path)


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """The tensors of one ``.safetensors`` file, by name."""
    import safetensors.numpy

    return dict(safetensors.numpy.load_file(path))
