"""A plug-in environment task for real-run tests
(``task.name = "tests.support.flaky_environment_task:FlakyCalculator"``): the calculator whose environment
misbehaves in 25% of its step calls, the 1st, 5th, 9th... step call of each group's episodes (those of one prompt
record), each time in the next way of ``failures`` (a rotation over the process). So every group loses at least
one episode."""

import collections
import dataclasses
import threading

import numpy as np

from learner.tasks import StepResult
from learner.tasks._calculator import Calculator, CalculatorEnvironment

FAILURES = ("raise", "hang", "none", "int", "beyond_vocab", "negative", "nan_reward")
_lock = threading.Lock()
_calls_per_record = collections.Counter()  # step calls so far, by the record's prompt
_failures = [0]  # failures so far, in the process


def misbehave(failure: str, vocab_size: int) -> StepResult:
    """What a step that fails in the way ``failure`` returns (or does)."""
    if failure == "raise":
        raise RuntimeError("flaky tool: crashed")
    if failure == "hang":
        threading.Event().wait()  # never returns
    observation = {"none": None, "int": 7, "beyond_vocab": np.array([vocab_size + 5], np.int32),
                   "negative": [3, -2]}.get(failure, ())
    return StepResult(observation=observation, reward=float("nan") if failure == "nan_reward" else 0.0)


class FlakyEnvironment(CalculatorEnvironment):
    def reset(self, record):
        self.record = bytes(np.asarray(record["prompt_ids"]))
        return super().reset(record)

    def step(self, generated):
        with _lock:
            call = _calls_per_record[self.record]
            _calls_per_record[self.record] += 1
            failure = None
            if call % 4 == 0:
                failure = self.task.failures[_failures[0] % len(self.task.failures)]
                _failures[0] += 1
        if failure is None:
            return super().step(generated)
        return misbehave(failure, self.task.tokenizer.vocab_size)


@dataclasses.dataclass(frozen=True)
class FlakyCalculator(Calculator):
    """`learner.tasks.Calculator` whose steps fail as the module docstring says."""

    failures: tuple[str, ...] = FAILURES

    def environment(self) -> FlakyEnvironment:
        return FlakyEnvironment(self)
