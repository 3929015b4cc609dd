"""The attention core of `learner.model.transformer.Attention`: which kernel computes ``softmax(q k^T / sqrt(Dh)) v``.

Two implementations, chosen once per model from ``ModelConfig.attention`` and the platform (`attention_kernel`):

* ``"xla"``: `masked_attention`, einsum + float32 softmax under a dense ``[B, Q, S]`` mask, which XLA fuses. Every
  platform and dtype, and the only one for the inference server's KV-cache path.
* ``"cudnn"``: `causal_attention` through `jax.nn.dot_product_attention` with ``implementation="cudnn"``, cuDNN's
  flash attention: the ``[B, H, T, T]`` scores are never written to memory. Causal by index, right padding given as
  each row's count of real keys, grouped-query heads as they are. NVIDIA GPUs only, bfloat16 / float16 compute, a
  head dimension that is a multiple of 8 up to 128 (256 from Hopper on); the learner's full forward only.

``"auto"`` (the default) is ``"cudnn"`` where it applies, else ``"xla"``; an explicit ``"cudnn"`` where it cannot
apply is an error when the model is built, never a silent fallback at trace time. On a TPU the path is ``"xla"``
(a Splash attention kernel is not wired in: docs/accelerators.md).

The cuDNN path reads the padding as right padding (keys ``[0, length)`` real), the model's contract for its full
forward; a row without any real token attends to its first key (its outputs are meaningless either way, and finite).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.extend import backend as jax_backend

ATTENTION_CHOICES = ("auto", "xla", "cudnn")
_CUDNN_DTYPES = ("bfloat16", "float16")


class AttentionMask(NamedTuple):
    """What a query may attend to, in the forms the two kernels read.

    ``allowed``: ``[B, Q, S]`` bool, query ``q`` may attend key ``s`` (the XLA kernel). ``key_lengths``: ``[B]``
    int32 real keys per right-padded row, attention causal by index (the cuDNN kernel); None where the mask is no
    such thing (the KV cache). ``query_window``: ``(first, W)`` when the queries are the columns ``first[b] + [0, W)``
    of the sequence (`learner.model.transformer.take_window`): the cuDNN kernel computes every query, then keeps those.
    """

    allowed: jax.Array
    key_lengths: jax.Array | None = None
    query_window: tuple[jax.Array, int] | None = None


def cudnn_unsupported(dtype: str, head_dim: int) -> str | None:
    """Why cuDNN's flash attention cannot serve a model computing in ``dtype`` with heads of ``head_dim`` on this
    process's default backend; None when it can.

    Example:
        >>> cudnn_unsupported("float32", 64)  # on a CPU, the backend is the first reason
        "JAX's default backend is 'cpu', not an NVIDIA GPU"
    """
    backend = jax.default_backend()
    if backend != "gpu" or "cuda" not in jax_backend.get_backend().platform_version.lower():
        return f"JAX's default backend is {backend!r}, not an NVIDIA GPU"
    if dtype not in _CUDNN_DTYPES:
        return f"the compute dtype is {dtype} (cuDNN's flash attention takes {' or '.join(_CUDNN_DTYPES)})"
    capability = tuple(int(part) for part in jax.devices()[0].compute_capability.split("."))
    largest = 256 if capability >= (9, 0) else 128
    if head_dim % 8 or head_dim > largest:
        return f"head_dim={head_dim} (cuDNN needs a multiple of 8 up to {largest} on this GPU)"
    return None


def attention_kernel(choice: str, dtype: str, head_dim: int) -> str:
    """``"xla"`` or ``"cudnn"``: ``ModelConfig.attention`` (``choice``) resolved on this process's backend.

    Example:
        >>> attention_kernel("auto", "bfloat16", 64)  # on a CPU
        'xla'
    """
    if choice == "xla":
        return "xla"
    reason = cudnn_unsupported(dtype, head_dim)
    if reason is not None and choice == "cudnn":
        raise ValueError(f"ModelConfig.attention='cudnn' cannot apply: {reason}. Use 'auto' (cuDNN where it "
                         "applies) or 'xla'.")
    return "xla" if reason else "cudnn"


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array) -> jax.Array:
    """Grouped-query attention under a dense mask: q ``[B, Q, H, Dh]``, k and v ``[B, S, K, Dh]``, allowed
    ``[B, Q, S]`` bool; ``[B, Q, H, Dh]`` in v's dtype. Scores and softmax in float32; a query allowed no key
    attends to every key alike.

    Example:
        >>> q, k = jnp.ones((1, 2, 2, 4)), jnp.ones((1, 2, 1, 4))
        >>> v = jnp.arange(8.0).reshape(1, 2, 1, 4)
        >>> masked_attention(q, k, v, jnp.tril(jnp.ones((1, 2, 2), bool)))[0, :, 0].tolist()
        [[0.0, 1.0, 2.0, 3.0], [2.0, 3.0, 4.0, 5.0]]
    """
    b, t, h, dh = q.shape
    num_kv_heads = k.shape[2]
    q = q.reshape(b, t, num_kv_heads, h // num_kv_heads, dh)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(dh)
    scores = jnp.where(allowed[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, h, dh)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_lengths: jax.Array, *,
                     implementation: str = "cudnn") -> jax.Array:
    """Causal grouped-query attention over right-padded rows through `jax.nn.dot_product_attention`: q
    ``[B, T, H, Dh]``, k and v ``[B, T, K, Dh]``, key_lengths ``[B]`` (real keys per row); ``[B, T, H, Dh]``.

    Query ``t`` attends keys ``s <= t`` with ``s < key_lengths[b]`` (at least key 0), as `masked_attention` under
    the causal-and-real mask. ``implementation``: ``"cudnn"`` (the model's kernel) or ``"xla"`` (JAX's reference
    of the same call, which the CPU tests compare with `masked_attention`).

    Example:
        >>> q, k = jnp.ones((1, 2, 2, 4)), jnp.ones((1, 2, 1, 4))
        >>> v = jnp.arange(8.0).reshape(1, 2, 1, 4)
        >>> causal_attention(q, k, v, jnp.array([2]), implementation="xla")[0, :, 0].tolist()
        [[0.0, 1.0, 2.0, 3.0], [2.0, 3.0, 4.0, 5.0]]
    """
    lengths = jnp.maximum(key_lengths, 1).astype(jnp.int32)  # a padding row: key 0 (else 0 / 0)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, key_value_seq_lengths=lengths,
                                        implementation=implementation)
