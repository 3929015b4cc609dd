"""Per-token log-probabilities (and entropies) computed in chunks of the token axis.

Full float32 logits ``[B, T, V]`` are the largest tensor of an RL step on a language model (8 x 4096 x 128k x 4 bytes
= 16 GiB). Here the output projection, log-softmax and gather run one chunk of ``chunk_size`` tokens at a time under
`jax.lax.map` with `jax.checkpoint`, so only ``[B, chunk_size, V]`` logits exist at once, in the forward pass and in
the backward pass (which recomputes each chunk's logits instead of storing them).

Rematerialisation is chosen from the shape (``remat=None``): it is what keeps the backward pass at one chunk of
logits when there are several chunks, and buys nothing when the sequence fits in one (``T <= chunk_size``): the
backward pass starts at the output head, so the stored logits are freed before anything else is allocated, and
recomputing them would cost one more pass through the output projection (2 B T D V FLOPs). One chunk also runs
without `jax.lax.map`. ``remat=True`` / ``False`` forces it either way (``False`` with several chunks keeps every
chunk's logits for the backward pass: the memory of the unchunked computation).

Alignment: outputs are aligned with the scored token. ``logprobs[:, t] = log p(tokens[:, t] | tokens[:, :t])``, the
probability the model gave (at hidden position ``t - 1``) to the token that sits at ``t``. This lines up with token
ids, loss masks and the per-token logprobs an inference server returns for the tokens it sampled. Column 0 (no
prefix) and padded tokens (``attention_mask`` False) are 0.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from learner.model import Transformer
from learner.sampler_replay import SamplerParams
from learner.sampler_replay import replayed_token_stats


def token_logprobs(model: Transformer, tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array, *,
                   temperature: float | jax.Array = 1.0, chunk_size: int = 512, remat: bool | None = None,
                   return_entropy: bool = False, sampling: SamplerParams | None = None):
    """Log-probabilities of each token under the model at a sampling temperature, or under the replayed sampler.

    Args:
        model: the transformer.
        tokens: ``[B, T]`` int token ids, right-padded.
        positions: ``[B, T]`` int positions.
        attention_mask: ``[B, T]``, True / 1 for real tokens.
        temperature: logits are divided by it before the log-softmax (the sampler's temperature).
        chunk_size: tokens per chunk; peak logits memory is ``B * chunk_size * V * 4`` bytes.
        remat: recompute each chunk's logits in the backward pass instead of storing them; None (default): only
            when there are several chunks (see the module docstring).
        return_entropy: also return the entropy of each predictive distribution, aligned like the logprobs.
        sampling: per-sequence ``[B]`` sampling parameters to replay (PROCESSED logprobs): temperature, then top-k,
            top-p, min-p as the server applied them (see `learner.sampler_replay`); ``temperature`` must then stay
            1.0. None (default): plain ``log_softmax(logits / temperature)``.

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
                                chunk_size=chunk_size, remat=remat, return_entropy=return_entropy, sampling=sampling)


def logprobs_from_hidden(hidden: jax.Array, output_kernel: jax.Array, tokens: jax.Array,
                         attention_mask: jax.Array | None = None, *, temperature: float | jax.Array = 1.0,
                         chunk_size: int = 512, remat: bool | None = None, return_entropy: bool = False,
                         sampling: SamplerParams | None = None):
    """`token_logprobs` from final hidden states ``[B, T, D]`` and the ``[D, V]`` output projection.

    Example:
        >>> lp = logprobs_from_hidden(jnp.ones((1, 3, 4)), jnp.zeros((4, 8)), jnp.array([[1, 2, 3]]))
        >>> bool(jnp.allclose(lp, jnp.array([[0.0, -jnp.log(8.0), -jnp.log(8.0)]])))
        True
    """
    if sampling is None:
        stats = functools.partial(_plain_token_stats, temperature=temperature, with_entropy=return_entropy)
    else:
        if isinstance(temperature, (int, float)) and temperature != 1.0:
            raise ValueError(f"temperature={temperature}: with `sampling`, the per-sequence sampling.temperature "
                             "is used; leave temperature at 1.0")
        stats = functools.partial(replayed_token_stats, sampling=sampling, with_entropy=return_entropy)
    out = map_token_chunks(stats, hidden, output_kernel, tokens, attention_mask, chunk_size=chunk_size, remat=remat)
    if not return_entropy:
        return out["logprobs"]
    return out["logprobs"], out["entropy"]


def _plain_token_stats(logits, targets, *, temperature, with_entropy):
    """Logprobs (and entropy) of targets under ``softmax(logits / temperature)``."""
    logits = logits / temperature
    log_normalizer = jax.nn.logsumexp(logits, axis=-1)
    target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    stats = {"logprobs": target_logits - log_normalizer}
    if with_entropy:
        stats["entropy"] = log_normalizer - jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1)
    return stats


def map_token_chunks(token_stats: Callable[[jax.Array, jax.Array], dict[str, jax.Array]], hidden: jax.Array,
                     output_kernel: jax.Array, tokens: jax.Array, attention_mask: jax.Array | None = None, *,
                     chunk_size: int = 512, remat: bool | None = None) -> dict[str, jax.Array]:
    """Per-token statistics of the next-token logits, one chunk of the token axis at a time.

    Args:
        token_stats: ``(logits [B, C, V] float32, targets [B, C]) -> {name: [B, C]}``, the statistics of the
            distribution at each hidden position and the token that follows it.
        hidden, output_kernel, tokens, attention_mask, chunk_size, remat: as in `logprobs_from_hidden`.

    Returns:
        ``{name: [B, T]}`` aligned with the scored token (see the module docstring), 0 where not scored.
    """
    batch, seq_len, _ = hidden.shape
    chunk_size = min(chunk_size, seq_len)
    num_chunks = math.ceil(seq_len / chunk_size)
    if remat is None:
        remat = num_chunks > 1

    def chunk_stats(chunk):
        chunk_hidden, chunk_targets = chunk
        logits = jnp.einsum("bcd,dv->bcv", chunk_hidden, output_kernel, preferred_element_type=jnp.float32)
        return token_stats(logits, chunk_targets)

    if remat:
        chunk_stats = jax.checkpoint(chunk_stats)
    if num_chunks == 1:  # the hidden state at the last position scores nothing
        stats = chunk_stats((hidden[:, :-1], tokens[:, 1:]))
        return _scored({name: jnp.pad(value, ((0, 0), (1, 0))) for name, value in stats.items()}, attention_mask)
    padded_len = num_chunks * chunk_size
    next_tokens = jnp.pad(tokens[:, 1:], ((0, 0), (0, padded_len - seq_len + 1)))
    hidden = jnp.pad(hidden, ((0, 0), (0, padded_len - seq_len), (0, 0)))

    def to_chunks(x):  # [B, padded_len, ...] -> [num_chunks, B, chunk_size, ...]
        return jnp.swapaxes(x.reshape(batch, num_chunks, chunk_size, *x.shape[2:]), 0, 1)

    def from_chunks(x):  # [num_chunks, B, chunk_size] -> [B, seq_len], shifted onto the scored token
        x = jnp.swapaxes(x, 0, 1).reshape(batch, padded_len)[:, : seq_len - 1]
        return jnp.pad(x, ((0, 0), (1, 0)))

    stats = jax.lax.map(chunk_stats, (to_chunks(hidden), to_chunks(next_tokens)))
    return _scored({name: from_chunks(value) for name, value in stats.items()}, attention_mask)


def _scored(stats: dict[str, jax.Array], attention_mask: jax.Array | None) -> dict[str, jax.Array]:
    """``stats`` ``[B, T]`` (aligned with the scored token), 0 at column 0 and at padding."""
    seq_len = next(iter(stats.values())).shape[1]
    scored = jnp.arange(seq_len)[None, :] > 0
    if attention_mask is not None:
        scored = scored & attention_mask.astype(bool)
    return {name: jnp.where(scored, value, 0.0) for name, value in stats.items()}
