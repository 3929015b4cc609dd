"""Pads rollout batches to a few fixed shapes, so a run compiles a handful of update programs, not one per batch.

Every distinct ``[B, T]`` is a new XLA program (tens of seconds of compilation each). Rollout lengths vary from
batch to batch, so the token axis is cut to the longest real row and padded up to a bucket length (powers of two
from ``min_length``, or multiples of ``multiple``), and the row axis is padded to a multiple of the update's
``num_minibatches * num_microbatches * data_parallel`` (`learner.update.UpdateConfig.row_multiple`). Padding is
fully masked (attention and loss masks 0), so it changes no loss and no gradient; padded rows' sampling parameters
are neutral (`learner.logprobs.sampler_replay.NEUTRAL`). Runs on host NumPy arrays, before the batch is put on devices.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from learner.update.batch import TrainBatch


@dataclasses.dataclass(frozen=True)
class BucketConfig:
    """Bucket lengths of the token axis; validated when built.

    Example:
        >>> BucketConfig(min_length=256, multiple=128)
        BucketConfig(min_length=256, multiple=128, max_length=None)
    """

    min_length: int = 128  # shortest bucket.
    multiple: int | None = None  # None: buckets are min_length * 2^k; else multiples of this (at least min_length).
    max_length: int | None = None  # longest allowed bucket (e.g. the model's max_seq_len); None: unbounded.

    def __post_init__(self):
        for name in ("min_length", "multiple", "max_length"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"BucketConfig.{name}={value!r} must be an int >= 1" +
                                 ("." if name == "min_length" else " or None."))
        if self.max_length is not None and self.max_length < self.min_length:
            raise ValueError(f"BucketConfig.max_length={self.max_length} is below min_length={self.min_length}.")


def bucket_length(length: int, config: BucketConfig) -> int:
    """The smallest bucket length that holds ``length`` tokens.

    Example:
        >>> [bucket_length(n, BucketConfig(min_length=32)) for n in (1, 32, 33, 200)]
        [32, 32, 64, 256]
        >>> [bucket_length(n, BucketConfig(min_length=256, multiple=128)) for n in (1, 256, 257, 300)]
        [256, 256, 384, 384]
    """
    if config.multiple is None:
        bucket = config.min_length
        while bucket < length:
            bucket *= 2
    else:
        bucket = max(config.min_length, -(-length // config.multiple) * config.multiple)
    if config.max_length is not None and bucket > config.max_length:
        if length > config.max_length:
            raise ValueError(f"sequence length {length} exceeds BucketConfig.max_length={config.max_length}.")
        bucket = config.max_length
    return bucket


def bucket_lengths(config: BucketConfig) -> list[int]:
    """Every bucket length of a bounded ``config``, shortest first.

    Example:
        >>> bucket_lengths(BucketConfig(min_length=128, multiple=512, max_length=2048))
        [512, 1024, 1536, 2048]
    """
    if config.max_length is None:
        raise ValueError("bucket_lengths needs BucketConfig.max_length.")
    return sorted({bucket_length(length, config) for length in range(1, config.max_length + 1)})


def cut_batch(batch: TrainBatch, length: int) -> TrainBatch:
    """``batch``'s token axis cut (or zero-padded) to ``length`` columns; the per-row leaves (``sampling``,
    ``adapter``) unchanged."""

    def cut(x):
        x = np.asarray(x)[:, :length]
        return np.pad(x, ((0, 0), (0, length - x.shape[1])))

    return jax.tree.map(cut, batch.replace(sampling=None, adapter=None)).replace(sampling=batch.sampling,
                                                                                  adapter=batch.adapter)


def pad_batch(batch: TrainBatch, config: BucketConfig, row_multiple: int = 1) -> TrainBatch:
    """Cuts ``batch`` to its longest real row, then pads T to its bucket and B to a multiple of ``row_multiple``.

    Args:
        batch: host arrays ``[B, T]``, right-padded.
        config: the token-axis buckets.
        row_multiple: rows are padded with fully masked rows to a multiple of this.

    Returns:
        A `TrainBatch` of NumPy arrays ``[B', T']`` (``sampling``, ``adapter``: ``[B']``); the original rows and
        columns first, padding zero (neutral sampling parameters, adapter 0).

    Example:
        >>> tokens = np.array([[1, 2, 3, 0, 0], [4, 5, 0, 0, 0]])
        >>> zeros = np.zeros_like(tokens)
        >>> batch = TrainBatch(tokens, zeros, tokens > 0, zeros, zeros, zeros, zeros)
        >>> pad_batch(batch, BucketConfig(min_length=4), row_multiple=4).tokens.tolist()
        [[1, 2, 3, 0], [4, 5, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    """
    if row_multiple < 1:
        raise ValueError(f"row_multiple={row_multiple} must be >= 1.")
    attention = np.asarray(batch.attention_mask).astype(bool)
    rows, columns = attention.shape
    real_columns = np.flatnonzero(attention.any(axis=0))
    length = int(real_columns[-1]) + 1 if real_columns.size else 1
    target_rows = -(-rows // row_multiple) * row_multiple
    target_columns = bucket_length(length, config)

    def pad(x):
        x = np.asarray(x)[:, :length]
        return np.pad(x, ((0, target_rows - rows), (0, target_columns - x.shape[1])))

    sampling = None if batch.sampling is None else batch.sampling.pad_rows(target_rows)
    adapter = None if batch.adapter is None else np.pad(np.asarray(batch.adapter), (0, target_rows - rows))
    return jax.tree.map(pad, batch.replace(sampling=None, adapter=None)).replace(sampling=sampling, adapter=adapter)
