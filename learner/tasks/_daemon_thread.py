"""User code that may never return (rewards, environments) runs in daemon threads that can be given up on."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any


def in_daemon_thread(call: Callable[[], Any], name: str) -> concurrent.futures.Future:
    """Runs ``call`` in a new daemon thread called ``name`` (an abandoned call cannot hold the interpreter at exit,
    as a ThreadPoolExecutor's would); the future holds its result or exception."""
    future = concurrent.futures.Future()
    future.set_running_or_notify_cancel()

    def target():
        try:
            result = call()
        except BaseException as err:  # handed to the caller, who decides
            future.set_exception(err)
        else:
            future.set_result(result)
    threading.Thread(target=target, daemon=True, name=name).start()
    return future
