"""Decoder-only transformer (Llama / Mistral / Qwen2 / Qwen3 layout) in Flax NNX, with a KV cache for inference.

The model is the same code for the learner (full forward over right-padded sequences) and the inference server
(prefill + decode through a KV cache). Hugging Face Llama, Mistral, Qwen2 and Qwen3 checkpoints load into it
(`learner.checkpoints.hf_checkpoint.model_config_from_checkpoint`, `learner.checkpoints.safetensors_io`; docs/models.md
lists what is
supported and what is refused).

Full forward (learner)::

    model = Transformer(model_config("tiny"), rngs=nnx.Rngs(0))
    hidden = model(tokens, positions, attention_mask)   # [B, T, D], after the final RMSNorm
    logits = model.logits(hidden)                       # [B, T, V] float32 (chunk it: learner.logprobs.chunked)
    hidden_at = model(tokens, positions, attention_mask, output_window=(first, W))  # [B, W, D] at first[b] + [0, W)

``tokens`` and ``positions`` are int32 ``[B, T]``; ``attention_mask`` is ``[B, T]`` (True / 1 = real token).
Sequences are right-padded; a query attends to key ``s`` iff ``s <= t`` (causal by index) and key ``s`` is real.
Outputs at padded positions are finite but meaningless.

KV cache (inference server)::

    cache = model.init_cache(batch_size, max_len, dtype=jnp.bfloat16)  # tuple of LayerKVCache(k, v), zeros
    # Prefill: prompts right-padded to T, row b has prompt_len[b] real tokens.
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    cache_valid = jnp.arange(max_len)[None, :] < prompt_len[:, None]      # [B, max_len] bool
    hidden, cache = model.forward_cached(prompts, positions, cache, cache_valid)
    last = jnp.take_along_axis(hidden, (prompt_len - 1)[:, None, None], axis=1)[:, 0]
    next_logits = model.logits(last)                                      # [B, V] float32
    # Decode one token per row at position p[b] (= current length of row b):
    cache_valid = cache_valid | (jnp.arange(max_len)[None, :] == p[:, None])
    hidden, cache = model.forward_cached(next_tokens[:, None], p[:, None], cache, cache_valid)

Cache contract (everything is explicit; the cache holds nothing but keys and values):

* ``cache`` is a tuple with one `LayerKVCache` per layer; ``k`` and ``v`` are ``[B, max_len, num_kv_heads,
  head_dim]``. Slot ``s`` holds the (RoPE-rotated) key / value of the token at position ``s``.
* ``cache_valid[b, s]`` says slot ``s`` of row ``b`` holds a real token AFTER this call's writes, i.e. the caller
  marks the slots of the new tokens too. A new token is written iff ``cache_valid[b, positions[b, t]]``; padding
  tokens (slot not marked) and positions ``>= max_len`` are not written.
* A token at position ``p`` attends to slots ``s <= p`` with ``cache_valid[b, s]``.
* ``forward_cached`` returns the final hidden states ``[B, T, D]`` (not logits, so a long prefill never builds
  ``[B, T, V]``) and the new cache. It is pure: jit it with the cache donated.

Dtypes: parameters are stored in ``config.param_dtype``; activations and matmuls run in ``config.dtype``; RMSNorm,
RoPE, softmax and logits are computed in float32. `cast_model` makes a copy in another dtype (e.g. a bfloat16 server
against a float32 learner).

Parameter paths (used by the sharding rules and the safetensors name map), with shapes::

    embed/embedding                 [V, D]
    layers/{i}/attn_norm/scale      [D]
    layers/{i}/attn/q_proj/kernel   [D, H, Dh]     (bias [H, Dh] when qkv_bias)
    layers/{i}/attn/k_proj/kernel   [D, K, Dh]     (bias [K, Dh] when qkv_bias)
    layers/{i}/attn/v_proj/kernel   [D, K, Dh]     (bias [K, Dh] when qkv_bias)
    layers/{i}/attn/q_norm/scale    [Dh]           (only when qk_norm)
    layers/{i}/attn/k_norm/scale    [Dh]           (only when qk_norm)
    layers/{i}/attn/o_proj/kernel   [H, Dh, D]
    layers/{i}/mlp_norm/scale       [D]
    layers/{i}/mlp/gate_proj/kernel [D, F]
    layers/{i}/mlp/up_proj/kernel   [D, F]
    layers/{i}/mlp/down_proj/kernel [F, D]
    final_norm/scale                [D]
    lm_head/kernel                  [D, V]         (absent when tie_embeddings)

With ``config.lora`` the targeted projections also hold ``.../lora/a`` and ``.../lora/b`` (`learner.model.lora`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from learner.model.attention import (
    ATTENTION_CHOICES,
    AttentionMask,
    attention_kernel,
    causal_attention,
    masked_attention,
)
from learner.model.lora import LoraConfig, attach_adapters
from learner.model.remat import REMAT_CHOICES, remat_call

_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's RoPE frequency remapping (Hugging Face ``rope_type = "llama3"``); see `rope_frequencies`.

    Wavelengths shorter than ``original_max_position_embeddings / high_freq_factor`` keep their frequency, longer
    than ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, and those in between are
    interpolated smoothly. It changes the logits at every position, not only beyond the original context.
    """

    factor: float  # Divisor of the low frequencies (Llama 3.1/3.2: 8 or 32).
    low_freq_factor: float  # original_max_position_embeddings / low_freq_factor: the longest unscaled wavelength.
    high_freq_factor: float  # original_max_position_embeddings / high_freq_factor: the shortest scaled one.
    original_max_position_embeddings: int  # The pre-training context (Llama 3: 8192).

    def __post_init__(self):
        if not self.factor > 0:
            raise ValueError(f"Llama3RopeScaling.factor must be > 0, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(f"Llama3RopeScaling needs 0 < low_freq_factor < high_freq_factor, got "
                             f"{self.low_freq_factor} and {self.high_freq_factor}")
        if not self.original_max_position_embeddings > 0:
            raise ValueError("Llama3RopeScaling.original_max_position_embeddings must be > 0, got "
                             f"{self.original_max_position_embeddings}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer.

    Example:
        >>> ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
        ...             num_kv_heads=1, head_dim=8).num_query_groups
        2
    """

    vocab_size: int  # Number of token ids (rows of the embedding, columns of the logits).
    hidden_size: int  # Width D of the residual stream.
    intermediate_size: int  # Width F of the SwiGLU MLP.
    num_layers: int  # Number of transformer blocks.
    num_heads: int  # Query heads H.
    num_kv_heads: int  # Key/value heads K (grouped-query attention); must divide num_heads.
    head_dim: int  # Width Dh of one attention head (need not equal hidden_size / num_heads); even, for RoPE.
    rope_theta: float = 10_000.0  # RoPE base frequency (Llama 2: 1e4, Llama 3: 5e5, Qwen2: 1e6).
    rms_norm_eps: float = 1e-6  # Epsilon inside RMSNorm's rsqrt.
    tie_embeddings: bool = False  # If True the output projection is the transposed token embedding.
    qkv_bias: bool = False  # If True q/k/v projections have a bias (Qwen2); o_proj never has one.
    qk_norm: bool = False  # If True queries and keys get an RMSNorm over head_dim per head before RoPE (Qwen3).
    rope_scaling: Llama3RopeScaling | None = None  # Llama 3.1's frequency remapping; None: plain RoPE.
    max_seq_len: int = 2048  # Longest sequence (prompt + completion) the model is configured for.
    param_dtype: str = "float32"  # Storage dtype of the parameters: float32, bfloat16 or float16.
    dtype: str = "float32"  # Compute dtype of activations and matmuls (norms, softmax, logits stay float32).
    lora: LoraConfig | None = None  # Low-rank adapters on the projections (learner.model.lora); None: none.
    # Attention kernel of the full forward (learner.model.attention): "auto" (cuDNN flash attention on NVIDIA GPUs
    # with bfloat16 / float16 compute, else XLA), "xla" or "cudnn" (an error where it cannot apply).
    attention: str = "auto"
    # Rematerialisation policy of the blocks in the backward pass (learner.model.remat): "none" keeps every
    # activation; "full", "dots", "attention", "qkv_attention" keep less and recompute the rest.
    remat: str = "none"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig.num_kv_heads={self.num_kv_heads} must divide "
                             f"num_heads={self.num_heads}")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        if self.rope_theta <= 0:
            raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"ModelConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"ModelConfig.{name} must be one of {_DTYPES}, got {getattr(self, name)!r}")
        for name, choices in (("attention", ATTENTION_CHOICES), ("remat", REMAT_CHOICES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"ModelConfig.{name} must be one of {choices}, got {getattr(self, name)!r}")

    @property
    def num_query_groups(self) -> int:
        """Query heads per key/value head."""
        return self.num_heads // self.num_kv_heads


_NAMED_CONFIGS = {
    # Tests and the default CPU run: exercises GQA, q/k/v bias and an untied head.
    "tiny": ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16, qkv_bias=True, max_seq_len=256),
    # ~19M parameters: quick CPU / single-accelerator experiments.
    "small": ModelConfig(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_layers=8, num_heads=6,
                         num_kv_heads=2, head_dim=64, max_seq_len=1024),
    # ~100M parameters.
    "100m": ModelConfig(vocab_size=32_000, hidden_size=768, intermediate_size=2048, num_layers=12, num_heads=12,
                        num_kv_heads=4, head_dim=64, tie_embeddings=True, max_seq_len=2048),
    # Qwen2-0.5B(-Instruct) shapes; loads the Hugging Face checkpoint.
    "qwen2-0.5b": ModelConfig(vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_layers=24,
                              num_heads=14, num_kv_heads=2, head_dim=64, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                              tie_embeddings=True, qkv_bias=True, max_seq_len=32_768),
    # Llama-3.2-1B: the shapes and Llama 3.1's RoPE scaling of its config.json (the scaling changes the logits at
    # every position, so a config without it would not be Llama-3.2-1B; max_seq_len shortened from 131072).
    "llama-1b": ModelConfig(vocab_size=128_256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                            num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500_000.0, rms_norm_eps=1e-5,
                            tie_embeddings=True, max_seq_len=8192,
                            rope_scaling=Llama3RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                           original_max_position_embeddings=8192)),
    # Llama-3-8B shapes (Llama 3.0: no RoPE scaling).
    "llama-8b": ModelConfig(vocab_size=128_256, hidden_size=4096, intermediate_size=14_336, num_layers=32,
                            num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500_000.0, rms_norm_eps=1e-5,
                            max_seq_len=8192),
}


def model_config(name: str, **overrides) -> ModelConfig:
    """Returns the named configuration, with optional field overrides.

    Args:
        name: one of "tiny", "small", "100m", "qwen2-0.5b", "llama-1b", "llama-8b".
        **overrides: ModelConfig fields to replace (e.g. ``dtype="bfloat16"``).

    Example:
        >>> model_config("tiny", num_layers=1).num_layers
        1
    """
    if name not in _NAMED_CONFIGS:
        raise ValueError(f"unknown model config {name!r}; known: {sorted(_NAMED_CONFIGS)}")
    return dataclasses.replace(_NAMED_CONFIGS[name], **overrides)


class LayerKVCache(NamedTuple):
    """Keys and values of one layer, ``[B, max_len, num_kv_heads, head_dim]``, slot = token position."""

    k: jax.Array
    v: jax.Array


KVCache = tuple[LayerKVCache, ...]


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], stddev: float, dtype: str) -> nnx.Param:
    return nnx.Param((stddev * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))


class RMSNorm(nnx.Module):
    """``x / sqrt(mean(x^2) + eps) * scale`` over the last axis (width ``size``, default hidden_size), computed in
    float32 (Llama's RMSNorm)."""

    def __init__(self, config: ModelConfig, size: int | None = None):
        self.scale = nnx.Param(jnp.ones((size or config.hidden_size,), config.param_dtype))
        self.eps = config.rms_norm_eps
        self.dtype = config.dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...].astype(jnp.float32)).astype(self.dtype)


class Projection(nnx.Module):
    """Linear map contracting the trailing ``in_shape`` axes of x with a kernel of shape ``in_shape + out_shape``."""

    def __init__(self, in_shape: tuple[int, ...], out_shape: tuple[int, ...], *, use_bias: bool,
                 config: ModelConfig, rngs: nnx.Rngs):
        self.kernel = _normal(rngs, in_shape + out_shape, 1.0 / math.sqrt(math.prod(in_shape)), config.param_dtype)
        self.bias = nnx.Param(jnp.zeros(out_shape, config.param_dtype)) if use_bias else None
        self.num_in_axes = len(in_shape)
        self.dtype = config.dtype
        self.lora = None  # a learner.model.lora.LoRA when the model's LoRA config targets this projection

    def __call__(self, x: jax.Array) -> jax.Array:
        # One 2-D matmul, [N, in] @ [in, out], with the head axes merged by reshapes (free in row-major layout): a
        # tensordot against the 3-D attention kernels made XLA:CPU transpose the kernels and their gradients
        # (a 100m update ran 1.18x slower).
        kernel = self.kernel[...].astype(self.dtype)
        in_size = math.prod(kernel.shape[:self.num_in_axes])
        rows = x.shape[:x.ndim - self.num_in_axes]
        x = x.astype(self.dtype).reshape(-1, in_size)
        y = x @ kernel.reshape(in_size, -1)
        if self.lora is not None:
            y = y + self.lora(x).astype(self.dtype)
        y = y.reshape(rows + kernel.shape[self.num_in_axes:])
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


def rope_frequencies(config: ModelConfig) -> np.ndarray:
    """The ``[head_dim / 2]`` float32 inverse frequencies of RoPE, remapped by ``config.rope_scaling`` if set.

    ``theta ** (-2i / head_dim)``; with Llama-3 scaling, the remapping of Hugging Face transformers'
    ``_compute_llama3_parameters`` (computed here in float64, then rounded once).

    Example:
        >>> rope_frequencies(ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
        ...                              num_heads=1, num_kv_heads=1, head_dim=4, rope_theta=100.0))
        array([1. , 0.1], dtype=float32)
    """
    inv_freq = 1.0 / config.rope_theta ** (np.arange(0, config.head_dim, 2, dtype=np.float64) / config.head_dim)
    scaling = config.rope_scaling
    if scaling is not None:
        context = scaling.original_max_position_embeddings
        low_freq_wavelen = context / scaling.low_freq_factor
        high_freq_wavelen = context / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary position embedding, Hugging Face "rotate half" convention.

    Args:
        x: ``[B, T, heads, head_dim]``.
        positions: ``[B, T]`` integer positions.
        inv_freq: ``[head_dim / 2]`` inverse frequencies (`rope_frequencies`).

    Returns:
        x rotated, in x's dtype (computed in float32).

    Example:
        >>> x = jnp.ones((1, 1, 1, 4))
        >>> bool(jnp.allclose(apply_rope(x, jnp.zeros((1, 1), jnp.int32), jnp.array([1.0, 0.1])), x))
        True
    """
    angles = positions.astype(jnp.float32)[..., None, None] * jnp.asarray(inv_freq, jnp.float32)  # [B, T, 1, Dh/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1).astype(x.dtype)


def take_columns(x: jax.Array, columns: jax.Array) -> jax.Array:
    """``x[b, columns[b, i], ...]`` for x ``[B, T, ...]`` and columns ``[B, W]`` in ``[0, T)``: ``[B, W, ...]``.

    Example:
        >>> take_columns(jnp.arange(6).reshape(2, 3), jnp.array([[2], [0]])).tolist()
        [[2], [3]]
    """
    index = columns.reshape(columns.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, index, axis=1, mode="promise_in_bounds")


def take_window(x: jax.Array, first: jax.Array, size: int) -> jax.Array:
    """``x[b, first[b] + i, ...]`` for ``i < size``: the window of ``size`` columns from ``first`` (``[B]`` ints,
    ``first[b] + size <= T``) of every row of x ``[B, T, ...]``; ``[B, size, ...]``.

    Its gradient is `place_window` of the cotangent, a gather, where ``take_columns``'s is a scatter-add (slow to
    compile on the CPU and slow to run on a TPU).

    Example:
        >>> take_window(jnp.arange(8).reshape(2, 4), jnp.array([1, 2]), 2).tolist()
        [[1, 2], [6, 7]]
    """
    return _take_window(x, first, size, x.shape[1])


def place_window(values: jax.Array, first: jax.Array, length: int) -> jax.Array:
    """The inverse of `take_window`: ``values`` ``[B, W, ...]`` at columns ``first[b] + [0, W)`` of rows of
    ``length`` columns, 0 elsewhere; ``[B, length, ...]``. Its gradient is `take_window` of the cotangent.

    Example:
        >>> place_window(jnp.array([[1, 2], [6, 7]]), jnp.array([1, 2]), 4).tolist()
        [[0, 1, 2, 0], [0, 0, 6, 7]]
    """
    return _place_window(values, first, values.shape[1], length)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _take_window(x, first, size, length):
    del length
    return take_columns(x, first[:, None] + jnp.arange(size))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _place_window(values, first, size, length):
    entry = jnp.arange(length) - first[:, None]  # [B, length]: the window entry at each column
    inside = (entry >= 0) & (entry < size)
    placed = take_columns(values, jnp.clip(entry, 0, size - 1))
    return jnp.where(inside.reshape(inside.shape + (1,) * (values.ndim - 2)), placed, 0)


def _window_fwd(function):
    return lambda array, first, size, length: (function(array, first, size, length), first)


_take_window.defvjp(_window_fwd(_take_window),
                    lambda size, length, first, cotangent: (_place_window(cotangent, first, size, length), None))
_place_window.defvjp(_window_fwd(_place_window),
                     lambda size, length, first, cotangent: (_take_window(cotangent, first, size, length), None))


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE, optional q/k/v bias and optional per-head q/k RMSNorm."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d, h, k, dh = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.q_proj = Projection((d,), (h, dh), use_bias=config.qkv_bias, config=config, rngs=rngs)
        self.k_proj = Projection((d,), (k, dh), use_bias=config.qkv_bias, config=config, rngs=rngs)
        self.v_proj = Projection((d,), (k, dh), use_bias=config.qkv_bias, config=config, rngs=rngs)
        self.o_proj = Projection((h, dh), (d,), use_bias=False, config=config, rngs=rngs)
        self.q_norm = RMSNorm(config, dh) if config.qk_norm else None
        self.k_norm = RMSNorm(config, dh) if config.qk_norm else None
        self.config = config
        self.implementation = attention_kernel(config.attention, config.dtype, config.head_dim)  # resolved once

    def __call__(self, x: jax.Array, positions: jax.Array, mask: AttentionMask,
                 layer_cache: LayerKVCache | None = None, write_slots: jax.Array | None = None,
                 queries: tuple[jax.Array, jax.Array] | None = None) -> tuple[jax.Array, LayerKVCache | None]:
        """Attends x ``[B, T, D]`` to itself, or to the cache after writing x's keys/values at ``write_slots``.

        ``mask`` (`AttentionMask`): ``allowed`` ``[B, Q, S]`` bool (S = T without cache, max_len with cache), and
        for the cuDNN kernel the rows' key lengths. Queries are all T tokens (Q = T), or ``queries = (query_x
        [B, Q, D], query_positions [B, Q])``, the columns ``mask.query_window`` of x: keys and values still come
        from every token. The cuDNN kernel (`learner.model.attention`) serves the forward without a cache; it runs
        every query and keeps the window's.
        """
        cfg = self.config
        flash = self.implementation == "cudnn" and layer_cache is None and mask.key_lengths is not None
        if flash and queries is not None and mask.query_window is None:
            raise ValueError("Attention: queries at some columns need mask.query_window for the cuDNN kernel")
        query_x, query_positions = (x, positions) if queries is None or flash else queries
        q, k = self.q_proj(query_x), self.k_proj(x)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = rope_frequencies(cfg)  # a trace-time constant
        q = checkpoint_name(apply_rope(q, query_positions, inv_freq), "query")
        k = checkpoint_name(apply_rope(k, positions, inv_freq), "key")
        v = checkpoint_name(self.v_proj(x), "value")
        if layer_cache is not None:
            rows = jnp.arange(x.shape[0])[:, None]
            layer_cache = LayerKVCache(
                k=layer_cache.k.at[rows, write_slots].set(k.astype(layer_cache.k.dtype), mode="drop"),
                v=layer_cache.v.at[rows, write_slots].set(v.astype(layer_cache.v.dtype), mode="drop"))
            k, v = layer_cache.k.astype(cfg.dtype), layer_cache.v.astype(cfg.dtype)
        if flash:
            out = causal_attention(q, k, v, mask.key_lengths)
            if queries is not None:
                out = take_window(out, *mask.query_window)
        else:
            out = masked_attention(q, k, v, mask.allowed)
        return self.o_proj(checkpoint_name(out, "attention")), layer_cache


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = Projection((d,), (f,), use_bias=False, config=config, rngs=rngs)
        self.up_proj = Projection((d,), (f,), use_bias=False, config=config, rngs=rngs)
        self.down_proj = Projection((f,), (d,), use_bias=False, config=config, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    """Pre-norm residual block: attention then MLP; with ``query_window = (first, Q)`` (see `take_window`) the
    queries, the attention output and the MLP run at the columns ``first[b] + [0, Q)`` only (keys and values at every
    token), and the output is the residual stream there."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(config)
        self.attn = Attention(config, rngs=rngs)
        self.mlp_norm = RMSNorm(config)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, x, positions, mask: AttentionMask, layer_cache=None, write_slots=None, query_window=None):
        normed = self.attn_norm(x)
        queries = None
        if query_window is not None:  # the residual at the window; its norm is the norm's there (per token)
            x = take_window(x, *query_window)
            queries = (self.attn_norm(x), take_window(positions, *query_window))
        attn_out, layer_cache = self.attn(normed, positions, mask, layer_cache, write_slots, queries)
        x = x + attn_out
        return x + self.mlp(self.mlp_norm(x)), layer_cache


def token_embedding(config: ModelConfig, rngs: nnx.Rngs) -> nnx.Embed:
    """The Transformer's token embedding ``[vocab_size, hidden_size]``, normal with stddev 1/sqrt(hidden_size)."""
    return nnx.Embed(config.vocab_size, config.hidden_size, dtype=config.dtype, param_dtype=config.param_dtype,
                     embedding_init=nnx.initializers.normal(1.0 / math.sqrt(config.hidden_size)), rngs=rngs)


def output_head(config: ModelConfig, rngs: nnx.Rngs) -> Projection | None:
    """The Transformer's untied output projection, or None with tied embeddings (no key drawn)."""
    if config.tie_embeddings:
        return None
    return Projection((config.hidden_size,), (config.vocab_size,), use_bias=False, config=config, rngs=rngs)


class Transformer(nnx.Module):
    """Decoder-only transformer; see the module docstring for the call forms and the cache contract.

    Example:
        >>> model = Transformer(model_config("tiny"), rngs=nnx.Rngs(0))
        >>> tokens = jnp.zeros((2, 5), jnp.int32)
        >>> positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
        >>> model.logits(model(tokens, positions, jnp.ones((2, 5), bool))).shape
        (2, 5, 128)
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        # learner.model.param_init builds the same parts in the same order (the order they draw from rngs).
        self.config = config
        self.embed = token_embedding(config, rngs)
        self.layers = nnx.List([Block(config, rngs=rngs) for _ in range(config.num_layers)])
        self.final_norm = RMSNorm(config)
        self.lm_head = output_head(config, rngs)
        if config.lora is not None:  # after the base's parameters: the same seed gives the same base
            attach_adapters(self, config.lora, Projection, rngs)

    def __call__(self, tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array | None = None,
                 output_window: tuple[jax.Array, int] | None = None) -> jax.Array:
        """Final hidden states ``[B, T, D]`` (after the final RMSNorm) of right-padded sequences.

        Args:
            tokens: ``[B, T]`` int token ids.
            positions: ``[B, T]`` int positions (RoPE), usually ``arange(T)`` per row.
            attention_mask: ``[B, T]`` bool or 0/1, True for real tokens; None means all real.
            output_window: ``(first, W)``, ``first`` ``[B]`` ints with ``first[b] + W <= T``: return only the
                hidden states at columns ``first[b] + [0, W)``, ``[B, W, D]`` (`take_window`). The last block then
                runs its queries, attention output and MLP at those columns alone (its keys and values at every
                token), saving ``1 - W / T`` of its work; an RL loss that scores only the completion
                (`learner.logprobs.chunked`, scored window) needs no more.
        """
        t = tokens.shape[1]
        key_valid = jnp.ones(tokens.shape, bool) if attention_mask is None else attention_mask.astype(bool)
        causal = jnp.tril(jnp.ones((t, t), bool))
        key_lengths = jnp.sum(key_valid, axis=1, dtype=jnp.int32)  # right-padded rows: the real keys' count
        mask = AttentionMask(causal[None, :, :] & key_valid[:, None, :], key_lengths)
        x = self.embed(tokens)
        *body, last = self.layers
        run_block = remat_call(self.config.remat, lambda block, x: block(x, positions, mask)[0])
        for block in body:
            x = run_block(block, x)
        last_mask = mask
        if output_window is not None:  # causal by column index: the rows of ``allowed`` at the window's columns
            first, size = output_window
            columns = first[:, None] + jnp.arange(size)
            allowed = (columns[:, :, None] >= jnp.arange(t)) & key_valid[:, None, :]
            last_mask = AttentionMask(allowed, key_lengths, output_window)
        x = remat_call(self.config.remat,
                       lambda block, x: block(x, positions, last_mask, query_window=output_window)[0])(last, x)
        return self.final_norm(x)

    def forward_cached(self, tokens: jax.Array, positions: jax.Array, cache: KVCache, cache_valid: jax.Array,
                       ) -> tuple[jax.Array, KVCache]:
        """Runs new tokens against the KV cache: writes their keys/values, returns ``(hidden, new_cache)``.

        Args:
            tokens: ``[B, T]`` new token ids (T = prompt length for prefill, 1 for decode).
            positions: ``[B, T]`` their positions = cache slots.
            cache: from `init_cache` or a previous call.
            cache_valid: ``[B, max_len]`` bool, slots holding real tokens including the new ones.

        Returns:
            Final hidden states ``[B, T, D]`` and the updated cache.
        """
        max_len = cache_valid.shape[1]
        slot_ids = jnp.arange(max_len)
        is_real = jnp.take_along_axis(cache_valid, jnp.clip(positions, 0, max_len - 1), axis=1)
        is_real &= (positions >= 0) & (positions < max_len)
        write_slots = jnp.where(is_real, positions, max_len)  # max_len is out of bounds: dropped
        mask = AttentionMask(cache_valid[:, None, :] & (slot_ids[None, None, :] <= positions[:, :, None]))
        x = self.embed(tokens)
        new_cache = []
        for block, layer_cache in zip(self.layers, cache, strict=True):
            x, layer_cache = block(x, positions, mask, layer_cache, write_slots)
            new_cache.append(layer_cache)
        return self.final_norm(x), tuple(new_cache)

    def init_cache(self, batch_size: int, max_len: int, dtype=None) -> KVCache:
        """Zero KV cache: one `LayerKVCache` of ``[batch_size, max_len, num_kv_heads, head_dim]`` per layer.

        Args:
            batch_size: rows B.
            max_len: slots per row (longest prompt + completion).
            dtype: cache dtype; defaults to the compute dtype.
        """
        cfg = self.config
        shape = (batch_size, max_len, cfg.num_kv_heads, cfg.head_dim)
        dtype = dtype or cfg.dtype
        return tuple(LayerKVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers))

    def output_kernel(self) -> jax.Array:
        """The ``[D, V]`` output projection in the compute dtype (the transposed embedding when tied)."""
        if self.lm_head is None:
            return self.embed.embedding[...].T.astype(self.config.dtype)
        return self.lm_head.kernel[...].astype(self.config.dtype)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Float32 logits ``[..., V]`` of final hidden states ``[..., D]``."""
        return jnp.einsum("...d,dv->...v", hidden.astype(self.config.dtype), self.output_kernel(),
                          preferred_element_type=jnp.float32)


def cast_model(model: Transformer, dtype: str) -> Transformer:
    """Copy of the model with parameters stored and computed in ``dtype`` (e.g. a bfloat16 inference copy).

    Example:
        >>> model = Transformer(model_config("tiny"), rngs=nnx.Rngs(0))
        >>> cast_model(model, "bfloat16").embed.embedding[...].dtype
        dtype(bfloat16)
    """
    config = dataclasses.replace(model.config, param_dtype=dtype, dtype=dtype)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    state = jax.tree.map(lambda x: x.astype(dtype), nnx.state(model))
    return nnx.merge(graphdef, state)


def count_params(config: ModelConfig) -> int:
    """Number of parameters of a model with this config (no memory allocated).

    Example:
        >>> count_params(model_config("tiny"))
        90688
    """
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
