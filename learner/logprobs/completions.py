"""The log-likelihood of given completions: ``log p(completion | prompt)`` under a model, at a sampling temperature.

For an exact-match task (reward 1 for one completion, its answer then eos; 0 for any other) the probability of that
completion is the expected reward of a sample at that temperature (no top-k, top-p or min-p). So a policy is scored
exactly on a fixed prompt set, with no sampling noise (scripts/bench/partial.py compares runs so).

Token by token (`completion_token_logprobs`) they are what an engine returns for the tokens it sampled: the publish
canary compares the two (`learner.rl.canary`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from learner.logprobs.chunked import token_logprobs
from learner.model.transformer import Transformer


def _padded_length(length: int) -> int:
    """A power of two (at least 16): few lengths, few compiled programs."""
    return max(16, 1 << (length - 1).bit_length())


@functools.partial(jax.jit, static_argnums=0)
def _completion_token_logprobs(graphdef, state, tokens, completion_mask, temperature):
    model = nnx.merge(graphdef, state)
    real = tokens >= 0
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    logprobs = token_logprobs(model, jnp.where(real, tokens, 0), positions, real, temperature=temperature)
    return jnp.where(completion_mask, logprobs, 0.0)


@functools.partial(jax.jit, static_argnums=0)
def _summed_logprobs(graphdef, state, tokens, completion_mask, temperature):
    return jnp.sum(_completion_token_logprobs(graphdef, state, tokens, completion_mask, temperature), axis=1)


def _padded_batches(model: Transformer, prompts: Sequence[np.ndarray], completions: Sequence[np.ndarray],
                    batch_rows: int) -> Iterator[tuple[int, list, np.ndarray, np.ndarray]]:
    """``(first row, rows, tokens, completion_mask)`` per batch of ``batch_rows`` rows: tokens ``[batch_rows, W]``
    padded with -1 to a power-of-two width ``W``; the mask is True at each row's completion tokens.

    Raises:
        ValueError: the counts differ, a prompt or completion is empty, or a row is longer than the model's context.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    rows = [(np.asarray(p, np.int32), np.asarray(c, np.int32)) for p, c in zip(prompts, completions)]
    if any(p.size == 0 or c.size == 0 for p, c in rows):
        raise ValueError("every prompt and completion needs at least one token")
    context = model.config.max_seq_len
    longest = max((p.size + c.size for p, c in rows), default=0)
    if longest > context:
        raise ValueError(f"a prompt plus its completion is {longest} tokens: more than the model's context of "
                         f"{context}")
    for start in range(0, len(rows), batch_rows):
        chunk = rows[start:start + batch_rows]
        width = min(_padded_length(max(p.size + c.size for p, c in chunk)), context)
        tokens = np.full((batch_rows, width), -1, np.int32)  # -1: padding (full batches: one program per width)
        completion_mask = np.zeros((batch_rows, width), bool)
        for row, (prompt, completion) in enumerate(chunk):
            tokens[row, :prompt.size + completion.size] = np.concatenate([prompt, completion])
            completion_mask[row, prompt.size:prompt.size + completion.size] = True
        yield start, chunk, tokens, completion_mask


def completion_logprobs(model: Transformer, prompts: Sequence[np.ndarray], completions: Sequence[np.ndarray], *,
                        temperature: float = 1.0, batch_rows: int = 256) -> np.ndarray:
    """float64 ``[n]``: ``sum_t log p(completions[i][t] | prompts[i], completions[i][:t])``, each token's
    probability that of ``softmax(logits / temperature)``.

    Rows go through the model ``batch_rows`` at a time, padded to a power-of-two length; the sums over tokens are
    float32 on the device.

    Raises:
        ValueError: the counts differ, a prompt or completion is empty, or a row is longer than the model's context.
    """
    graphdef, state = nnx.split(model)
    sums = np.zeros(len(prompts), np.float64)
    for start, chunk, tokens, completion_mask in _padded_batches(model, prompts, completions, batch_rows):
        summed = _summed_logprobs(graphdef, state, tokens, completion_mask, jnp.float32(temperature))
        sums[start:start + len(chunk)] = np.asarray(summed[:len(chunk)], np.float64)
    return sums


def completion_token_logprobs(model: Transformer, prompts: Sequence[np.ndarray], completions: Sequence[np.ndarray],
                              *, temperature: float = 1.0, batch_rows: int = 256) -> list[np.ndarray]:
    """float32 ``[len(completions[i])]`` per row: ``log p(completions[i][t] | prompts[i], completions[i][:t])``
    token by token (what an engine returns for the tokens it sampled); batched as `completion_logprobs`.

    Raises:
        ValueError: as `completion_logprobs`.
    """
    graphdef, state = nnx.split(model)
    rows = []
    for _, chunk, tokens, completion_mask in _padded_batches(model, prompts, completions, batch_rows):
        logprobs = np.asarray(_completion_token_logprobs(graphdef, state, tokens, completion_mask,
                                                          jnp.float32(temperature)))
        rows += [logprobs[row, prompt.size:prompt.size + completion.size]
                 for row, (prompt, completion) in enumerate(chunk)]
    return rows
