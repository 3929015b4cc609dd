"""A full disk, told once: find it in an exception chain, and keep the background writers' logs of it quiet.

A full disk shows up as an ``OSError`` (ENOSPC, EDQUOT) from Python writes and as a tensorstore ``ValueError``
(``RESOURCE_EXHAUSTED: Error writing local file "<path>" ... No space left on device``) from orbax and the rollout
log, each logged again by orbax's threads with its traceback. The CLI reports it as one line naming the path.
"""

from __future__ import annotations

import errno
import logging
import re

_FULL = (errno.ENOSPC, errno.EDQUOT)
_TENSORSTORE_PATH = re.compile(r'Error writing local file "([^"]+)"')


def disk_full_cause(error: BaseException | None) -> str | None:
    """``"<path>: <reason>"`` (or the reason alone when no exception of the chain names a path) if ``error`` or an
    exception it chains is a full disk, else None."""
    found, seen = None, set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error)
        if isinstance(error, OSError) and error.errno in _FULL:
            if error.filename:
                return f"{error.filename}: {error.strerror}"
            found = found or error.strerror
        elif "No space left on device" in text or "Disk quota exceeded" in text:
            if path := _TENSORSTORE_PATH.search(text):
                return f"{path.group(1)}: No space left on device"
            found = found or "No space left on device"
        error = error.__cause__ or error.__context__
    return found


class DiskFullLogFilter(logging.Filter):
    """Drops log records about a full disk (their message or exception), which the CLI reports once."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not ("No space left on device" in record.getMessage() or disk_full_cause(error))


def quiet_disk_full_logs() -> None:
    """Drops the background writers' logs of a full disk, which the CLI reports once: orbax's threads (absl) and its
    asyncio tasks whose exception nobody retrieved once the save failed (asyncio's "Task exception was never
    retrieved", one per pending write)."""
    for name in ("absl", "asyncio"):
        logging.getLogger(name).addFilter(DiskFullLogFilter())
