"""cuDNN flash attention (`learner.model.attention`, ``ModelConfig.attention = "cudnn"``) against the XLA kernel, on
an NVIDIA GPU: the kernel alone and a bfloat16 model's forward and gradients, with llama-1b's head layout (64-wide
heads, 4 query heads per key/value head), causal, right-padded rows, the last block at a query window. Skipped where
cuDNN cannot apply (so on the CPU of `scripts/gpu_check.sh --cpu`).

Both sides compute in bfloat16 with a float32 softmax, in different orders: outputs of order 1 agree to 3e-2
(a few bfloat16 ulps of 2^-8), and every gradient to a relative error (Frobenius norm of the difference over the XLA
one's) of 3e-2.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from learner.model.attention import causal_attention, cudnn_unsupported, masked_attention
from learner.model.transformer import ModelConfig, Transformer

TOLERANCE = 3e-2


@pytest.fixture(autouse=True)
def needs_cudnn():
    reason = cudnn_unsupported("bfloat16", 64)
    if reason:
        pytest.skip(f"cuDNN flash attention cannot run here: {reason}")


def _relative_error(got, want) -> float:
    got, want = np.float32(got), np.float32(want)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def test_the_cudnn_kernel_equals_the_xla_one_with_its_gradients():
    lengths = jnp.array([1024, 700, 1, 0], jnp.int32)  # the last row is padding: only finite
    q, k, v = (jax.random.normal(key, (4, 1024, heads, 64), jnp.bfloat16)
               for key, heads in zip(jax.random.split(jax.random.key(0), 3), (32, 8, 8), strict=True))
    real = jnp.arange(1024)[None, :] < lengths[:, None]
    allowed = jnp.tril(jnp.ones((1024, 1024), bool))[None] & real[:, None, :]

    def loss(attend, q, k, v):
        out = attend(q, k, v)
        return jnp.sum(out[:3].astype(jnp.float32) * jnp.cos(jnp.arange(64.0))), out

    grad = jax.jit(jax.grad(loss, argnums=(1, 2, 3), has_aux=True), static_argnums=0)
    flash = lambda q, k, v: causal_attention(q, k, v, lengths)  # noqa: E731
    xla = lambda q, k, v: masked_attention(q, k, v, allowed)  # noqa: E731
    assert "cudnn" in grad.lower(flash, q, k, v).compile().as_text().lower()  # cuDNN's fused attention ran
    grads, out = grad(flash, q, k, v)
    expected_grads, expected = grad(xla, q, k, v)
    worst = float(jnp.abs(out[:3].astype(jnp.float32) - expected[:3].astype(jnp.float32)).max())
    errors = [_relative_error(g, e) for g, e in zip(grads, expected_grads, strict=True)]
    print(f"max |cuDNN - XLA| attention output: {worst:.2e}; relative gradient errors q, k, v: "
          + ", ".join(f"{e:.2e}" for e in errors) + f" ({jax.devices()[0].device_kind})")
    assert bool(jnp.isfinite(out.astype(jnp.float32)).all())
    np.testing.assert_allclose(np.float32(out[:3]), np.float32(expected[:3]), atol=TOLERANCE, rtol=TOLERANCE)
    assert max(errors) < TOLERANCE, errors


def test_a_bfloat16_model_on_cudnn_equals_it_on_xla():
    shape = dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_layers=2, num_heads=8,
                 num_kv_heads=2, head_dim=64, dtype="bfloat16")
    tokens = jax.random.randint(jax.random.key(1), (4, 512), 1, 1024)
    positions = jnp.broadcast_to(jnp.arange(512), (4, 512))
    mask = jnp.arange(512)[None, :] < jnp.array([[512], [300], [129], [40]])
    window = (jnp.array([256, 100, 64, 0]), 32)
    weights = jax.random.normal(jax.random.key(2), (4, 32, 512))

    def run(attention):
        model = Transformer(ModelConfig(**shape, attention=attention), rngs=nnx.Rngs(0))
        assert model.layers[0].attn.implementation == attention
        graphdef, params = nnx.split(model)

        def loss(params):
            hidden = nnx.merge(graphdef, params)(tokens, positions, mask, output_window=window)
            return jnp.sum(hidden.astype(jnp.float32) * weights), hidden

        return jax.jit(jax.grad(loss, has_aux=True))(params)

    grads, hidden = run("cudnn")
    expected_grads, expected = run("xla")
    errors = {jax.tree_util.keystr(path): _relative_error(g, e) for (path, g), e in
              zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(expected_grads), strict=True)}
    worst = max(errors, key=errors.get)
    print(f"max |relative error| model cuDNN vs XLA: hidden {_relative_error(hidden, expected):.2e}; worst gradient "
          f"{worst} {errors[worst]:.2e}")
    assert _relative_error(hidden, expected) < TOLERANCE
    assert errors[worst] < TOLERANCE, errors
