"""Chunked logprobs: equal to the unchunked computation (values, gradients), a float64 reference, masking."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from learner.logprobs.chunked import logprobs_from_hidden, token_logprobs
from learner.model.transformer import Transformer, model_config

B, T, D, V = 3, 11, 16, 40


@pytest.fixture(scope="module")
def head_inputs():
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
    kernel = jnp.asarray(rng.standard_normal((D, V)) / 2, jnp.float32)
    tokens = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    mask = jnp.asarray(np.arange(T)[None, :] < np.array([[T], [7], [2]]))
    return hidden, kernel, tokens, mask


def _unchunked(hidden, kernel, tokens, mask, temperature):
    """Direct [B, T, V] computation, aligned on the scored token."""
    logp = jax.nn.log_softmax(hidden @ kernel / temperature, axis=-1)[:, :-1]
    lp = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    pad = ((0, 0), (1, 0))
    return jnp.where(mask, jnp.pad(lp, pad), 0.0), jnp.where(mask, jnp.pad(entropy, pad), 0.0)


@pytest.mark.parametrize("chunk_size", [1, 4, 11, 64])
def test_chunked_equals_unchunked(head_inputs, chunk_size):
    hidden, kernel, tokens, mask = head_inputs
    lp, ent = logprobs_from_hidden(hidden, kernel, tokens, mask, temperature=0.7, chunk_size=chunk_size,
                                   return_entropy=True)
    want_lp, want_ent = _unchunked(hidden, kernel, tokens, mask, 0.7)
    np.testing.assert_allclose(lp, want_lp, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(ent, want_ent, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_size, remat", [(4, None), (4, False), (11, None), (11, True), (64, None)])
def test_chunked_gradients_equal_unchunked(head_inputs, chunk_size, remat):
    hidden, kernel, tokens, mask = head_inputs
    weights = jnp.linspace(-1.0, 1.0, B * T).reshape(B, T)

    def loss(fn):
        return lambda h, k: jnp.sum(weights * fn(h, k))

    chunked = jax.jit(jax.grad(loss(lambda h, k: logprobs_from_hidden(h, k, tokens, mask, temperature=1.3,
                                                                      chunk_size=chunk_size, remat=remat)),
                               argnums=(0, 1)))
    plain = jax.grad(loss(lambda h, k: _unchunked(h, k, tokens, mask, 1.3)[0]), argnums=(0, 1))
    for got, want in zip(chunked(hidden, kernel), plain(hidden, kernel), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_size, remat, rematerialised", [(4, None, True), (4, False, False),
                                                                (11, None, False), (11, True, True)])
def test_logits_are_rematerialised_only_with_several_chunks_unless_set(head_inputs, chunk_size, remat,
                                                                       rematerialised):
    """One chunk (T <= chunk_size) gains no memory from recomputing its logits in the backward pass."""
    hidden, kernel, tokens, mask = head_inputs
    jaxpr = jax.make_jaxpr(lambda h: logprobs_from_hidden(h, kernel, tokens, mask, chunk_size=chunk_size,
                                                          remat=remat))(hidden)
    assert ("remat" in str(jaxpr)) == rematerialised  # jax.checkpoint's primitive


def test_matches_float64_numpy_reference(head_inputs):
    hidden, kernel, tokens, mask = head_inputs
    logits = np.asarray(hidden, np.float64) @ np.asarray(kernel, np.float64) / 2.0
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    tok, m = np.asarray(tokens), np.asarray(mask)
    want = np.zeros((B, T))
    want_entropy = np.zeros((B, T))
    for b in range(B):
        for t in range(1, T):
            if m[b, t]:
                want[b, t] = logp[b, t - 1, tok[b, t]]
                want_entropy[b, t] = -np.sum(np.exp(logp[b, t - 1]) * logp[b, t - 1])
    lp, ent = logprobs_from_hidden(hidden, kernel, tokens, mask, temperature=2.0, chunk_size=3, return_entropy=True)
    np.testing.assert_allclose(lp, want, atol=1e-5)
    np.testing.assert_allclose(ent, want_entropy, atol=1e-5)


def test_masked_positions_get_exactly_zero_gradient(head_inputs):
    hidden, kernel, tokens, mask = head_inputs
    loss_mask = mask.at[0, 3:6].set(False)

    def loss(h):
        return jnp.sum(loss_mask * logprobs_from_hidden(h, kernel, tokens, mask, chunk_size=4))

    grad = np.asarray(jax.grad(loss)(hidden))
    # Hidden position t predicts token t + 1: its gradient is zero iff token t + 1 is not in the loss.
    predicts_loss_token = np.zeros((B, T), bool)
    predicts_loss_token[:, :-1] = np.asarray(loss_mask)[:, 1:]
    assert np.all(grad[~predicts_loss_token] == 0.0)
    assert np.all(np.abs(grad[predicts_loss_token]).sum(-1) > 0)


def test_model_logprobs_chunked_equal_full_logits():
    model = Transformer(model_config("tiny"), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, 128, (2, 9)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(9), (2, 9))
    mask = jnp.asarray(np.arange(9)[None, :] < np.array([[9], [5]]))

    @jax.jit
    def both(model):
        chunked = token_logprobs(model, tokens, positions, mask, temperature=0.9, chunk_size=4)
        logits = model.logits(model(tokens, positions, mask))
        return chunked, logits

    chunked, logits = both(model)
    want, _ = _unchunked(logits, jnp.eye(128), tokens, mask, 0.9)  # logits @ I = logits
    np.testing.assert_allclose(chunked, want, atol=1e-5, rtol=1e-5)
