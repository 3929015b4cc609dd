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
