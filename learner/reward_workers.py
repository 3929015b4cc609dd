"""User rewards named by import path run in worker processes that can be killed: a call still running after
``reward_timeout_s`` costs its sample, and its worker is killed (a new one starts when needed). So a reward that
hangs forever holds no thread and no process beyond its timeout, and a batch with hung calls takes at most one
timeout longer than without them: each call's limit runs from its own start, ``size`` calls at a time.

A worker is ``python -m learner.reward_workers PID FD``, PID the learner's and FD a socket to it: it loads each reward
``target`` it is sent (`load_function`; not timed: a worker's start and imports are not the
reward's time), then for each pickled ``(target, args, call_args)`` sends back ``(value, None)`` or
``(None, exception)``. Its stdout and stderr are the learner's. This module imports the standard library alone,
so that a worker starts in a fraction of a second (a killed one is replaced while the batch goes on).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import importlib
import importlib.util
import os
import pathlib
import pickle
import signal
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

_LOAD_LOCK = threading.Lock()


def load_function(target: str) -> Callable:
    """The function ``"package.module:function"`` (imported from ``sys.path``) or ``"path/to/file.py:function"``
    (loaded from the file, relative to the working directory) names."""
    location, _, attribute = target.rpartition(":")
    if not location or not attribute:
        raise ValueError(f"{target!r}: give 'package.module:function' or 'path/to/file.py:function'")
    if location.endswith(".py") or "/" in location:
        path = pathlib.Path(location).resolve()
        if not path.is_file():
            raise ValueError(f"{target!r}: no file {path}")
        name = f"_tether_reward_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
        with _LOAD_LOCK:  # the module is in sys.modules before it has run: another thread must not see it half-made
            if name not in sys.modules:
                spec = importlib.util.spec_from_file_location(name, path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[name] = module
                try:
                    spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[name]
                    raise
            module = sys.modules[name]
    else:
        try:
            module = importlib.import_module(location)
        except ImportError as err:
            raise ValueError(f"{target!r}: {err}") from err
    if not callable(getattr(module, attribute, None)):
        raise ValueError(f"{target!r}: {location} has no function {attribute!r}")
    return getattr(module, attribute)


_LOAD_TIMEOUT_S = 120.0  # at least this long for a new worker to start and load a reward (not the reward's time)


def timeout_error(timeout_s: float) -> TimeoutError:
    """What a call past ``reward_timeout_s`` failed with."""
    return TimeoutError(f"no result within reward_timeout_s = {timeout_s} s (the call was abandoned)")


class RewardWorkers:
    """At most ``size`` worker processes (started when a call needs one) and ``size`` threads waiting on them."""

    def __init__(self, size: int):
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._threads = concurrent.futures.ThreadPoolExecutor(size, thread_name_prefix="tether-reward")
        weakref.finalize(self, _close, self._idle, self._threads)

    def run(self, target: str, args: dict, calls: list[tuple], timeout_s: float) -> list[tuple[Any, Exception | None]]:
        """``(value, None)`` or ``(None, exception)`` of ``target(*call, **args)`` for each call of ``calls``."""
        futures = [self._threads.submit(self._call, target, args, call, timeout_s) for call in calls]
        return [future.result() for future in futures]

    def _call(self, target: str, args: dict, call: tuple, timeout_s: float) -> tuple[Any, Exception | None]:
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        worker = worker or _Worker()
        try:
            if target not in worker.loaded:
                worker.connection.send(target)
                if not worker.connection.poll(max(_LOAD_TIMEOUT_S, timeout_s)):
                    raise RuntimeError(f"loading {target} took more than {max(_LOAD_TIMEOUT_S, timeout_s):g} s")
                loaded = worker.connection.recv()
                if loaded is not None:
                    raise loaded
                worker.loaded.add(target)
            worker.connection.send((target, args, call))
            if not worker.connection.poll(timeout_s):
                self._replace(worker)
                return None, timeout_error(timeout_s)
            outcome = worker.connection.recv()
        except (EOFError, OSError) as error:
            self._replace(worker)
            return None, RuntimeError(f"the reward's worker process died (exit code {worker.process.poll()}): "
                                      f"{type(error).__name__}")
        except Exception as error:  # noqa: BLE001 -- a row that cannot be sent, a target that does not load
            self._replace(worker)
            return None, error
        with self._lock:
            self._idle.append(worker)
        return outcome

    def _replace(self, worker: _Worker) -> None:
        """Kills ``worker`` and starts another in its place: it imports while the batch goes on, so the next batch
        finds it ready."""
        worker.kill()
        with self._lock:
            self._idle.insert(0, _Worker())


class _Worker:
    """One worker process and the learner's end of its socket."""

    def __init__(self):
        ours, theirs = socket.socketpair()
        path = os.pathsep.join([os.path.abspath(entry or ".") for entry in sys.path])
        self.process = subprocess.Popen([sys.executable, "-m", __name__, str(os.getpid()), str(theirs.fileno())],
                                        pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                        env={**os.environ, "PYTHONPATH": path})
        theirs.close()
        self.connection = Connection(ours.detach())
        self.loaded: set[str] = set()  # the targets this worker has loaded

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.connection.close()


def _close(idle: list[_Worker], threads: concurrent.futures.ThreadPoolExecutor) -> None:
    for worker in idle:
        worker.kill()
    threads.shutdown(wait=False)


def _serve(connection: Connection) -> None:
    functions = {}
    while True:
        try:
            message = connection.recv()
        except EOFError:  # the learner ended
            return
        if isinstance(message, str):  # load a target: None, or why it does not load
            try:
                functions[message] = load_function(message)
                connection.send(None)
            except Exception as error:  # noqa: BLE001 -- handed to the learner
                connection.send(RuntimeError(f"{type(error).__name__}: {error}"))
            continue
        target, args, call = message
        try:
            outcome = functools.partial(functions[target], **args)(*call), None
        except Exception as error:  # noqa: BLE001 -- handed to the learner, which decides
            outcome = None, error
        try:
            connection.send(outcome)
        except (pickle.PicklingError, TypeError, AttributeError):  # an exception or value that cannot be pickled
            connection.send((None, RuntimeError(f"{type(outcome[1] or outcome[0]).__name__}: "
                                                f"{outcome[1] or outcome[0]!r} (not picklable)")))


if __name__ == "__main__":
    # Dies with the learner, even mid-call (a SIGKILLed learner included): rollout_client.engines.child's way, here
    # so that a worker does not import rollout_client (grpc) to start.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    except OSError:
        pass
    if os.getppid() != int(sys.argv[1]):  # the learner ended before that took effect
        sys.exit(0)
    _serve(Connection(int(sys.argv[2])))
