"""The built-in tasks: addition, sorting and reversal of short digit strings.

Small enough for the tiny model to learn in minutes on a CPU, and exactly verifiable.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from learner.tasks._text_task import TextTask


@dataclasses.dataclass(frozen=True)
class Addition(TextTask):
    """``"a+b"`` -> ``"a+b"`` evaluated, for ``0 <= a, b < 10**digits``.

    >>> Addition(digits=2).solve("12+79")
    '91'
    """

    digits: int = 2

    @property
    def name(self) -> str:
        return f"addition_{self.digits}digit"

    @property
    def max_question_chars(self) -> int:
        return 2 * self.digits + 1

    @property
    def max_answer_chars(self) -> int:
        return self.digits + 1

    def make_question(self, rng: np.random.Generator) -> str:
        a, b = rng.integers(10**self.digits, size=2)
        return f"{a}+{b}"

    def solve(self, question: str) -> str:
        a, b = question.split("+")
        return str(int(a) + int(b))


@dataclasses.dataclass(frozen=True)
class _DigitStringTask(TextTask):
    """A random string of ``min_length..max_length`` digits in, a digit string of the same length out."""

    min_length: int = 3
    max_length: int = 6

    @property
    def max_question_chars(self) -> int:
        return self.max_length

    @property
    def max_answer_chars(self) -> int:
        return self.max_length

    def make_question(self, rng: np.random.Generator) -> str:
        length = rng.integers(self.min_length, self.max_length + 1)
        return "".join(map(str, rng.integers(10, size=length)))


@dataclasses.dataclass(frozen=True)
class SortDigits(_DigitStringTask):
    """``"5381"`` -> ``"1358"``.

    >>> SortDigits().solve("5381")
    '1358'
    """

    name = "sort_digits"

    def solve(self, question: str) -> str:
        return "".join(sorted(question))


@dataclasses.dataclass(frozen=True)
class ReverseDigits(_DigitStringTask):
    """``"5381"`` -> ``"1835"``.

    >>> ReverseDigits().solve("5381")
    '1835'
    """

    name = "reverse_digits"

    def solve(self, question: str) -> str:
        return question[::-1]
