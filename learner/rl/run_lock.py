"""One run per run directory: an exclusive lock on ``<run_dir>/run.lock`` held while a `Run` is open.

Two runs writing one directory interleave their metrics, corrupt the rollout log and fight over checkpoints, so the
second is refused at once, naming the holder (pid, host, start time) written in the lock file. The lock is an
``flock``: the kernel releases it when its process dies, however it dies (SIGKILL included), so a stale lock file
is simply taken over by the next run. A lock file that is a link or not a regular file is refused
(`learner.reporting.run_files`). A multi-host run holds it on process 0 (the caller decides which process).
File systems without ``flock`` support (some network mounts) raise the OS error instead of silently sharing.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import pathlib
import socket
from collections.abc import Iterator

from learner.reporting.run_files import open_run_file

LOCK_FILE = "run.lock"


class RunDirLockedError(RuntimeError):
    """Another live process holds the run directory."""


@contextlib.contextmanager
def hold_run_dir(run_dir: pathlib.Path) -> Iterator[None]:
    """Holds ``run_dir``'s lock for the duration of the block.

    Raises:
        RunDirLockedError: another process holds it (the message names its pid and host).
        UnsafeRunDirError: the lock file is a symbolic link (written through, it would change a file outside
          run_dir), a directory or another non-regular file.
    """
    path = run_dir / LOCK_FILE
    descriptor = open_run_file(path, os.O_RDWR | os.O_CREAT)  # never through a link; not inherited by children
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirLockedError(f"run_dir {run_dir} is in use by another run ({_holder(path)}); wait for it to "
                                    "end, or set another run_dir") from None
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, json.dumps(holder).encode(), 0)
        yield
    finally:
        os.close(descriptor)  # releases the flock


def _holder(path: pathlib.Path) -> str:
    """The holder as its lock file names it."""
    try:
        holder = json.loads(path.read_text())
        return f"pid {holder['pid']} on host {holder['host']}, started {holder['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return f"holder not recorded in {path} yet"
