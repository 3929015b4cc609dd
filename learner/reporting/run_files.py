"""Files a run writes under its run directory, opened so that nothing is written outside it through a link.

A symbolic link planted in ``run_dir`` (``metrics.jsonl -> ~/.bashrc``, a dangling ``run.lock -> /tmp/x``) would
make a run overwrite or create a file elsewhere. Every file Tether writes itself is opened with ``O_NOFOLLOW`` and
must be a regular file (`open_for_append`, `open_run_file`), or is written to a fresh temporary file that is then
renamed over the name (`write_atomically`: a rename replaces a link, never writes through it). The directories that
libraries fill (orbax's checkpoints, tensorstore's rollout log) are checked for links before the run starts
(`refuse_links`). Any of these is an `UnsafeRunDirError` naming the path and the fix.
"""

from __future__ import annotations

import errno
import fcntl
import io
import os
import pathlib
import stat


class UnsafeRunDirError(RuntimeError):
    """A path the run writes under run_dir is a symbolic link or not a regular file (directory)."""


def _refusal(path: pathlib.Path, what: str) -> UnsafeRunDirError:
    return UnsafeRunDirError(f"{path} is {what}: a run writes only regular files inside its run_dir, never through "
                             "a link; remove it (or set another run_dir)")


def _link_target(path: pathlib.Path) -> str:
    try:
        return f"a symbolic link (to {os.readlink(path)})"
    except OSError:
        return "a symbolic link"


def open_run_file(path: str | os.PathLike, flags: int, mode: int = 0o644) -> int:
    """A descriptor of the regular file ``path``, opened with ``flags`` | ``O_NOFOLLOW``.

    Opened non-blocking (a FIFO would block an open for writing) and checked with ``fstat`` before blocking mode is
    restored, so a link, a directory, a FIFO or a device is refused without side effects.

    Raises:
      UnsafeRunDirError: ``path`` is a symbolic link (dangling or not) or not a regular file.
    """
    path = pathlib.Path(path)
    try:
        descriptor = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as error:
        if error.errno == errno.ELOOP or path.is_symlink():
            raise _refusal(path, _link_target(path)) from None
        if error.errno == errno.EISDIR or path.is_dir():
            raise _refusal(path, "a directory") from None
        if error.errno == errno.ENXIO:  # a FIFO without a reader
            raise _refusal(path, "not a regular file") from None
        raise
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise _refusal(path, "not a regular file")
    fcntl.fcntl(descriptor, fcntl.F_SETFL, fcntl.fcntl(descriptor, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return descriptor


def open_for_append(path: str | os.PathLike, binary: bool = False) -> io.IOBase:
    """``path`` opened for appending (created if missing), never through a link (`open_run_file`)."""
    descriptor = open_run_file(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    return os.fdopen(descriptor, "ab" if binary else "a")


def write_atomically(path: str | os.PathLike, data: bytes | str) -> None:
    """Replaces ``path``'s contents with ``data``: written to ``<path>.tmp`` (created afresh, never through a link),
    then renamed over ``path`` (a link there is replaced, its target untouched).

    Raises:
      UnsafeRunDirError: ``path`` is a directory.
    """
    path = pathlib.Path(path)
    if path.is_dir() and not path.is_symlink():
        raise _refusal(path, "a directory")
    temporary = path.with_name(path.name + ".tmp")
    try:
        os.unlink(temporary)  # a leftover (or a link planted there): removed, never followed
    except FileNotFoundError:
        pass
    descriptor = open_run_file(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    with os.fdopen(descriptor, "wb") as file:
        file.write(data.encode() if isinstance(data, str) else data)
    os.replace(temporary, path)


def refuse_links(run_dir: pathlib.Path, names) -> None:
    """Raises `UnsafeRunDirError` if ``run_dir/<name>`` for one of ``names``, or anything under it, is a symbolic
    link: for the directories libraries write into (orbax, tensorstore), which cannot be opened with
    ``O_NOFOLLOW``."""
    for name in names:
        top = run_dir / name
        if top.is_symlink():
            raise _refusal(top, _link_target(top))
        for directory, subdirectories, files in os.walk(top):
            for entry in (*subdirectories, *files):
                path = pathlib.Path(directory) / entry
                if path.is_symlink():
                    raise _refusal(path, _link_target(path))
