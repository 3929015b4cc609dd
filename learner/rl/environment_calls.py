"""The boundary between the episode loop and a user's environment: calls that can be given up on, and checks of
what comes back.

A user's ``reset`` or ``step`` may hang, raise or return anything. `EnvironmentCalls.call` runs each call, sync or
``async def``, in its own daemon thread and waits ``step_timeout_s`` for it: a call still running then is given up
on (counted; its thread is left to finish, or to run until the process exits: a daemon thread never holds up the
exit). `step_result` and `segment_ids_of` check the answer at the boundary: a `learner.tasks.StepResult` with a
finite real reward, a bool ``done`` and a mapping ``info``; an observation or first prompt that is ids (integers in
``[0, tokenizer.vocab_size)``), text or chat messages. Each failure is an `EnvironmentFailure` naming the
environment and the field, which ends its episode (`learner.rl.episodes`), never the run.

A thread cannot be killed: a call stuck in C code that holds the GIL stalls the process, and a pure-Python loop
that never returns keeps its share of the CPU. ``multiturn/env_calls_stuck`` shows how many are still running.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import math
import numbers
import threading
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from learner.tasks import StepResult, segment_ids
from learner.tasks._daemon_thread import in_daemon_thread

logger = logging.getLogger(__name__)
_LOGGED_FAILURES = 5  # environment failures logged per run; the rest counted (multiturn/env_errors)


class EnvironmentFailure(RuntimeError):
    """An environment's reset or step raised, timed out or returned something unusable (the episode ends; the run
    goes on)."""


async def _awaited(awaitable):
    return await awaitable


class EnvironmentCalls:
    """Calls into the environments of one task (``name``: how failures name them), each in a daemon thread.

    Args:
      name: the task's name, for error messages.
    """

    def __init__(self, name: str):
        self.name = name
        self._lock = threading.Lock()
        self._abandoned: list[concurrent.futures.Future] = []  # calls given up on, still running when last looked
        self._abandoned_total = 0
        self._logged = 0

    def call(self, function: Callable, *args, timeout_s: float):
        """``function(*args)`` (its result awaited when it is awaitable) within ``timeout_s``.

        Raises:
          EnvironmentFailure: it raised, or was still running after ``timeout_s`` (then it is given up on).
        """
        what = self.describe(function)
        timed_out = EnvironmentFailure(f"{what} took more than {timeout_s:g} s (the task's step_timeout_s): given up "
                                       "on")

        def complete():
            result = function(*args)
            if inspect.isawaitable(result):  # an ``async def``: cancelled at the timeout if it awaits
                try:
                    result = asyncio.run(asyncio.wait_for(_awaited(result), timeout_s))
                except TimeoutError:
                    raise timed_out from None
            return result

        outcome = in_daemon_thread(complete, f"env-{self.name}")
        try:
            return outcome.result(timeout_s)
        except TimeoutError:
            if not outcome.done():
                with self._lock:
                    self._abandoned_total += 1
                    self._abandoned.append(outcome)
                raise timed_out from None
            error = outcome.exception()  # it ended just after the wait did, or raised TimeoutError itself
            if error is None:
                return outcome.result()
        except BaseException as raised:  # noqa: BLE001 -- whatever the user's code raised ends its episode only
            error = raised
        if error is timed_out:
            raise timed_out
        raise EnvironmentFailure(f"{what} raised {type(error).__name__}: {error}") from error

    def describe(self, function: Callable) -> str:
        """``environment <task> (<Class>.<method>)``: how a failure names the environment and the call."""
        return f"environment of task {self.name!r} ({getattr(function, '__qualname__', function)})"

    def note(self, error: Exception) -> None:
        """Logs a failure (the first few of a run; every one is counted by the caller)."""
        with self._lock:
            self._logged += 1
            logged = self._logged
        if logged <= _LOGGED_FAILURES:
            more = "; later ones are counted in multiturn/env_errors" if logged == _LOGGED_FAILURES else ""
            logger.warning("episode ended: %s%s", error, more)

    def metrics(self) -> dict[str, int]:
        """Calls given up on so far, and those of them still running."""
        with self._lock:
            self._abandoned = [call for call in self._abandoned if not call.done()]
            return {"multiturn/env_calls_abandoned": self._abandoned_total,
                    "multiturn/env_calls_stuck": len(self._abandoned)}


def step_result(result, what: str) -> StepResult:
    """``result`` if it is a usable `StepResult` (its observation is checked by `segment_ids_of`).

    >>> step_result(StepResult(reward=float("nan")), "environment of task 'calc' (Env.step)")
    Traceback (most recent call last):
    ...
    learner.rl.environment_calls.EnvironmentFailure: environment of task 'calc' (Env.step) returned reward=nan:
    must be a finite number
    """
    if not isinstance(result, StepResult):
        raise EnvironmentFailure(f"{what} returned {type(result).__name__}, not a learner.tasks.StepResult")
    reward = result.reward
    if not isinstance(reward, numbers.Real) or isinstance(reward, (bool, np.bool_)) or not _finite(reward):
        raise EnvironmentFailure(f"{what} returned reward={reward!r}: must be a finite number")
    if not isinstance(result.done, (bool, np.bool_)):
        raise EnvironmentFailure(f"{what} returned done={result.done!r}: must be a bool")
    if not isinstance(result.info, Mapping):
        raise EnvironmentFailure(f"{what} returned info of type {type(result.info).__name__}: must be a mapping "
                                 "(a dict)")
    return result


def _finite(number: numbers.Real) -> bool:
    try:
        return math.isfinite(float(number))
    except OverflowError:  # an int beyond float64
        return False


def segment_ids_of(tokenizer, segment, what: str, field: str, first: bool = False, turn=()) -> np.ndarray:
    """`learner.tasks.segment_ids` of a first prompt or observation (``field``, for the message), checked: ids,
    text or chat messages, rendering to integer ids in ``[0, tokenizer.vocab_size)``.

    >>> from learner.tasks import CharTokenizer
    >>> segment_ids_of(CharTokenizer(), [3, -1], "environment of task 'calc' (Env.step)", "observation")
    Traceback (most recent call last):
    ...
    learner.rl.environment_calls.EnvironmentFailure: environment of task 'calc' (Env.step) returned observation
    with id -1 at position 1: ids must be in [0, 99) (the task's tokenizer.vocab_size)
    """
    if isinstance(segment, (bytes, numbers.Number)) or not isinstance(segment, Iterable):
        raise EnvironmentFailure(f"{what} returned {field}={segment!r}: must be token ids, text or chat messages")
    if isinstance(segment, np.ndarray) or (not isinstance(segment, str) and all(
            isinstance(item, numbers.Integral) for item in segment)):  # ids: checked before the cast to int32
        values = np.asarray(segment)
        if values.size and not np.issubdtype(values.dtype, np.integer):
            raise EnvironmentFailure(f"{what} returned {field} as {values.dtype} values: token ids must be integers")
        _check_ids(values.reshape(-1), tokenizer.vocab_size, what, field)
    try:
        ids = segment_ids(tokenizer, segment, first=first, turn=turn)
    except Exception as error:  # noqa: BLE001 -- text or messages the tokenizer or template cannot render
        raise EnvironmentFailure(f"{what} returned {field} that cannot be rendered as token ids, text or chat "
                                 f"messages: {type(error).__name__}: {error}") from error
    _check_ids(ids, tokenizer.vocab_size, what, field)
    return ids


def _check_ids(ids: np.ndarray, vocab_size: int, what: str, field: str) -> None:
    outside = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if outside.size:
        raise EnvironmentFailure(f"{what} returned {field} with id {ids[outside[0]]} at position {outside[0]}: ids "
                                 f"must be in [0, {vocab_size}) (the task's tokenizer.vocab_size)")
