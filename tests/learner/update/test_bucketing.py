"""Bucketing: a stream of batches of varying shapes compiles a handful of programs; padding is inert."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from learner.update.batch import TrainBatch
from learner.update.bucketing import BucketConfig, bucket_length, pad_batch


def _random_batch(rng: np.random.Generator, rows: int, columns: int) -> TrainBatch:
    lengths = rng.integers(1, columns + 1, rows)
    real = np.arange(columns)[None, :] < lengths[:, None]
    values = lambda dtype: np.where(real, rng.normal(size=(rows, columns)), 0).astype(dtype)  # noqa: E731
    return TrainBatch(tokens=np.where(real, rng.integers(1, 100, (rows, columns)), 0).astype(np.int32),
                        positions=np.broadcast_to(np.arange(columns, dtype=np.int32), (rows, columns)),
                        attention_mask=real, loss_mask=real.astype(np.float32), advantages=values(np.float32),
                        rollout_logprobs=values(np.float32), policy_version=np.ones((rows, columns), np.int32))


def test_a_stream_of_varied_batches_compiles_a_handful_of_programs():
    # The compiled programs of every jitted function share one LRU cache per process (8192 entries): after many tests
    # in this worker it would evict this test's programs mid-count. Start it empty.
    jax.clear_caches()
    @jax.jit
    def weighted_sum(batch):
        return jnp.sum(batch.loss_mask * batch.advantages * jnp.exp(batch.rollout_logprobs))

    config = BucketConfig(min_length=32, max_length=512)
    rng = np.random.default_rng(0)
    raw_shapes, bucketed_shapes = set(), set()
    for _ in range(40):
        batch = _random_batch(rng, rows=int(rng.integers(3, 17)), columns=int(rng.integers(5, 400)))
        padded = pad_batch(batch, config, row_multiple=8)
        raw_shapes.add(batch.tokens.shape)
        bucketed_shapes.add(padded.tokens.shape)
        want = np.sum(batch.loss_mask * batch.advantages * np.exp(batch.rollout_logprobs, dtype=np.float64))
        np.testing.assert_allclose(weighted_sum(padded), want, rtol=1e-4)
    assert weighted_sum._cache_size() == len(bucketed_shapes) <= 10  # rows {8, 16} x lengths {32, ..., 512}
    assert len(raw_shapes) > 30
    assert {rows for rows, _ in bucketed_shapes} <= {8, 16}
    assert {length for _, length in bucketed_shapes} <= {32, 64, 128, 256, 512}


def test_pad_batch_keeps_real_entries_and_masks_the_padding():
    batch = _random_batch(np.random.default_rng(1), rows=5, columns=40)
    batch = batch.replace(attention_mask=batch.attention_mask & (np.arange(40) < 37))  # last 3 columns unused
    padded = pad_batch(batch, BucketConfig(min_length=16, multiple=24), row_multiple=4)
    assert padded.tokens.shape == (8, 48)
    for name in ("tokens", "attention_mask", "loss_mask", "advantages", "rollout_logprobs", "policy_version"):
        got, want = getattr(padded, name), getattr(batch, name)
        np.testing.assert_array_equal(got[:5, :37], np.asarray(want)[:, :37], err_msg=name)
        assert not np.any(got[5:]) and not np.any(got[:, 37:]), name


@pytest.mark.parametrize("config, lengths, want", [
    (BucketConfig(min_length=128), (1, 128, 129, 1000), (128, 128, 256, 1024)),
    (BucketConfig(min_length=128, multiple=128), (1, 129, 256, 257), (128, 256, 256, 384)),
    (BucketConfig(min_length=32, max_length=48), (20, 40, 48), (32, 48, 48)),
])
def test_bucket_lengths(config, lengths, want):
    assert tuple(bucket_length(n, config) for n in lengths) == want


def test_invalid_settings_are_rejected():
    with pytest.raises(ValueError, match="exceeds BucketConfig.max_length"):
        bucket_length(49, BucketConfig(min_length=32, max_length=48))
    with pytest.raises(ValueError, match="min_length"):
        BucketConfig(min_length=0)
    with pytest.raises(ValueError, match="below min_length"):
        BucketConfig(min_length=64, max_length=32)
