"""SIGINT (Ctrl-C) and SIGTERM (a preempted cloud job) stop a run without losing its work.

The first signal stops the run at the step reached: `Run` saves a checkpoint of it (the same verified save as a
periodic one: atomic, with its manifest) and completes it before exiting, so the rerun resumes there. A signal that
lands while a step's update and hooks run is acted on once they are done (`StopSignals.hold`): the update donates the
old state, so an exception in its middle would leave no state to save, and a step half recorded (trained, not yet
logged) would leave a gap in the metrics. A second signal exits at once (``os._exit``): the latest verified
checkpoint is kept, a save in flight is abandoned (its temporary directory is deleted at the next start), and the
engine's process dies with the learner's (`rollout_client.engines.child`).

Handlers are installed from the main thread only (Python runs them there); elsewhere the run keeps the default
behaviour.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A first SIGINT or SIGTERM: the run stops. ``saved_step`` is the checkpoint the stop left (None before the
    first step, where there is nothing to save)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.saved_step: int | None = None

    @property
    def exit_code(self) -> int:
        """The shell's convention for a death by this signal: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + self.signum


class StopSignals:
    """The handlers of one run (see the module docstring); ``hold`` / ``release`` bracket the steps' critical part."""

    def __init__(self):
        self.received: int | None = None  # the first signal's number
        self._holding = False
        self._pending = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Handles SIGINT and SIGTERM for the duration of the block (from the main thread; elsewhere nothing)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {signum: signal.signal(signum, self._handle) for signum in SIGNALS}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, signal.SIG_DFL if handler is None else handler)

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            print(f"{name} again: exiting now; the latest verified checkpoint is kept", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.received = signum
        when = "once this step's update is done" if self._holding else "now"
        print(f"{name}: stopping {when}; saving a checkpoint of the step reached before exiting (Ctrl-C again to exit "
              "at once, keeping the latest verified checkpoint)", file=sys.stderr, flush=True)
        if self._holding:
            self._pending = True
        else:
            raise Interrupted(signum)

    def hold(self) -> None:
        """A signal from now on waits for `release`."""
        self._holding = True

    def release(self, raise_pending: bool = True) -> None:
        """Ends `hold`; raises `Interrupted` for a signal received meanwhile (unless ``raise_pending`` is False: the
        step failed, its own exception goes on)."""
        self._holding = False
        if self._pending:
            self._pending = False
            if raise_pending:
                raise Interrupted(self.received)
