"""Parameter paths: the one spelling of a parameter's name, ``"layers/0/attn/q_proj/kernel"``.

Sharding rules match these paths, the server names the weights it receives by them, and checkpoints read from disk are
renamed to them. A path is the dict keys and sequence indices that lead to the leaf, joined by "/". The nnx variable's
own ``value`` is not part of it: an attribute of an `nnx.Variable` in a live `nnx.State`, it becomes a dict key when
the state round-trips through an orbax checkpoint, and either way the path ends at the parameter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

_VARIABLE_VALUE = jax.tree_util.DictKey("value")


def parameter_path(key_path) -> str:
    """The "/"-joined path of one leaf, from its key path (`jax.tree_util.tree_flatten_with_path`).

    Attribute keys (an `nnx.Variable`'s ``.value``, a NamedTuple's fields) are not part of it, nor is a final
    ``"value"`` dict key (an `nnx.State` restored from orbax without a target).

    Example:
        >>> [parameter_path(p) for p, _ in jax.tree_util.tree_flatten_with_path({"mlp": {"up": [1, 2]}})[0]]
        ['mlp/up/0', 'mlp/up/1']
        >>> parameter_path(jax.tree_util.tree_flatten_with_path({"embed": {"value": 1}})[0][0][0])
        'embed'
    """
    if key_path and key_path[-1] == _VARIABLE_VALUE:
        key_path = key_path[:-1]
    parts = []
    for key in key_path:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
    return "/".join(parts)


def parameter_names(state) -> tuple[list[str], jax.tree_util.PyTreeDef]:
    """The parameter path of every leaf of ``state``, in leaf order, and the tree structure.

    With `jax.tree.leaves(state)` this maps names to arrays, and `jax.tree_util.tree_unflatten(treedef, arrays)`
    rebuilds the state from arrays in the order of the names.

    Example:
        >>> from flax import nnx
        >>> from learner.model.transformer import Transformer, model_config
        >>> names, _ = parameter_names(nnx.state(Transformer(model_config("tiny"), rngs=nnx.Rngs(0))))
        >>> names[:3]
        ['embed/embedding', 'final_norm/scale', 'layers/0/attn/k_proj/bias']
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    return [parameter_path(path) for path, _ in leaves], treedef


def named_leaves(state) -> dict:
    """``{parameter path: leaf}`` of ``state`` (e.g. ``nnx.state(model)``: the arrays, by the names above).

    Example:
        >>> named_leaves({"attn": {"q": 1, "k": 2}})
        {'attn/k': 2, 'attn/q': 1}
    """
    names, _ = parameter_names(state)
    return dict(zip(names, jax.tree.leaves(state), strict=True))


def update_named(model, weights) -> None:
    """Sets every parameter of the nnx ``model`` from ``{parameter path: array}`` (the inverse of `named_leaves`),
    each array as it is (its dtype kept); names the model lacks are ignored.

    Raises:
        KeyError: a parameter of the model has no array in ``weights`` (named, with the count missing).
        ValueError: an array's shape is not its parameter's.
    """
    state = nnx.state(model, nnx.Param)
    names, treedef = parameter_names(state)
    missing = [name for name in names if name not in weights]
    if missing:
        raise KeyError(f"parameter {missing[0]!r} has no array in the weights ({len(missing)} missing in all)")
    for name, leaf in zip(names, jax.tree.leaves(state)):
        if tuple(weights[name].shape) != tuple(leaf.shape):
            raise ValueError(f"parameter {name!r}: the weights' array has shape {tuple(weights[name].shape)}, the "
                             f"model's {tuple(leaf.shape)}")
    nnx.update(model, jax.tree_util.tree_unflatten(treedef, [jnp.asarray(weights[name]) for name in names]))
