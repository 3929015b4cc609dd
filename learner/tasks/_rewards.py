"""Rewards of text completions: one interface, built-in rewards, user rewards by import path or file, and a
`RewardSet` that runs them with weights, timeouts and error handling.

A reward receives the decoded completion (up to its stop token, special tokens dropped), the prompt text (after the
chat template) and the dataset row (every column), and returns a number::

    def my_reward(completion: str, prompt: str, row: dict) -> float

A batched reward takes lists and returns one number per sample; mark it with ``my_reward.batched = True`` (or
``batched = true`` in its config entry)::

    def my_rewards(completions: list[str], prompts: list[str], rows: list[dict]) -> list[float]

Either may be ``async def``. A reward is a finite number of magnitude at most `REWARD_BOUND` (1e6): rewards are
trained in float32, where 1e300 is inf and the square of 1e20 (in a group's standard deviation) overflows; a sample
with a larger reward, or a larger weighted total, is skipped and named like one whose reward raised. The built-ins
(`BUILTIN_REWARDS`) read the reference answer from the row's answer
column: ``exact_match``, ``gsm8k``, ``boxed`` and ``format``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import inspect
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from learner.reward_workers import RewardWorkers, load_function, timeout_error
from learner.tasks._daemon_thread import in_daemon_thread
from learner.tasks._math_answers import equivalent_latex, gsm8k_extract, gsm8k_reference, last_boxed

RewardFn = Callable[..., Any]
REWARD_BOUND = 1e6  # largest |reward| and |weighted total| trained on (float32 arithmetic stays finite)


def exact_match(answer_column: str, strip: bool = True, ignore_case: bool = False) -> RewardFn:
    """1.0 when the completion is the answer column's text (after ``strip`` of whitespace; ``ignore_case``)."""
    def normal(text) -> str:
        text = str(text).strip() if strip else str(text)
        return text.casefold() if ignore_case else text

    def reward(completion: str, prompt: str, row: Mapping[str, Any]) -> float:
        return float(normal(completion) == normal(row[answer_column]))
    return reward


def gsm8k(answer_column: str, method: str = "strict", format_score: float = 0.0) -> RewardFn:
    """1.0 when the completion's final number (``#### 42``; `learner.tasks._math_answers.gsm8k_extract`) equals
    the reference's (the number after ``####`` in the answer column, or the whole column); ``format_score`` when
    a number was found but is wrong; 0.0 when none was found."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"method={method!r}: use 'strict' or 'flexible'")

    def reward(completion: str, prompt: str, row: Mapping[str, Any]) -> float:
        reference = gsm8k_reference(row[answer_column])
        if reference is None:
            raise ValueError(f"answer column {answer_column!r} holds no number: {row[answer_column]!r}")
        answer = gsm8k_extract(completion, method)
        if answer is None:
            return 0.0
        return 1.0 if answer == reference else float(format_score)
    return reward


def boxed(answer_column: str, format_score: float = 0.0) -> RewardFn:
    r"""1.0 when the completion's last ``\boxed{...}`` equals the reference after LaTeX normalisation
    (`learner.tasks._math_answers.equivalent_latex`); the reference is the answer column, or its own last
    ``\boxed{}`` if it has one. ``format_score`` for a boxed but wrong answer; 0.0 without one."""
    def reward(completion: str, prompt: str, row: Mapping[str, Any]) -> float:
        reference = str(row[answer_column])
        reference = last_boxed(reference) or reference
        answer = last_boxed(completion)
        if answer is None:
            return 0.0
        return 1.0 if equivalent_latex(answer, reference) else float(format_score)
    return reward


def format_reward(answer_column: str | None = None, pattern: str = r"<think>.*?</think>\s*<answer>.*?</answer>",
                  match: str = "full") -> RewardFn:
    """1.0 when the completion (whitespace stripped) matches the regular expression ``pattern`` (``.`` matches
    newlines): all of it (``match = "full"``) or somewhere (``"search"``)."""
    if match not in ("full", "search"):
        raise ValueError(f"match={match!r}: use 'full' or 'search'")
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as err:
        raise ValueError(f"pattern={pattern!r}: not a regular expression ({err})") from None
    test = compiled.fullmatch if match == "full" else compiled.search

    def reward(completion: str, prompt: str, row: Mapping[str, Any]) -> float:
        return float(test(completion.strip()) is not None)
    return reward


BUILTIN_REWARDS: dict[str, Callable[..., RewardFn]] = {
    "exact_match": exact_match, "gsm8k": gsm8k, "boxed": boxed, "format": format_reward}




@dataclasses.dataclass(frozen=True)
class Reward:
    """One configured reward: its function, the label its metrics use, its weight in the total, how it is called."""

    label: str
    fn: RewardFn
    weight: float = 1.0
    batched: bool = False  # fn takes lists (completions, prompts, rows) and returns a number per sample
    inline: bool = False  # called in the caller's thread, without the timeout (the built-ins: pure and fast)
    # ``(import path, args)`` of a reward named by its import path: a synchronous one then runs in worker processes
    # (`learner.reward_workers`), killed at the timeout; None: called here (threads, or inline).
    source: tuple[str, dict] | None = None

    @property
    def is_async(self) -> bool:
        fn = self.fn.func if isinstance(self.fn, functools.partial) else self.fn
        return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004


_ENTRY_KEYS = ("name", "weight", "args", "batched", "label")


def make_reward(entry: str | Mapping[str, Any], answer_column: str | None, key: str = "rewards") -> Reward:
    """A `Reward` from a config entry: a name (built-in, ``module:function`` or ``file.py:function``) or a table
    ``{name, weight = 1.0, args = {}, batched = false, label = name}``. ``key`` names the entry in errors."""
    entry = {"name": entry} if isinstance(entry, str) else dict(entry)
    unknown = sorted(set(entry) - set(_ENTRY_KEYS))
    if unknown or "name" not in entry:
        raise ValueError(f"{key}: {'unknown keys ' + str(unknown) if unknown else 'no name'}; an entry is a name "
                         f"or a table with the keys {', '.join(_ENTRY_KEYS)} (name required)")
    name, args = entry["name"], dict(entry.get("args") or {})
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
        raise ValueError(f"{key}.weight={weight!r}: a finite number")
    if name in BUILTIN_REWARDS:
        factory = BUILTIN_REWARDS[name]
        if answer_column is None and factory is not format_reward:
            raise ValueError(f"{key}: the {name!r} reward compares with the answer: set answer_column")
        try:
            inspect.signature(factory).bind(answer_column, **args)
        except TypeError as err:
            raise ValueError(f"{key}.args: {name}: {err}") from None
        fn, label, batched, inline, source = factory(answer_column, **args), name, False, True, None
    elif ":" in name:
        try:
            fn = load_function(name)
        except ValueError as err:
            raise ValueError(f"{key}: {err}") from None
        label, inline, source = name.rpartition(":")[2], False, (name, dict(args))
        batched = bool(entry.get("batched", getattr(fn, "batched", False)))
        fn = functools.partial(fn, **args) if args else fn
    else:
        raise ValueError(f"{key}: unknown reward {name!r}; built-in: {', '.join(BUILTIN_REWARDS)}, or "
                         "'package.module:function', or 'path/to/file.py:function'")
    return Reward(label=str(entry.get("label", label)), fn=fn, weight=float(weight), batched=batched, inline=inline,
                  source=source)


class RewardError(RuntimeError):
    """A reward raised, timed out or returned a non-number, and the task was configured to stop."""


@dataclasses.dataclass(frozen=True)
class RewardScores:
    """The rewards of a batch of samples.

    Attributes:
      total: float32 ``[n]``: the weighted sum of the rewards; NaN for a skipped sample (one of its rewards failed).
      per_reward: ``{label: float32 [n]}``, NaN where that reward failed.
      errors: one line per failure: the reward, the sample, the exception.
    """

    total: np.ndarray
    per_reward: dict[str, np.ndarray]
    errors: list[str]

    @property
    def skipped(self) -> int:
        return int(np.isnan(self.total).sum())

    def metrics(self, prefix: str = "reward") -> dict[str, float]:
        """``{prefix}/{label}/mean`` over the samples each reward scored, and ``{prefix}/skipped_samples``."""
        out = {f"{prefix}/{label}/mean": float(np.nanmean(values)) if np.isfinite(values).any() else math.nan
               for label, values in self.per_reward.items()}
        return out | {f"{prefix}/skipped_samples": float(self.skipped)}


class RewardSet:
    """Several weighted rewards, run on batches of samples with a timeout and a policy for failures.

    Args:
      rewards: the rewards; their labels must differ.
      on_error: ``"skip"``: a failing sample's total is NaN (the loop leaves it out of its group; counted), ``"stop"``:
        raise `RewardError`.
      timeout_s: wall-clock limit of each call of a user reward (a batched reward: of the whole call); None: no
        limit. Synchronous rewards named by import path then run in worker processes, ``workers`` at a time, each
        call's limit from its own start (a call past it is killed with its worker: a batch with hung calls takes
        at most one timeout more, and holds no thread or process after); other synchronous ones in daemon threads,
        ``workers`` at a time (a call past its limit is abandoned, not killed); asynchronous ones are cancelled.
        Built-in rewards (``inline``) run in the caller's thread, without a limit.
      workers: calls in flight at once.
    """

    def __init__(self, rewards: Sequence[Reward], on_error: str = "skip", timeout_s: float | None = 60.0,
                 workers: int = 16):
        labels = [reward.label for reward in rewards]
        if not rewards:
            raise ValueError("rewards: at least one reward is needed")
        if len(set(labels)) != len(labels):
            raise ValueError(f"rewards: labels {labels} repeat; give the entries distinct 'label's")
        if on_error not in ("skip", "stop"):
            raise ValueError(f"on_reward_error={on_error!r}: use 'skip' or 'stop'")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"reward_timeout_s={timeout_s!r}: a positive number of seconds, or none")
        self.rewards, self.on_error, self.timeout_s, self.workers = list(rewards), on_error, timeout_s, workers
        self._processes: RewardWorkers | None = None  # started at the first call that needs them

    def score(self, completions: Sequence[str], prompts: Sequence[str], rows: Sequence[Mapping[str, Any]],
              sample_names: Sequence[str] | None = None) -> RewardScores:
        """Every reward of every sample; ``sample_names[i]`` names sample ``i`` in errors."""
        n = len(completions)
        if not len(prompts) == len(rows) == n:
            raise ValueError(f"{n} completions, {len(prompts)} prompts and {len(rows)} rows")
        names = sample_names or [f"sample {i}" for i in range(n)]
        per_reward, errors = {}, []
        for reward in self.rewards:
            values, failures = self._run(reward, completions, prompts, rows)
            per_reward[reward.label] = values
            for i, error in failures:
                line = f"reward {reward.label!r} failed on {names[i]}: {type(error).__name__}: {error}"
                if self.on_error == "stop":
                    raise RewardError(line + " (on_reward_error = 'stop'; 'skip' leaves such samples out)") \
                        from error
                errors.append(line)
        total = sum(reward.weight * per_reward[reward.label].astype(np.float64) for reward in self.rewards)
        for i in np.flatnonzero(np.abs(total) > REWARD_BOUND):
            line = (f"rewards' weighted total {total[i]:.6g} on {names[i]} is beyond |total| <= {REWARD_BOUND:g} "
                    "(rewards are trained in float32): lower the weights")
            if self.on_error == "stop":
                raise RewardError(line + " (on_reward_error = 'stop'; 'skip' leaves such samples out)")
            errors.append(line)
            total[i] = np.nan
        return RewardScores(np.asarray(total, np.float32), per_reward, errors)

    def check_callable(self, completions: Sequence[str], prompts: Sequence[str], rows: Sequence[Mapping[str, Any]]
                       ) -> str | None:
        """Calls each reward once on these samples (a batched one on all of them at once: give two or more, so that
        a batched reward returning one value is found): what is wrong with a reward that cannot be called with the
        reward signature (TypeError), returns something other than a number, or a batched one that returns another
        count; or None. Other exceptions may depend on the completion and are not reported here."""
        for reward in self.rewards:
            _, failures = self._run(reward, completions, prompts, rows)
            for _, error in failures:
                if isinstance(error, (TypeError, NotANumberError)):
                    return f"reward {reward.label!r}: {type(error).__name__}: {error}"
        return None

    def _run(self, reward: Reward, completions, prompts, rows) -> tuple[np.ndarray, list[tuple[int, Exception]]]:
        """float32 ``[n]`` values (NaN where failed) and the failures ``(sample, exception)``."""
        if reward.batched:
            calls = [functools.partial(reward.fn, list(completions), list(prompts), list(rows))]
        else:
            calls = [functools.partial(reward.fn, c, p, r) for c, p, r in zip(completions, prompts, rows)]
        if reward.is_async:
            outcomes = _run_async(calls, self.timeout_s, self.workers)
        elif reward.source is not None and self.timeout_s is not None:
            self._processes = self._processes or RewardWorkers(self.workers)
            outcomes = self._processes.run(*reward.source, [call.args for call in calls], self.timeout_s)
        else:
            outcomes = _run_sync(calls, None if reward.inline else self.timeout_s, self.workers)
        n = len(completions)
        values, failures = np.full(n, np.nan, np.float32), []
        if reward.batched:
            result, error = outcomes[0]
            if error is None:
                try:
                    result = list(result)
                    if len(result) != n:
                        raise NotANumberError(f"returned {len(result)} values for {n} samples")
                except (TypeError, ValueError) as err:
                    error = err
            outcomes = [(None, error)] * n if error is not None else [(value, None) for value in result]
        for i, (value, error) in enumerate(outcomes):
            if error is None:
                try:
                    value = _number(value)
                except ValueError as err:
                    error = err
            if error is None:
                values[i] = value
            else:
                failures.append((i, error))
        return values, failures


class NotANumberError(ValueError):
    """A reward returned something other than a number (None, a string, a list), or a batched reward another count
    of numbers than it was given samples."""


def _number(value) -> float:
    if not isinstance(value, (bool, int, float, np.number)):
        raise NotANumberError(f"returned {value!r}, not a finite number")
    if not math.isfinite(float(value)):
        raise ValueError(f"returned {value!r}, not a finite number")
    if abs(float(value)) > REWARD_BOUND:
        raise ValueError(f"returned {value!r}, beyond the bound |reward| <= {REWARD_BOUND:g} (rewards are trained "
                         "in float32): rescale it")
    return float(value)


def _run_sync(calls: Sequence[Callable[[], Any]], timeout_s: float | None, workers: int) -> list[tuple]:
    """``(result, None)`` or ``(None, exception)`` per call; with a timeout, in daemon threads, ``workers`` at once."""
    if timeout_s is None:
        return [_outcome(call) for call in calls]
    outcomes = []
    for start in range(0, len(calls), workers):
        futures = [in_daemon_thread(call, "tether-reward") for call in calls[start:start + workers]]
        concurrent.futures.wait(futures, timeout=timeout_s)
        for future in futures:
            if not future.done():
                outcomes.append((None, timeout_error(timeout_s)))
            elif future.exception() is not None:
                outcomes.append((None, future.exception()))
            else:
                outcomes.append((future.result(), None))
    return outcomes


def _outcome(call: Callable[[], Any]) -> tuple:
    try:
        return call(), None
    except Exception as err:
        return None, err


def _run_async(calls: Sequence[Callable[[], Any]], timeout_s: float | None, workers: int) -> list[tuple]:
    """Awaits the coroutines of ``calls`` on a fresh event loop, ``workers`` at once, each cancelled after the
    timeout."""
    async def one(call, gate):
        async with gate:
            try:
                return await asyncio.wait_for(call(), timeout_s), None
            except TimeoutError:
                return None, timeout_error(timeout_s)
            except Exception as err:
                return None, err

    async def all_calls():
        gate = asyncio.Semaphore(workers)
        return await asyncio.gather(*(one(call, gate) for call in calls))
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # the usual case: no event loop in this thread
        return asyncio.run(all_calls())
    # Called from inside an event loop (a notebook, an async driver): asyncio.run needs a thread of its own.
    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        return executor.submit(asyncio.run, all_calls()).result()
