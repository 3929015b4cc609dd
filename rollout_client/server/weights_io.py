"""Reads weights from a path on the server: safetensors files or orbax checkpoints.

Weights are a flat mapping from parameter path (joined by "/") to numpy array, the
same form the client streams.
"""

import pathlib

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
import numpy as np

from rollout_client.protocol import pb


def load_weights(path: str, weights_format: int) -> dict[str, np.ndarray]:
    """Loads the weights at `path`; raises ValueError naming the bad field."""
    if not path:
        raise ValueError("path: must not be empty")
    if not pathlib.Path(path).exists():
        raise ValueError(f"path: {path!r} does not exist on the server")
    if weights_format == pb.WEIGHTS_FORMAT_SAFETENSORS:
        return _load_safetensors(path)
    if weights_format == pb.WEIGHTS_FORMAT_ORBAX:
        return _load_orbax(path)
    raise ValueError(f"format: must be SAFETENSORS or ORBAX, got {pb.WeightsFormat.Name(weights_format)}")


def _load_safetensors(path: str) -> dict[str, np.ndarray]:
    import safetensors.numpy

    return dict(safetensors.numpy.load_file(path))


def _load_orbax(path: str) -> dict[str, np.ndarray]:
    """A checkpoint of a nested dict of arrays, or of a model's `nnx.state`.

    An `nnx.state` checkpoint stores each parameter under ``<path>/value``; the
    suffix is dropped, as `model_generator.parameter_names` drops it.
    """
    import orbax.checkpoint as ocp

    tree = ocp.PyTreeCheckpointer().restore(str(pathlib.Path(path).resolve()))
    return {name.removesuffix("/value"): array for name, array in flatten_tree(tree).items()}


def flatten_tree(tree) -> dict[str, np.ndarray]:
    """Nested mappings -> {"a/b": array}.

    >>> flatten_tree({"a": {"b": 1.0}, "c": 2})
    {'a/b': array(1.), 'c': array(2)}
    """
    flat = {}
    for key, value in tree.items():
        if hasattr(value, "items"):
            flat.update({f"{key}/{sub}": array for sub, array in flatten_tree(value).items()})
        else:
            flat[str(key)] = np.asarray(value)
    return flat
