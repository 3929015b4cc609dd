"""Attention kernels (learner.model.attention) and block rematerialisation (learner.model.remat), on the CPU.

The cuDNN kernel cannot run here, so its call is checked through JAX's XLA reference of the very same call
(`causal_attention(..., implementation="xla")`: causal flag, key lengths, grouped heads) against the model's own
einsum + softmax (`masked_attention`) under the dense causal-and-real mask; tests/accelerator/test_attention_cudnn.py
runs the cuDNN kernel itself against the XLA one on a GPU.

Tolerances: float32, 1e-5 (the two compute the same sums in another order: ~1e-6 seen); bfloat16, 2e-2 on outputs
of order 1 (a few bfloat16 ulps, 2^-8 each; identical bits seen on jax 0.10.2).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import learner.model.transformer as transformer
from learner.model.attention import attention_kernel, causal_attention, masked_attention
from learner.model.remat import REMAT_CHOICES
from learner.model.transformer import Transformer, model_config

LENGTHS = np.array([37, 20, 1, 0])  # right-padded rows: full, half, one token, none (a padding row)
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


def _qkv(dtype, batch=4, length=37, heads=8, kv_heads=2, head_dim=64):
    q, k, v = (jax.random.normal(key, (batch, length, h, head_dim)).astype(dtype)
               for key, h in zip(jax.random.split(jax.random.key(0), 3), (heads, kv_heads, kv_heads), strict=True))
    return q, k, v


def _allowed(lengths, length):
    real = jnp.arange(length)[None, :] < jnp.asarray(lengths)[:, None]
    return jnp.tril(jnp.ones((length, length), bool))[None] & real[:, None, :]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_cudnn_call_computes_the_masked_attention_with_its_gradients(dtype):
    """Causal + GQA (8 query heads on 2 key/value heads) + right padding, every query position of every row with a
    real token (a padding row's outputs are meaningless: only finite)."""
    q, k, v = _qkv(dtype)
    allowed = _allowed(LENGTHS, q.shape[1])

    def loss(attend, q, k, v):
        out = attend(q, k, v)
        return jnp.sum(out[:3].astype(jnp.float32) ** 2), out

    masked = functools.partial(masked_attention, allowed=allowed)
    causal = functools.partial(causal_attention, key_lengths=jnp.asarray(LENGTHS), implementation="xla")
    grad = jax.jit(jax.grad(loss, argnums=(1, 2, 3), has_aux=True), static_argnums=0)
    expected_grads, expected = grad(masked, q, k, v)
    grads, out = grad(causal, q, k, v)
    assert out.dtype == jnp.dtype(dtype) and bool(jnp.isfinite(out.astype(jnp.float32)).all())
    tolerance = TOLERANCE[dtype]
    np.testing.assert_allclose(np.float32(out[:3]), np.float32(expected[:3]), rtol=tolerance, atol=tolerance)
    for name, got, want in zip("qkv", grads, expected_grads, strict=True):
        scale = float(np.abs(np.float32(want)).max())
        np.testing.assert_allclose(np.float32(got), np.float32(want), rtol=tolerance, atol=tolerance * scale,
                                   err_msg=name)


def _flash_wired_on_cpu(model, monkeypatch):
    """The model's cuDNN branch, with the kernel swapped for JAX's XLA reference of the same call."""
    monkeypatch.setattr(transformer, "causal_attention", functools.partial(causal_attention, implementation="xla"))
    for _, module in nnx.iter_modules(model):
        if isinstance(module, transformer.Attention):
            module.implementation = "cudnn"
    return model


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_the_models_cudnn_branch_equals_its_xla_branch_with_a_window(dtype, monkeypatch):
    """The whole wiring of the cuDNN branch (key lengths from the attention mask, every query of the last block run
    then its window kept) against the model's XLA branch: the hidden states at a window of each row and the
    gradients of a loss on them."""
    config = model_config("tiny", dtype=dtype)
    lengths = np.array([12, 7, 9])
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 128, (3, 12)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(12), (3, 12))
    mask = jnp.arange(12)[None, :] < jnp.asarray(lengths)[:, None]
    first = jnp.array([2, 3, 5])
    weights = jax.random.normal(jax.random.key(1), (3, 4, config.hidden_size))  # (a sum of squares after the
    # final RMSNorm would be nearly constant: gradients of rounding noise alone)

    def run(model):
        graphdef, params = nnx.split(model)

        def loss(params):
            hidden = nnx.merge(graphdef, params)(tokens, positions, mask, output_window=(first, 4))
            return jnp.sum(hidden.astype(jnp.float32) * weights), hidden

        return jax.jit(jax.grad(loss, has_aux=True))(params)

    expected_grads, expected = run(Transformer(config, rngs=nnx.Rngs(0)))
    grads, hidden = run(_flash_wired_on_cpu(Transformer(config, rngs=nnx.Rngs(0)), monkeypatch))
    tolerance = TOLERANCE[dtype]
    np.testing.assert_allclose(np.float32(hidden), np.float32(expected), rtol=tolerance, atol=tolerance)
    for (path, got), want in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(expected_grads), strict=True):
        scale = float(np.abs(np.float32(want)).max())
        np.testing.assert_allclose(np.float32(got), np.float32(want), rtol=tolerance, atol=tolerance * scale,
                                   err_msg=jax.tree_util.keystr(path))


def test_the_kernel_is_resolved_once_from_the_config_and_the_platform():
    assert jax.default_backend() == "cpu"
    assert attention_kernel("auto", "bfloat16", 64) == "xla"  # no NVIDIA GPU here
    assert attention_kernel("xla", "bfloat16", 64) == "xla"
    model = Transformer(model_config("tiny", dtype="bfloat16"), rngs=nnx.Rngs(0))
    assert model.layers[0].attn.implementation == "xla"
    with pytest.raises(ValueError, match=r"ModelConfig.attention='cudnn' cannot apply: .*not an NVIDIA GPU"):
        Transformer(model_config("tiny", attention="cudnn"), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("field, value", [("attention", "flash"), ("remat", "some")])
def test_unknown_attention_or_remat_choices_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"ModelConfig.{field} must be one of"):
        model_config("tiny", **{field: value})


@functools.cache
def _loss_and_grads(remat):
    """Loss and gradients of a tiny model under ``remat``, its last block at a window, run under `jax.lax.map` over
    two micro-batches of rows as the update's proximal pass runs it; the program's scratch bytes."""
    config = model_config("tiny", remat=remat)
    graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
    tokens = jnp.asarray(np.random.default_rng(1).integers(1, 128, (4, 32)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(32), (4, 32))
    mask = jnp.arange(32)[None, :] < jnp.array([[32], [20], [9], [1]])
    window = (jnp.array([0, 4, 2, 0]), 8)
    weights = jax.random.normal(jax.random.key(2), (4, 8, config.hidden_size))

    def loss(params):
        def micro_batch(rows):
            hidden = nnx.merge(graphdef, params)(*(x[rows] for x in (tokens, positions, mask)),
                                                 output_window=(window[0][rows], window[1]))
            return jnp.sum(hidden * weights[rows])

        return jnp.sum(jax.lax.map(micro_batch, jnp.arange(4).reshape(2, 2)))

    program = jax.jit(jax.value_and_grad(loss)).lower(params).compile()
    return program(params), program.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("remat", [remat if remat == "full" else pytest.param(remat, marks=pytest.mark.slow)
                                   for remat in REMAT_CHOICES[1:]])
def test_every_remat_policy_gives_the_same_loss_and_gradients(remat):
    """Recomputing is the same float32 math again (1e-5 of a leaf's largest entry: XLA may fuse the recomputation
    differently); keeping nothing but block inputs ("full") needs less scratch memory than keeping everything."""
    (expected_loss, expected), memory_none = _loss_and_grads("none")
    (loss, grads), memory = _loss_and_grads(remat)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)
    for (path, got), want in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()),
                                   err_msg=jax.tree_util.keystr(path))
    if remat == "full":
        assert memory < memory_none, (memory, memory_none)
