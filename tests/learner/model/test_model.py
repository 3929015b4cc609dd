"""Model: config validation, named configs, RoPE frequencies, masking, KV-cache decode equals the full forward, dtype
casting."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from learner.model.transformer import (
    Llama3RopeScaling,
    Transformer,
    cast_model,
    count_params,
    model_config,
    place_window,
    rope_frequencies,
    take_window,
)

PROMPT_LENS = np.array([3, 6, 1])  # right-padded rows of different lengths
TOTAL_LENS = PROMPT_LENS + 4  # each row decodes 4 more tokens


@jax.jit
def _logits(model, tokens, positions, mask):
    return model.logits(model(tokens, positions, mask))


@pytest.fixture(scope="module")
def tiny_model():
    return Transformer(model_config("tiny"), rngs=nnx.Rngs(0))


def _right_padded_batch(lengths, seq_len, vocab, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab, size=(len(lengths), seq_len)).astype(np.int32)
    mask = np.arange(seq_len)[None, :] < np.asarray(lengths)[:, None]
    tokens = np.where(mask, tokens, 0)
    positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), tokens.shape)
    return jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask)


@pytest.mark.parametrize("field, value", [("num_kv_heads", 3), ("head_dim", 7), ("hidden_size", 0),
                                          ("dtype", "float64"), ("rope_theta", -1.0)])
def test_invalid_config_error_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        model_config("tiny", **{field: value})


def test_unknown_named_config_lists_known_names():
    with pytest.raises(ValueError, match="tiny"):
        model_config("huge")


@pytest.mark.parametrize("name, low, high", [("small", 10e6, 20e6), ("100m", 90e6, 110e6),
                                             ("qwen2-0.5b", 490e6, 500e6), ("llama-8b", 7.9e9, 8.1e9)])
def test_named_config_parameter_counts(name, low, high):
    assert low <= count_params(model_config(name)) <= high


def test_padding_does_not_change_real_positions(tiny_model):
    tokens, positions, mask = _right_padded_batch([5, 5], 8, 128)
    other_padding = jnp.where(mask, tokens, 77)
    a = _logits(tiny_model, tokens, positions, mask)[:, :5]
    b = _logits(tiny_model, other_padding, positions, mask)[:, :5]
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_causal_future_tokens_do_not_change_past(tiny_model):
    tokens, positions, mask = _right_padded_batch([8], 8, 128)
    changed = tokens.at[0, 6].set((tokens[0, 6] + 1) % 128)
    a = _logits(tiny_model, tokens, positions, mask)
    b = _logits(tiny_model, changed, positions, mask)
    np.testing.assert_allclose(a[:, :6], b[:, :6], atol=1e-6)
    assert not np.allclose(a[:, 6:], b[:, 6:])


@pytest.mark.parametrize("overrides", [{}, {"num_layers": 1, "qk_norm": True, "qkv_bias": False}])
def test_output_window_equals_the_full_forward_there_with_the_same_gradients(overrides):
    """The last block run only at some columns (its queries, attention output and MLP; keys and values everywhere)
    gives the full forward's hidden states there, and a loss on them the same parameter gradients; with one layer
    the only block is the last. Columns include padded positions (row 1). Tolerance: the same float32 math on
    other shapes, which XLA may sum in another order, hence 1e-5 (of a gradient leaf's largest entry)."""
    model = Transformer(model_config("tiny", **overrides), rngs=nnx.Rngs(1))
    tokens, positions, mask = _right_padded_batch([9, 5, 12], 12, 128, seed=3)
    first = jnp.array([2, 3, 8])  # windows of 4 columns
    weights = jax.random.normal(jax.random.key(0), (3, 4, model.config.hidden_size))
    graphdef, params = nnx.split(model)

    def loss(params, at_columns):
        model = nnx.merge(graphdef, params)
        if at_columns:
            hidden = model(tokens, positions, mask, output_window=(first, 4))
        else:
            hidden = model(tokens, positions, mask)[jnp.arange(3)[:, None], first[:, None] + jnp.arange(4)]
        return jnp.sum(hidden * weights), hidden

    (_, full), full_grads = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(params, False)
    (_, windowed), windowed_grads = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(params, True)
    assert windowed.shape == (3, 4, model.config.hidden_size)
    np.testing.assert_allclose(windowed, full, rtol=1e-5, atol=1e-5)
    for (path, grad), expected in zip(jax.tree.leaves_with_path(windowed_grads), jax.tree.leaves(full_grads),
                                      strict=True):
        scale = float(np.abs(expected).max())  # gradients sum many terms: compare relative to the leaf's largest
        np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))


def test_window_take_and_place_are_each_others_transpose_and_differentiate_without_a_scatter():
    """take_window / place_window against NumPy indexing (float64 reference), their VJPs against each other's
    forward (the transpose of a selection is the placement), and the compiled gradient holds no scatter."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 7, 2)).astype(np.float32)
    first, size = np.array([0, 2, 4]), 3
    taken = np.stack([x[b, first[b]:first[b] + size] for b in range(3)])
    placed = np.zeros_like(x)
    for b in range(3):
        placed[b, first[b]:first[b] + size] = taken[b]
    np.testing.assert_array_equal(take_window(x, jnp.asarray(first), size), taken)
    np.testing.assert_array_equal(place_window(jnp.asarray(taken), jnp.asarray(first), 7), placed)

    cotangent_taken = rng.normal(size=taken.shape).astype(np.float32)
    cotangent_full = rng.normal(size=x.shape).astype(np.float32)
    _, take_vjp = jax.vjp(lambda a: take_window(a, jnp.asarray(first), size), x)
    _, place_vjp = jax.vjp(lambda a: place_window(a, jnp.asarray(first), 7), taken)
    expected_place = np.zeros_like(x)
    for b in range(3):
        expected_place[b, first[b]:first[b] + size] = cotangent_taken[b]
    np.testing.assert_array_equal(take_vjp(cotangent_taken)[0], expected_place)
    np.testing.assert_array_equal(place_vjp(cotangent_full)[0],
                                  np.stack([cotangent_full[b, first[b]:first[b] + size] for b in range(3)]))

    def loss(a):
        return jnp.sum(place_window(take_window(a, jnp.asarray(first), size) ** 2, jnp.asarray(first), 7))

    np.testing.assert_allclose(jax.grad(loss)(x), 2 * placed, rtol=1e-6)
    hlo = jax.jit(jax.grad(loss)).lower(x).compile().as_text()
    assert " scatter(" not in hlo and " gather(" in hlo


def test_logits_are_float32_with_vocab_axis(tiny_model):
    tokens, positions, mask = _right_padded_batch([4], 4, 128)
    logits = _logits(tiny_model, tokens, positions, mask)
    assert logits.shape == (1, 4, 128) and logits.dtype == jnp.float32


def test_llama3_rope_frequencies_by_hand():
    """head_dim 8, theta 1e4: frequencies 1, 0.1, 0.01, 0.001 with wavelengths 2 pi / f = 6.3, 63, 628, 6283.
    Original context 1000 with low / high frequency factors 1 / 4: wavelengths below 250 are kept, above 1000 divided
    by the factor 8, and 628 is smoothed with s = (1000 / 628.3 - 1) / (4 - 1): (1 - s) f / 8 + s f."""
    scaling = Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=1000)
    config = model_config("tiny", head_dim=8, rope_theta=10_000.0, rope_scaling=scaling)
    smooth = (5 / math.pi - 1) / 3
    expected = [1.0, 0.1, (1 - smooth) * 0.01 / 8 + smooth * 0.01, 0.001 / 8]
    np.testing.assert_allclose(rope_frequencies(config), expected, rtol=1e-6)
    plain = rope_frequencies(dataclasses.replace(config, rope_scaling=None))
    np.testing.assert_allclose(plain, [1.0, 0.1, 0.01, 0.001], rtol=1e-6)


@pytest.mark.parametrize("field, value", [("factor", 0.0), ("low_freq_factor", 4.0),
                                          ("original_max_position_embeddings", 0)])
def test_invalid_llama3_scaling_is_refused(field, value):
    fields = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    with pytest.raises(ValueError, match=field):
        Llama3RopeScaling(**(fields | {field: value}))


@pytest.mark.parametrize("variant", [{"tie_embeddings": False}, {"tie_embeddings": True},
                                     {"qkv_bias": False, "qk_norm": True, "rope_scaling": Llama3RopeScaling(
                                         factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=8)}], ids=["untied", "tied", "qwen3_llama3"])
def test_prefill_then_decode_matches_full_forward(variant):
    model = Transformer(model_config("tiny", **variant), rngs=nnx.Rngs(1))
    max_len = int(TOTAL_LENS.max()) + 2
    full_tokens, full_positions, full_mask = _right_padded_batch(TOTAL_LENS, max_len, 128, seed=3)
    expected = _logits(model, full_tokens, full_positions, full_mask)

    prefill_len = int(PROMPT_LENS.max())
    slots = jnp.arange(max_len)[None, :]
    cache_valid = slots < PROMPT_LENS[:, None]
    prompt_tokens = jnp.where(cache_valid[:, :prefill_len], full_tokens[:, :prefill_len], 0)
    forward_cached = jax.jit(Transformer.forward_cached)
    hidden, cache = forward_cached(model, prompt_tokens, full_positions[:, :prefill_len],
                                   model.init_cache(3, max_len), cache_valid)
    prompt_logits = model.logits(hidden)
    for b, n in enumerate(PROMPT_LENS):
        np.testing.assert_allclose(prompt_logits[b, :n], expected[b, :n], atol=1e-5, rtol=1e-5)

    lengths = jnp.asarray(PROMPT_LENS)
    for _ in range(4):
        next_tokens = jnp.take_along_axis(full_tokens, lengths[:, None], axis=1)
        cache_valid = cache_valid | (slots == lengths[:, None])
        hidden, cache = forward_cached(model, next_tokens, lengths[:, None], cache, cache_valid)
        step_logits = model.logits(hidden[:, 0])
        want = jnp.take_along_axis(expected, lengths[:, None, None], axis=1)[:, 0]
        np.testing.assert_allclose(step_logits, want, atol=1e-5, rtol=1e-5)
        lengths = lengths + 1


def test_cache_is_plain_pytree_of_keys_and_values(tiny_model):
    cache = tiny_model.init_cache(2, 16, jnp.bfloat16)
    cfg = tiny_model.config
    assert len(cache) == cfg.num_layers
    assert [leaf.shape for leaf in jax.tree.leaves(cache)] == [(2, 16, cfg.num_kv_heads, cfg.head_dim)] * 4
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(cache))


def test_padding_tokens_are_not_written_to_cache(tiny_model):
    tokens, positions, _ = _right_padded_batch([2], 4, 128)
    cache_valid = jnp.arange(8)[None, :] < 2
    cache = tiny_model.init_cache(1, 8)
    _, cache = jax.jit(Transformer.forward_cached)(tiny_model, tokens, positions, cache, cache_valid)
    assert np.all(np.asarray(cache[0].k[0, 2:]) == 0) and np.any(np.asarray(cache[0].k[0, :2]) != 0)


def test_bfloat16_copy_is_close_to_float32(tiny_model):
    tokens, positions, mask = _right_padded_batch([6, 3], 6, 128)
    bf16 = cast_model(tiny_model, "bfloat16")
    assert bf16.config == dataclasses.replace(tiny_model.config, dtype="bfloat16", param_dtype="bfloat16")
    want = _logits(tiny_model, tokens, positions, mask)
    got = _logits(bf16, tokens, positions, mask)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got[0], want[0], atol=0.1)
    assert not np.array_equal(got, want)
