"""Reads an orbax checkpoint of weights into the server's flat ``{parameter path: array}`` form.

The model generator's reader for ``UpdateWeights(path, format=ORBAX)`` and ``--weights DIR``: orbax and the nnx naming
of parameters are learner knowledge, so this reader lives here rather than in the server shell.
"""

import pathlib

import jax
import numpy as np
import orbax.checkpoint as ocp

from learner.model.param_paths import parameter_path


def read_orbax(path: str) -> dict[str, np.ndarray]:
    """The arrays of a checkpoint of a nested dict of arrays or of a model's `nnx.state`, by parameter path."""
    tree = ocp.PyTreeCheckpointer().restore(str(pathlib.Path(path).resolve()))
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {parameter_path(key_path): np.asarray(array) for key_path, array in leaves}
