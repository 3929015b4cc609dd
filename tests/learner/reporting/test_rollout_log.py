"""Rollout log: exact round trip of batches of varied T, reopen and continue, resume from an older step."""

import jax.numpy as jnp
import numpy as np
import pytest

from learner.reporting.rollout_log import TOKEN_FIELDS, LoggedBatch, RolloutLogReader, RolloutLogWriter


def make_batch(step: int, rows: int, length: int, seed: int = 0) -> LoggedBatch:
    """A batch with distinct values in every field, right-padded rows of random lengths."""
    rng = np.random.default_rng((seed, step))
    lengths = rng.integers(1, length + 1, size=rows)
    real = np.arange(length)[None, :] < lengths[:, None]
    loss_mask = (real & (np.arange(length)[None, :] >= 2)).astype(np.float32)
    return LoggedBatch(
        step=step,
        tokens=np.where(real, rng.integers(4, 99, size=(rows, length)), 0).astype(np.int32),
        loss_mask=loss_mask,
        rollout_logprobs=np.where(loss_mask > 0, -rng.exponential(size=(rows, length)), 0).astype(np.float32),
        proximal_logprobs=np.where(loss_mask > 0, -rng.exponential(size=(rows, length)), 0).astype(np.float32),
        rewards=rng.random(rows).astype(np.float32),
        advantages=np.where(loss_mask > 0, rng.normal(size=(rows, 1)), 0).astype(np.float32),
        policy_version=np.where(loss_mask > 0, step - rng.integers(0, 3, size=(rows, length)), 0).astype(np.int32),
        learner_version=step,
    )


def assert_batches_equal(actual: LoggedBatch, expected: LoggedBatch):
    assert actual.step == expected.step
    for name in (*TOKEN_FIELDS, "rewards"):
        got, want = getattr(actual, name), np.asarray(getattr(expected, name))
        assert got.dtype == want.dtype, name
        np.testing.assert_array_equal(got, want, err_msg=name)
    assert actual.learner_version.dtype == np.int32
    np.testing.assert_array_equal(actual.learner_version,
                                  np.broadcast_to(expected.learner_version, expected.rewards.shape))


def test_round_trip_of_batches_of_varied_length(tmp_path):
    batches = [make_batch(step, rows, length) for step, rows, length in [(0, 4, 7), (1, 3, 16), (2, 70, 1), (3, 5, 9)]]
    with RolloutLogWriter(tmp_path / "rollout_log", max_length=16) as writer:
        for batch in batches:
            writer.append(batch)
        assert writer.num_rows == 82
    reader = RolloutLogReader(tmp_path / "rollout_log")
    np.testing.assert_array_equal(reader.steps, [0, 1, 2, 3])
    for batch in batches:
        assert_batches_equal(reader.read(batch.step), batch)
    in_range = reader.read_range(1, 3)
    assert [b.step for b in in_range] == [1, 2]
    for got, want in zip(in_range, batches[1:3]):
        assert_batches_equal(got, want)
    every = list(reader.batches())
    assert len(every) == len(batches)
    for got, want in zip(every, batches):
        assert_batches_equal(got, want)


def test_accepts_jax_arrays(tmp_path):
    batch = make_batch(5, 2, 6)
    as_jax = LoggedBatch(step=5, **{name: jnp.asarray(getattr(batch, name))
                                    for name in (*TOKEN_FIELDS, "rewards", "learner_version")})
    with RolloutLogWriter(tmp_path, max_length=8) as writer:
        writer.append(as_jax)
    assert_batches_equal(RolloutLogReader(tmp_path).read(5), batch)


def test_reopen_after_close_and_continue_appending(tmp_path):
    first = [make_batch(step, 3, 5 + step) for step in range(3)]
    more = [make_batch(step, 2, 8) for step in range(3, 5)]
    with RolloutLogWriter(tmp_path, max_length=8) as writer:
        for batch in first:
            writer.append(batch)
    with RolloutLogWriter(tmp_path) as writer:
        assert writer.max_length == 8 and writer.num_rows == 9
        for batch in more:
            writer.append(batch)
    reader = RolloutLogReader(tmp_path)
    np.testing.assert_array_equal(reader.steps, range(5))
    for batch in first + more:
        assert_batches_equal(reader.read(batch.step), batch)


def test_resume_from_an_older_step_drops_later_batches(tmp_path):
    with RolloutLogWriter(tmp_path, max_length=8) as writer:
        for step in range(4):
            writer.append(make_batch(step, 3, 8))
    rerun = make_batch(2, 5, 4, seed=1)
    with RolloutLogWriter(tmp_path, resume_step=1) as writer:
        assert writer.num_rows == 6
        writer.append(rerun)
    reader = RolloutLogReader(tmp_path)
    np.testing.assert_array_equal(reader.steps, [0, 1, 2])
    assert_batches_equal(reader.read(2), rerun)
    assert_batches_equal(reader.read(1), make_batch(1, 3, 8))


def test_batch_is_indexed_only_once_written(tmp_path):
    writer = RolloutLogWriter(tmp_path, max_length=8)
    writer.append(make_batch(0, 2, 8))
    assert RolloutLogReader(tmp_path).steps.size == 0  # in flight: not in the index yet
    writer.append(make_batch(1, 2, 8))  # waits for batch 0's data, starts its index entry
    writer.flush()
    np.testing.assert_array_equal(RolloutLogReader(tmp_path).steps, [0, 1])


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="pass max_length"):
        RolloutLogWriter(tmp_path / "missing")
    with RolloutLogWriter(tmp_path, max_length=4) as writer:
        with pytest.raises(ValueError, match="length <= 4"):
            writer.append(make_batch(0, 2, 5))
        with pytest.raises(ValueError, match="rows > 0"):
            writer.append(make_batch(0, 0, 3))
    with pytest.raises(ValueError, match="has max_length 4"):
        RolloutLogWriter(tmp_path, max_length=8)
    with pytest.raises(KeyError, match="step 3"):
        RolloutLogReader(tmp_path).read(3)


def test_a_log_written_before_learner_versions_reads_them_as_unknown_and_continues(tmp_path):
    """A log without the ``learner_version`` array (written before it was kept): a reader gives None and adds
    nothing; a writer adds the array, the old rows -1 (unknown), the new ones their version."""
    import shutil

    old = make_batch(0, 3, 5)
    with RolloutLogWriter(tmp_path, max_length=8) as writer:
        writer.append(old)
    shutil.rmtree(tmp_path / "learner_version")
    assert RolloutLogReader(tmp_path).read(0).learner_version is None
    assert not (tmp_path / "learner_version").exists()
    new = make_batch(1, 2, 5)
    with RolloutLogWriter(tmp_path) as writer:
        writer.append(new)
    reader = RolloutLogReader(tmp_path)
    assert reader.read(0).learner_version.tolist() == [-1, -1, -1]
    assert_batches_equal(reader.read(1), new)
