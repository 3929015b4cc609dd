"""Nothing is written outside run_dir through a link: a run.lock that is a link or a directory is refused with one
error line (a real ``python -m learner.train`` each), and every file the run writes itself is opened without
following links (real files)."""

import os
import sys

import pytest

from learner.reporting.metrics_writers import JsonlWriter, read_metrics
from learner.reporting.plots import plot_learning_curves
from learner.reporting.run_files import UnsafeRunDirError, refuse_links, write_atomically
from learner.rl.run import CHECKED_FOR_LINKS
from learner.rl.run_lock import LOCK_FILE, hold_run_dir
from tests.e2e.test_main_job import DEFAULT_CONFIG
from tests.faults.test_error_lines import error_line


def _outside(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("not the run's\n")
    return outside


LOCKS = {  # how run.lock is planted -> what the error line says it is
    "a link to a file outside": (lambda lock, outside: lock.symlink_to(outside), "a symbolic link (to {outside})"),
    "a dangling link": (lambda lock, outside: lock.symlink_to(outside.with_name("created.txt")),
                        "a symbolic link (to {created})"),
    "a directory": (lambda lock, outside: lock.mkdir(), "a directory"),
}


@pytest.mark.parametrize("case", LOCKS)
def test_a_run_lock_that_is_a_link_or_a_directory_is_one_error_line_and_nothing_outside_changes(tmp_path, case):
    plant, what = LOCKS[case]
    run_dir, outside = tmp_path / "run", _outside(tmp_path)
    run_dir.mkdir()
    plant(run_dir / LOCK_FILE, outside)
    line = error_line([sys.executable, "-m", "learner.train", "--config", str(DEFAULT_CONFIG),
                       "--set", f'run_dir="{run_dir}"', "--set", "warmup.steps=0"])
    what = what.format(outside=outside, created=tmp_path / "created.txt")
    assert line == (f"error: {run_dir / LOCK_FILE} is {what}: a run writes only regular files inside its run_dir, "
                    "never through a link; remove it (or set another run_dir)")
    assert outside.read_text() == "not the run's\n" and not (tmp_path / "created.txt").exists()
    assert sorted(path.name for path in run_dir.iterdir()) == [LOCK_FILE]  # nothing else read or written


def test_a_fifo_as_run_lock_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / LOCK_FILE)
    with pytest.raises(UnsafeRunDirError, match="run.lock is not a regular file"):
        with hold_run_dir(tmp_path):
            pass


def test_the_metrics_file_is_never_appended_through_a_link(tmp_path):
    outside = _outside(tmp_path)
    metrics = tmp_path / "metrics.jsonl"
    metrics.symlink_to(outside)
    with pytest.raises(UnsafeRunDirError, match="metrics.jsonl is a symbolic link"):
        JsonlWriter(metrics)
    metrics.unlink()
    metrics.mkdir()
    with pytest.raises(UnsafeRunDirError, match="metrics.jsonl is a directory"):
        JsonlWriter(metrics)
    assert outside.read_text() == "not the run's\n"


def test_replaced_files_replace_a_planted_link_and_leave_its_target_alone(tmp_path):
    """The plot, framework_config.tsv, process_<i>.json and a resumed metrics.jsonl are written to a fresh temporary
    file renamed over the name: a link at the name (or at the temporary's) is replaced, never followed."""
    outside = _outside(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    writer = JsonlWriter(run_dir / "metrics.jsonl")
    for step in (1, 2, 3):
        writer.write(step, {"reward/mean": 0.1 * step})
    writer.close()
    (run_dir / "learning_curves.png").symlink_to(outside)
    (run_dir / "learning_curves.png.tmp").symlink_to(tmp_path / "created.png")
    (run_dir / "metrics.jsonl.tmp").symlink_to(outside)
    plot_learning_curves(run_dir / "metrics.jsonl", run_dir / "learning_curves.png", (("reward", ("reward/mean",)),))
    JsonlWriter(run_dir / "metrics.jsonl", resume_step=2).close()  # drops step 3: rewrites the file
    assert outside.read_text() == "not the run's\n" and not (tmp_path / "created.png").exists()
    assert not (run_dir / "learning_curves.png").is_symlink()
    assert (run_dir / "learning_curves.png").read_bytes().startswith(b"\x89PNG")
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2]
    (run_dir / "framework_config.tsv").mkdir()
    with pytest.raises(UnsafeRunDirError, match="framework_config.tsv is a directory"):
        write_atomically(run_dir / "framework_config.tsv", "table")


@pytest.mark.parametrize("name", CHECKED_FOR_LINKS)
def test_a_link_in_what_libraries_write_is_refused_before_the_run_starts(tmp_path, name):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    refuse_links(run_dir, CHECKED_FOR_LINKS)  # nothing there yet
    (run_dir / name).symlink_to(outside)
    with pytest.raises(UnsafeRunDirError, match=f"{name} is a symbolic link \\(to {outside}\\)"):
        refuse_links(run_dir, CHECKED_FOR_LINKS)
    (run_dir / name).unlink()
    if "." in name:  # a file (the server's log)
        return
    (run_dir / name).mkdir()
    (run_dir / name / "3").mkdir()
    (run_dir / name / "3" / "data").symlink_to(outside / "data")
    with pytest.raises(UnsafeRunDirError, match=f"{name}/3/data is a symbolic link"):
        refuse_links(run_dir, CHECKED_FOR_LINKS)
