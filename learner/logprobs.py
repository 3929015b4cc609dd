"""Per-token log-probabilities (and entropies) computed in chunks of the token axis.

Full float32 logits ``[B, T, V]`` are the largest tensor of an RL step on a language model (8 x 4096 x 128k x 4 bytes
= 16 GiB). Here the output projection, log-softmax and gather run one chunk of ``chunk_size`` tokens at a time under
`jax.lax.map` with `jax.checkpoint`, so only ``[B, chunk_size, V]`` logits exist at once, in the forward pass and in
the backward pass (which recomputes each chunk's logits instead of storing them).

Alignment: outputs are aligned with the scored token. ``logprobs[:, t] = log p(tokens[:, t] | tokens[:, :t])``, the
probability the model gave (at hidden position ``t - 1``) to the token that sits at ``t``. This lines up with token
ids, loss masks and the per-token logprobs an inference server returns for the tokens it sampled. Column 0 (no
prefix) and padded tokens (``attention_mask`` False) are 0.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from learner.model import Transformer


def token_logprobs(model: Transformer, tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array, *,
                   temperature: float | jax.Array = 1.0, chunk_size: int = 512, return_entropy: bool = False):
    """Log-probabilities of each token under the model at a sampling temperature.

    Args:
        model: the transformer.
        tokens: ``[B, T]`` int token ids, right-padded.
        positions: ``[B, T]`` int positions.
        attention_mask: ``[B, T]``, True / 1 for real tokens.
        temperature: logits are divided by it before the log-softmax (the sampler's temperature).
        chunk_size: tokens per chunk; peak logits memory is ``B * chunk_size * V * 4`` bytes.
        return_entropy: also return the entropy of each predictive distribution, aligned like the logprobs.

    Returns:
        ``[B, T]`` float32 logprobs (aligned with the scored token, see the module docstring), or
        ``(logprobs, entropy)`` when ``return_entropy``.

    Example:
        >>> from flax import nnx
        >>> from learner.model import model_config
        >>> model = Transformer(model_config("tiny"), rngs=nnx.Rngs(0))
        >>> tokens = jnp.array([[5, 6, 7, 0]])
        >>> lp = token_logprobs(model, tokens, jnp.arange(4)[None], tokens > 0, chunk_size=2)
        >>> lp.shape, bool(lp[0, 0] == 0), bool(lp[0, 3] == 0), bool(lp[0, 1] < 0)
        ((1, 4), True, True, True)
    """
    hidden = model(tokens, positions, attention_mask)
    return logprobs_from_hidden(hidden, model.output_kernel(), tokens, attention_mask, temperature=temperature,
                                chunk_size=chunk_size, return_entropy=return_entropy)


def logprobs_from_hidden(hidden: jax.Array, output_kernel: jax.Array, tokens: jax.Array,
                         attention_mask: jax.Array | None = None, *, temperature: float | jax.Array = 1.0,
                         chunk_size: int = 512, return_entropy: bool = False):
    """`token_logprobs` from final hidden states ``[B, T, D]`` and the ``[D, V]`` output projection.

    Example:
        >>> lp = logprobs_from_hidden(jnp.ones((1, 3, 4)), jnp.zeros((4, 8)), jnp.array([[1, 2, 3]]))
        >>> bool(jnp.allclose(lp, jnp.array([[0.0, -jnp.log(8.0), -jnp.log(8.0)]])))
        True
    """
    batch, seq_len, _ = hidden.shape
    chunk_size = min(chunk_size, seq_len)
    num_chunks = math.ceil(seq_len / chunk_size)
    padded_len = num_chunks * chunk_size
    next_tokens = jnp.pad(tokens[:, 1:], ((0, 0), (0, padded_len - seq_len + 1)))
    hidden = jnp.pad(hidden, ((0, 0), (0, padded_len - seq_len), (0, 0)))

    def to_chunks(x):  # [B, padded_len, ...] -> [num_chunks, B, chunk_size, ...]
        return jnp.swapaxes(x.reshape(batch, num_chunks, chunk_size, *x.shape[2:]), 0, 1)

    def from_chunks(x):  # [num_chunks, B, chunk_size] -> [B, seq_len], shifted onto the scored token
        x = jnp.swapaxes(x, 0, 1).reshape(batch, padded_len)[:, : seq_len - 1]
        return jnp.pad(x, ((0, 0), (1, 0)))

    @jax.checkpoint
    def chunk_stats(chunk):
        chunk_hidden, chunk_targets = chunk
        logits = jnp.einsum("bcd,dv->bcv", chunk_hidden, output_kernel, preferred_element_type=jnp.float32)
        logits = logits / temperature
        log_normalizer = jax.nn.logsumexp(logits, axis=-1)
        target_logits = jnp.take_along_axis(logits, chunk_targets[..., None], axis=-1)[..., 0]
        logprobs = target_logits - log_normalizer
        if not return_entropy:
            return logprobs, None
        expected_logit = jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1)
        return logprobs, log_normalizer - expected_logit

    logprobs, entropy = jax.lax.map(chunk_stats, (to_chunks(hidden), to_chunks(next_tokens)))
    scored = jnp.arange(seq_len)[None, :] > 0
    if attention_mask is not None:
        scored = scored & attention_mask.astype(bool)
    logprobs = jnp.where(scored, from_chunks(logprobs), 0.0)
    if not return_entropy:
        return logprobs
    return logprobs, jnp.where(scored, from_chunks(entropy), 0.0)
