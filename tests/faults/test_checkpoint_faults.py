"""Damaged checkpoints: restore verifies each one against its manifest, falls back to the newest that verifies and
names the one it skipped; retention keeps the newest verified checkpoint."""

import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
from etils import epath

from learner.checkpoints.checkpointer import MANIFEST, CheckpointConfig, Checkpointer, verify_manifest

NOISE = np.random.default_rng(0).standard_normal(4096).astype(np.float32)  # incompressible: real array bytes


def _state(value: float):
    return {"w": jnp.asarray(NOISE + value)}


def _save_steps(directory, steps, keep_last=3):
    with Checkpointer(CheckpointConfig(str(directory), keep_last=keep_last)) as checkpointer:
        for step in steps:
            checkpointer.save(step, _state(step), policy_version=step)


def _largest_file(step_dir: pathlib.Path) -> pathlib.Path:
    return max((p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST), key=lambda p: p.stat().st_size)


def _flip_bytes(path: pathlib.Path, count: int = 64) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + count] = bytes(b ^ 0xFF for b in data[middle:middle + count])
    path.write_bytes(bytes(data))


def _truncate(path: pathlib.Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


@pytest.mark.parametrize("damage, reason", [(_flip_bytes, "sha256"), (_truncate, "bytes, the manifest says")])
def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous_one(tmp_path, damage, reason):
    _save_steps(tmp_path, [1, 2, 3])
    assert all((tmp_path / str(step) / MANIFEST).exists() for step in (1, 2, 3))
    damaged = _largest_file(tmp_path / "3")
    damage(damaged)
    with Checkpointer(CheckpointConfig(str(tmp_path))) as checkpointer:
        with pytest.warns(UserWarning, match=f"skipping checkpoint 3.*{damaged.name}"):
            restored = checkpointer.restore(_state(0.0))
        assert restored.step == 2
        np.testing.assert_array_equal(np.asarray(restored.state["w"]), NOISE + 2.0)
        [skipped] = restored.skipped
        assert skipped.startswith("checkpoint 3: ") and str(damaged.relative_to(tmp_path / "3")) in skipped
        assert reason in skipped
        assert checkpointer.all_steps() == [1, 2]  # step 3 set aside, so the run can save it again
        checkpointer.save(3, _state(33.0), policy_version=3)
        np.testing.assert_array_equal(np.asarray(checkpointer.restore(_state(0.0)).state["w"]), NOISE + 33.0)
    assert (tmp_path / "3.unverified").is_dir()
    with pytest.raises(ValueError, match="checkpoint 2 .* fails verification"):
        _flip_bytes(_largest_file(tmp_path / "2"))
        with Checkpointer(CheckpointConfig(str(tmp_path))) as checkpointer:
            checkpointer.restore(_state(0.0), step=2)


def test_a_checkpoint_without_manifest_that_fails_to_load_is_skipped_naming_the_error(tmp_path):
    _save_steps(tmp_path, [1, 2])
    for step in (1, 2):
        (tmp_path / str(step) / MANIFEST).unlink()  # as if saved before manifests existed
    (tmp_path / "2" / "metadata" / "metadata").write_text("{not json")
    with Checkpointer(CheckpointConfig(str(tmp_path))) as checkpointer:
        with pytest.warns(UserWarning, match="skipping checkpoint 2.*load failed"):
            restored = checkpointer.restore(_state(0.0))
    assert restored.step == 1 and "load failed" in restored.skipped[0]


def test_retention_keeps_the_newest_verified_checkpoint(tmp_path):
    _save_steps(tmp_path, [1], keep_last=1)
    with Checkpointer(CheckpointConfig(str(tmp_path), keep_last=1)) as checkpointer:
        checkpointer.save(2, _state(2.0), policy_version=2)
        checkpointer.wait_until_finished()
        (tmp_path / "2" / MANIFEST).unlink()  # as if saved before manifests existed
        assert checkpointer.all_steps() == [1, 2]  # keep_last=1, yet step 1 (the newest verified) stays
        checkpointer.save(3, _state(3.0), policy_version=3)
        checkpointer.wait_until_finished()
        assert 2 not in checkpointer.all_steps() and 3 in checkpointer.all_steps()


def test_the_manifest_is_part_of_the_commit(tmp_path):
    """The moment ``<step>`` exists (orbax's rename of the finished save), its manifest is in it: a process killed
    at any moment leaves no committed checkpoint that cannot be verified."""
    with Checkpointer(CheckpointConfig(str(tmp_path))) as checkpointer:
        checkpointer.save(1, _state(1.0), policy_version=1)
        while not (tmp_path / "1").exists():
            pass
        assert (tmp_path / "1" / MANIFEST).exists()
        checkpointer._manager.wait_until_finished()  # orbax's wait alone, none of ours
        assert (tmp_path / "1" / MANIFEST).exists()
    assert verify_manifest(epath.Path(tmp_path / "1")) is None


def test_a_damaged_checkpoint_without_manifest_is_not_restored_while_a_verified_one_exists(tmp_path):
    _save_steps(tmp_path, [1, 2])
    (tmp_path / "2" / MANIFEST).unlink()
    _flip_bytes(_largest_file(tmp_path / "2"))  # loads fine, wrong values: only a manifest could tell
    with Checkpointer(CheckpointConfig(str(tmp_path))) as checkpointer:
        with pytest.warns(UserWarning, match=f"skipping checkpoint 2.*no {MANIFEST}.*checkpoint 1 can"):
            restored = checkpointer.restore(_state(0.0))
    assert restored.step == 1 and "cannot be verified" in restored.skipped[0]
    np.testing.assert_array_equal(np.asarray(restored.state["w"]), NOISE + 1.0)
    assert (tmp_path / "2.unverified").is_dir()


def test_a_checkpoint_without_manifest_is_restored_with_a_warning_when_none_has_one(tmp_path):
    _save_steps(tmp_path, [1])
    (tmp_path / "1" / MANIFEST).unlink()
    with Checkpointer(CheckpointConfig(str(tmp_path))) as checkpointer:
        with pytest.warns(UserWarning, match=f"checkpoint 1 .* has no {MANIFEST}: restoring it unverified"):
            restored = checkpointer.restore(_state(0.0))
    assert restored.step == 1 and restored.skipped == ()
