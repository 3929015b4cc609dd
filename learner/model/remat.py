"""Rematerialisation of the transformer's blocks: which activations the backward pass keeps, which it recomputes.

``ModelConfig.remat`` names a policy. Every block's call is then wrapped in `flax.nnx.remat` (`jax.checkpoint`)
with it; the block tags its intermediates with `jax.ad_checkpoint.checkpoint_name` (``CHECKPOINT_NAMES``), which
is the identity when no policy reads them:

* ``"none"`` (default): no rematerialisation, every activation is kept (the fastest where memory allows).
* ``"full"``: each block keeps its input only and recomputes the rest (`jax.checkpoint_policies.nothing_saveable`).
* ``"dots"``: keeps the output of every matmul without batch dimensions, i.e. every projection, and recomputes
  norms, activations and the attention core (`dots_with_no_batch_dims_saveable`).
* ``"attention"``: keeps the attention core's output; projections and MLP are recomputed.
* ``"qkv_attention"``: keeps queries, keys, values and the attention core's output; recomputes ``o_proj`` and the
  MLP (whose ``[B, T, intermediate_size]`` activations are the block's largest).

The policies trade memory for FLOPs; a model FLOPs count (MFU) does not count the recomputation.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

CHECKPOINT_NAMES = ("query", "key", "value", "attention")  # tagged in learner.model.transformer.Attention

_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "attention": jax.checkpoint_policies.save_only_these_names("attention"),
    "qkv_attention": jax.checkpoint_policies.save_only_these_names("query", "key", "value", "attention"),
}
REMAT_CHOICES = tuple(_POLICIES)


def remat_call(remat: str, call: Callable[[nnx.Module, jax.Array], jax.Array]) -> Callable:
    """``call(block, x)`` under the rematerialisation policy named ``remat`` (itself for ``"none"``).

    ``call`` closes over everything but the block and its input (positions, masks, windows: static ints stay
    static).

    Example:
        >>> remat_call("none", len) is len
        True
    """
    policy = _POLICIES[remat]
    return call if policy is None else nnx.remat(call, policy=policy, graph_updates=False)
