"""Per-token log-probabilities (and entropies) computed in chunks of the token axis, optionally over a window.

Full float32 logits ``[B, T, V]`` are the largest tensor of an RL step on a language model (8 x 4096 x 128k x 4 bytes
= 16 GiB). Here the output projection, log-softmax and gather run one chunk of at most ``chunk_size`` tokens at a
time under `jax.lax.map` with `jax.checkpoint`, so only ``[B, chunk_size, V]`` logits exist at once, in the forward
pass and in the backward pass (which recomputes each chunk's logits instead of storing them). The scored positions
are split into chunks of equal size (at most ``chunk_size``), so the last chunk is not mostly padding.

Rematerialisation is chosen from the shape (``remat=None``): it is what keeps the backward pass at one chunk of
logits when there are several chunks, and buys nothing when the scored positions fit in one: the backward pass
starts at the output head, so the stored logits are freed before anything else is allocated, and recomputing them
would cost one more pass through the output projection (2 B T D V FLOPs). One chunk also runs without
`jax.lax.map`. ``remat=True`` / ``False`` forces it either way (``False`` with several chunks keeps every chunk's
logits for the backward pass: the memory of the unchunked computation).

Scored window: an RL loss reads logprobs only at the completion's tokens, yet the output head is a quarter of a
small model's FLOPs and, with long prompts, most of them. With ``window_size=W`` (static) and ``window_start``
(``[B]``, traced) only the tokens ``t`` in ``[window_start[b], window_start[b] + W)`` are scored: the hidden states
at ``t - 1`` and the targets at ``t`` are gathered into ``[B, W]`` (`learner.model.take_window`), the head
runs on
those alone, and the results are placed back at their ``[B, T]`` columns (`learner.model.place_window`; both
directions and their gradients are gathers, no scatter). Each row's window is shifted as little as needed to lie
inside ``[1, T)``, so it covers every requested token that exists; tokens outside the request are 0 like unscored
ones. A window covering ``[1, T)`` (``W >= T - 1``) runs the whole-sequence path and masks it. A token outside its
row's window silently gets 0: callers check that every trained token lies in it
(`learner.rl.batch_assembly.check_scored_window`). `token_logprobs` goes one step further: the model's last block runs
its
queries, attention output and MLP only at the window (``Transformer(..., output_window=...)``; keys and values
everywhere): with W = T / 2 that is about half the last block's work (~4% of the blocks' FLOPs in a twelve-layer
model).

Alignment: outputs are aligned with the scored token. ``logprobs[:, t] = log p(tokens[:, t] | tokens[:, :t])``, the
probability the model gave (at hidden position ``t - 1``) to the token that sits at ``t``. This lines up with token
ids, loss masks and the per-token logprobs an inference server returns for the tokens it sampled. Column 0 (no
prefix), padded tokens (``attention_mask`` False) and tokens outside the window are 0.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from learner.logprobs.sampler_replay import SamplerParams, replayed_token_stats
from learner.model.transformer import Transformer, place_window, take_window


def token_logprobs(model: Transformer, tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array, *,
                   temperature: float | jax.Array = 1.0, chunk_size: int = 512, remat: bool | None = None,
                   return_entropy: bool = False, sampling: SamplerParams | None = None,
                   window_start: jax.Array | None = None, window_size: int | None = None):
    """Log-probabilities of each token under the model at a sampling temperature, or under the replayed sampler.

    Args:
        model: the transformer.
        tokens: ``[B, T]`` int token ids, right-padded.
        positions: ``[B, T]`` int positions.
        attention_mask: ``[B, T]``, True / 1 for real tokens.
        temperature: logits are divided by it before the log-softmax (the sampler's temperature).
        chunk_size: tokens per chunk at most; peak logits memory is ``B * chunk_size * V * 4`` bytes.
        remat: recompute each chunk's logits in the backward pass instead of storing them; None (default): only
            when there are several chunks (see the module docstring).
        return_entropy: also return the entropy of each predictive distribution, aligned like the logprobs.
        sampling: per-sequence ``[B]`` sampling parameters to replay (PROCESSED logprobs): temperature, then top-k,
            top-p, min-p as the server applied them (see `learner.logprobs.sampler_replay`); ``temperature`` must then
            stay
            1.0. None (default): plain ``log_softmax(logits / temperature)``.
        window_start: ``[B]`` int, the first scored token of each row; with ``window_size``.
        window_size: static int, tokens scored per row from ``window_start`` (see the module docstring); None
            (default): every token.

    Returns:
        ``[B, T]`` float32 logprobs (aligned with the scored token, see the module docstring), or
        ``(logprobs, entropy)`` when ``return_entropy``.

    Example:
        >>> from flax import nnx
        >>> from learner.model.transformer import model_config
        >>> model = Transformer(model_config("tiny"), rngs=nnx.Rngs(0))
        >>> tokens = jnp.array([[5, 6, 7, 0]])
        >>> lp = token_logprobs(model, tokens, jnp.arange(4)[None], tokens > 0, chunk_size=2)
        >>> lp.shape, bool(lp[0, 0] == 0), bool(lp[0, 3] == 0), bool(lp[0, 1] < 0)
        ((1, 4), True, True, True)
        >>> windowed = token_logprobs(model, tokens, jnp.arange(4)[None], tokens > 0, window_start=jnp.array([2]),
        ...                           window_size=1)
        >>> bool(windowed[0, 1] == 0), bool(jnp.allclose(windowed[0, 2], lp[0, 2], atol=1e-6))
        (True, True)
    """
    _check_window(window_start, window_size)
    output_window = None
    if window_size is not None and window_size < tokens.shape[1] - 1:
        output_window = (scored_window_first(window_start, window_size, tokens.shape[1]) - 1, window_size)
    hidden = model(tokens, positions, attention_mask, output_window=output_window)
    return logprobs_from_hidden(hidden, model.output_kernel(), tokens, attention_mask, temperature=temperature,
                                chunk_size=chunk_size, remat=remat, return_entropy=return_entropy, sampling=sampling,
                                window_start=window_start, window_size=window_size)


def logprobs_from_hidden(hidden: jax.Array, output_kernel: jax.Array, tokens: jax.Array,
                         attention_mask: jax.Array | None = None, *, temperature: float | jax.Array = 1.0,
                         chunk_size: int = 512, remat: bool | None = None, return_entropy: bool = False,
                         sampling: SamplerParams | None = None, window_start: jax.Array | None = None,
                         window_size: int | None = None):
    """`token_logprobs` from final hidden states and the ``[D, V]`` output projection.

    ``hidden`` is ``[B, T, D]``, or with a scored window of ``W < T - 1`` tokens ``[B, W, D]``: only the states
    that predict the window's tokens, at columns ``scored_window_first(window_start, W, T) - 1 + [0, W)`` (what
    ``Transformer(..., output_window=...)`` returns there).

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
    out = map_token_chunks(stats, hidden, output_kernel, tokens, attention_mask, chunk_size=chunk_size, remat=remat,
                           window_start=window_start, window_size=window_size)
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
                     chunk_size: int = 512, remat: bool | None = None, window_start: jax.Array | None = None,
                     window_size: int | None = None) -> dict[str, jax.Array]:
    """Per-token statistics of the next-token logits, one chunk of the scored tokens at a time.

    Args:
        token_stats: ``(logits [B, C, V] float32, targets [B, C]) -> {name: [B, C]}``, the statistics of the
            distribution at each hidden position and the token that follows it.
        hidden: ``[B, T, D]``, or ``[B, W, D]`` at the window (see `logprobs_from_hidden`).
        output_kernel, tokens, attention_mask, chunk_size, remat, window_start, window_size: as in
            `token_logprobs`.

    Returns:
        ``{name: [B, T]}`` aligned with the scored token (see the module docstring), 0 where not scored.
    """
    _check_window(window_start, window_size)
    seq_len = tokens.shape[1]
    scored = jnp.arange(seq_len)[None, :] > 0
    if attention_mask is not None:
        scored = scored & attention_mask.astype(bool)
    if window_size is None or window_size >= seq_len - 1:  # every token (a window covering [1, T) is all of them)
        stats = _chunked_stats(token_stats, hidden[:, :-1], output_kernel, tokens[:, 1:], chunk_size, remat)
        stats = {name: jnp.pad(value, ((0, 0), (1, 0))) for name, value in stats.items()}
    else:
        # Hidden column - 1 predicts the token at column; column t holds window entry t - first[b] when that is in
        # [0, W).
        first = scored_window_first(window_start, window_size, seq_len)
        if hidden.shape[1] == seq_len:
            hidden = take_window(hidden, first - 1, window_size)
        elif hidden.shape[1] != window_size:
            raise ValueError(f"hidden has {hidden.shape[1]} positions: give all {seq_len} or the window's "
                             f"{window_size}.")
        stats = _chunked_stats(token_stats, hidden, output_kernel, take_window(tokens, first, window_size),
                               chunk_size, remat)
        stats = {name: place_window(value, first, seq_len) for name, value in stats.items()}
    if window_size is not None:
        offset = jnp.arange(seq_len)[None, :] - window_start[:, None]
        scored = scored & (offset >= 0) & (offset < window_size)
    return {name: jnp.where(scored, value, 0.0) for name, value in stats.items()}


def scored_window_first(window_start: jax.Array, window_size: int, seq_len: int) -> jax.Array:
    """``[B]`` first column of each row's scored tokens ``first[b] + [0, W)``: ``window_start`` shifted as little as
    needed for them to lie in ``[1, T)`` (needs ``W < T``).

    Example:
        >>> scored_window_first(jnp.array([0, 3, 9]), 2, 6).tolist()
        [1, 3, 4]
    """
    return jnp.clip(window_start, 1, seq_len - window_size).astype(jnp.int32)


def _check_window(window_start, window_size) -> None:
    if (window_start is None) != (window_size is None):
        raise ValueError("window_start and window_size go together: give both (a scored window) or neither.")
    if window_size is not None and (isinstance(window_size, bool) or not isinstance(window_size, int)
                                    or window_size < 1):
        raise ValueError(f"window_size={window_size!r} must be a static int >= 1.")


def _chunked_stats(token_stats, hidden: jax.Array, output_kernel: jax.Array, targets: jax.Array, chunk_size: int,
                   remat: bool | None) -> dict[str, jax.Array]:
    """``token_stats`` of ``hidden [B, N, D]`` predicting ``targets [B, N]``, in equal chunks of at most
    ``chunk_size``; ``{name: [B, N]}``."""
    batch, length, _ = hidden.shape
    num_chunks = max(math.ceil(length / chunk_size), 1)
    chunk_size = math.ceil(length / num_chunks)
    if remat is None:
        remat = num_chunks > 1

    def chunk_stats(chunk):
        chunk_hidden, chunk_targets = chunk
        logits = jnp.einsum("bcd,dv->bcv", chunk_hidden, output_kernel, preferred_element_type=jnp.float32)
        return token_stats(logits, chunk_targets)

    if remat:
        chunk_stats = jax.checkpoint(chunk_stats)
    if num_chunks == 1:
        return chunk_stats((hidden, targets))
    padding = num_chunks * chunk_size - length
    hidden = jnp.pad(hidden, ((0, 0), (0, padding), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, padding)))

    def to_chunks(x):  # [B, num_chunks * chunk_size, ...] -> [num_chunks, B, chunk_size, ...]
        return jnp.swapaxes(x.reshape(batch, num_chunks, chunk_size, *x.shape[2:]), 0, 1)

    stats = jax.lax.map(chunk_stats, (to_chunks(hidden), to_chunks(targets)))
    return {name: jnp.swapaxes(value, 0, 1).reshape(batch, -1)[:, :length] for name, value in stats.items()}
