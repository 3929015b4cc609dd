"""Per-token loss [B, T] -> scalar, as a numerator and a denominator.

Splitting the two lets the learner accumulate numerators over micro-batches and data-parallel shards and divide
once by the global denominator: a true global token mean, never a mean of means. The denominator carries no
gradient (it counts masks).

``mask`` selects the tokens that contribute (after rejection); ``denominator_mask`` is what they are divided by:
the original response mask (SkyRL's current behaviour, slime, AReaL) or the kept mask (verl, older SkyRL).
"""

import jax
import jax.numpy as jnp

from corrections._masked import masked_count, masked_sum


def loss_terms(loss: jax.Array, mask: jax.Array, denominator_mask: jax.Array | None = None, mode: str = "token-mean",
               max_len: int | None = None, count_rows: bool = False) -> tuple[jax.Array, jax.Array]:
    """Returns ``(numerator, denominator)`` of a reduction; the reduced loss is ``numerator / max(denominator, 1)``.

    Modes: ``token-mean`` sum(loss*m) / sum(m_den); ``seq-mean-token-mean`` sum over rows of
    sum_t(loss*m) / sum_t(m_den), over the rows with a non-empty ``m_den``; ``seq-mean-token-sum`` row sums over
    the same row count; ``seq-mean-token-sum-norm`` (Dr. GRPO) sum(loss*m) / (B * max_len), max_len defaulting
    to T; ``token-sum`` sum(loss*m) with denominator 0 (so that summing denominators over micro-batches keeps it
    undivided; the reduced loss divides by ``max(denominator, 1)``). ``count_rows=True`` makes
    ``seq-mean-token-sum-norm`` divide by the rows with a non-empty ``m_den`` times max_len instead of B * max_len:
    verl's Dr. GRPO (``compute``'s ``denominator="kept"``), for weights and masks computed elsewhere.

    >>> import numpy as np
    >>> loss, m = np.array([[1.0, 3.0], [5.0, np.nan]]), np.array([[1, 1], [1, 0]])
    >>> [float(x) for x in loss_terms(loss, m)]
    [9.0, 3.0]
    >>> [float(x) for x in loss_terms(loss, m, mode="seq-mean-token-mean")]
    [7.0, 2.0]
    >>> [float(x) for x in loss_terms(loss, np.array([[1, 1], [0, 0]]), mode="seq-mean-token-sum-norm",
    ...     count_rows=True)]
    [4.0, 2.0]
    """
    loss = jnp.asarray(loss, jnp.float32)
    mask = jnp.asarray(mask)
    denominator_mask = mask if denominator_mask is None else jnp.asarray(denominator_mask)
    row_sums = masked_sum(loss, mask, axis=-1)
    return loss_terms_from_rows(row_sums, masked_count(denominator_mask, axis=-1), mode, max_len or loss.shape[-1],
                                count_rows)


def loss_terms_from_rows(row_sums: jax.Array, row_counts: jax.Array, mode: str, max_len: int, count_rows: bool = False,
                         num_rows: int | jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """``loss_terms`` from per-row loss sums and per-row denominator counts ([B] arrays). ``count_rows`` makes
    ``seq-mean-token-sum-norm`` divide by (rows with a non-zero count) * max_len, as verl does, instead of B * max_len;
    ``num_rows`` stands for B where only some of the rows are the batch's (e.g. one LoRA adapter's rows).

    >>> [float(x) for x in loss_terms_from_rows(jnp.array([3.0, 0.0]), jnp.array([2.0, 0.0]),
    ...                                         "seq-mean-token-sum-norm", 4, count_rows=True)]
    [3.0, 4.0]
    """
    rows = jnp.sum((row_counts > 0).astype(jnp.float32))
    if mode == "token-mean":
        return jnp.sum(row_sums), jnp.sum(row_counts)
    if mode == "seq-mean-token-mean":
        return jnp.sum(row_sums / jnp.maximum(row_counts, 1.0)), rows
    if mode == "seq-mean-token-sum":
        return jnp.sum(row_sums), rows
    if mode == "seq-mean-token-sum-norm":
        batch_rows = jnp.float32(row_sums.shape[0] if num_rows is None else num_rows)
        return jnp.sum(row_sums), (rows if count_rows else batch_rows) * max_len
    if mode == "token-sum":
        return jnp.sum(row_sums), jnp.float32(0.0)  # no division: 0 adds up over micro-batches
    raise ValueError(f"reduction mode={mode!r} is not an option.")


def divide_loss(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
    """``numerator / max(denominator, 1)``: 0 for an empty batch, never NaN."""
    return numerator / jnp.maximum(jax.lax.stop_gradient(denominator), 1.0)


def reduce_loss(loss: jax.Array, mask: jax.Array, denominator_mask: jax.Array | None = None, mode: str = "token-mean",
                max_len: int | None = None, count_rows: bool = False) -> jax.Array:
    """The scalar loss of ``loss_terms`` (``count_rows``: verl's seq-mean-token-sum-norm, see there).

    >>> import numpy as np
    >>> float(reduce_loss(np.array([[1.0, 3.0], [5.0, 0.0]]), np.array([[1, 1], [1, 0]])))
    3.0
    """
    return divide_loss(*loss_terms(loss, mask, denominator_mask, mode, max_len, count_rows))
