"""A full disk: found in the exception chain (tensorstore's RESOURCE_EXHAUSTED or an ENOSPC OSError), told as one
``error:`` line naming the path, and orbax's background logs of it dropped.

Checked by hand against a real full disk (a 2.5 MB tmpfs as run_dir: one error line, exit 1, checkpoint 2 kept);
mounting one needs root, so these tests build the errors as tensorstore and Python raise them."""

import errno
import logging

import pytest

from learner.reporting.disk_full import DiskFullLogFilter, disk_full_cause
from learner.rl.error_lines import errors_as_lines

TENSORSTORE = ('RESOURCE_EXHAUSTED: Error writing local file "/runs/a/checkpoints/4.orbax-checkpoint-tmp/state/'
               '_sharding": Failed writing: "/runs/a/checkpoints/4.orbax-checkpoint-tmp/state/_sharding": Failed to '
               'write 43 bytes to file 18: No space left on device [os_error_code=28]')


def _chained():
    """A tensorstore error raised while handling a pathless ENOSPC, as a run's close raises it."""
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise ValueError(TENSORSTORE)  # noqa: B904
    except ValueError as error:
        return error


def test_the_cause_names_the_path_wherever_it_is_in_the_chain():
    assert disk_full_cause(_chained()) == ("/runs/a/checkpoints/4.orbax-checkpoint-tmp/state/_sharding: "
                                           "No space left on device")
    assert disk_full_cause(OSError(errno.ENOSPC, "No space left on device", "/runs/a/metrics.jsonl")) == (
        "/runs/a/metrics.jsonl: No space left on device")
    assert disk_full_cause(OSError(errno.EDQUOT, "Disk quota exceeded")) == "Disk quota exceeded"
    assert disk_full_cause(ValueError("RESOURCE_EXHAUSTED: out of memory")) is None
    assert disk_full_cause(OSError(errno.ENOENT, "No such file or directory", "x")) is None


def test_a_full_disk_is_one_error_line_and_other_errors_keep_their_traceback():
    with pytest.raises(SystemExit) as exit_:
        with errors_as_lines(run_dir="/runs/a"):
            raise _chained()
    assert exit_.value.code == ("error: disk full writing under run_dir /runs/a (/runs/a/checkpoints/4.orbax-"
                                "checkpoint-tmp/state/_sharding: No space left on device). Committed checkpoints are "
                                "intact (a partial save is deleted at the next start): free space and rerun the same "
                                "command to resume")
    with pytest.raises(ZeroDivisionError):
        with errors_as_lines(run_dir="/runs/a"):
            1 / 0  # noqa: B018


def test_orbax_logs_of_a_full_disk_are_dropped_and_others_kept():
    log = logging.getLogger("test_disk_full")
    record = log.makeRecord(log.name, logging.ERROR, __file__, 1, "save failed", (), (ValueError, _chained(), None))
    assert not DiskFullLogFilter().filter(record)
    assert not DiskFullLogFilter().filter(log.makeRecord(log.name, logging.ERROR, __file__, 1,
                                                         f"_SignalingThread.run() raised: {TENSORSTORE}", (), None))
    assert DiskFullLogFilter().filter(log.makeRecord(log.name, logging.ERROR, __file__, 1, "other", (), None))


_UNRETRIEVED = """
import asyncio, gc, sys
from learner.reporting.disk_full import quiet_disk_full_logs
from tests.faults.test_disk_full import TENSORSTORE
if sys.argv[1] == "quiet":
    quiet_disk_full_logs()

async def write():
    raise ValueError(TENSORSTORE)

async def save():
    for _ in range(3):  # orbax's pending writes: tasks whose exception nobody retrieves once the save failed
        asyncio.get_running_loop().create_task(write())
    await asyncio.sleep(0.1)

asyncio.run(save())
gc.collect()
"""


@pytest.mark.parametrize("quiet", [True, False])
def test_tasks_failing_on_a_full_disk_log_nothing_after_the_error_line(quiet):
    """Issue #49: the disk-full line was followed by 24 "Task exception was never retrieved" tracebacks from orbax's
    writers (asyncio logs each such task when it is collected); the CLI's filter drops them (a real subprocess)."""
    import subprocess
    import sys

    from tests.e2e.test_main_job import REPO_ROOT, train_env

    done = subprocess.run([sys.executable, "-c", _UNRETRIEVED, "quiet" if quiet else "loud"], cwd=REPO_ROOT,
                          env=train_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    if quiet:
        assert done.stderr == ""
    else:  # the control: without the filter, each task logs its traceback
        assert done.stderr.count("Task exception was never retrieved") == 3
