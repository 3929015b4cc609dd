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
    """A random string of ``min_length..max_length`` digits in, a digit string of the same length out.

    Lengths are uniform (``length_exponent = 0``), or follow a power law ``P(n) ~ n ** -length_exponent``: mostly
    short strings and a long tail of long ones, as reasoning RL's completion lengths (partial rollouts).

    >>> task = ReverseDigits(min_length=2, max_length=40, length_exponent=1.5, num_prompts=2000)
    >>> lengths = np.array([len(row["answer"]) for row in task.prompts()])
    >>> int(np.median(lengths)), bool(0.05 < np.mean(lengths >= 20) < 0.2), int(lengths.max()) <= 40
    (4, True, True)
    """

    min_length: int = 3
    max_length: int = 6
    length_exponent: float = 0.0

    def __post_init__(self):
        if not 1 <= self.min_length <= self.max_length:
            raise ValueError(f"min_length={self.min_length}, max_length={self.max_length}: need "
                             "1 <= min_length <= max_length")
        if not (np.isfinite(self.length_exponent) and self.length_exponent >= 0):
            raise ValueError(f"length_exponent={self.length_exponent}: must be a finite number >= 0")

    @property
    def max_question_chars(self) -> int:
        return self.max_length

    @property
    def max_answer_chars(self) -> int:
        return self.max_length

    def make_question(self, rng: np.random.Generator) -> str:
        if self.length_exponent == 0:
            length = rng.integers(self.min_length, self.max_length + 1)
        else:
            lengths = np.arange(self.min_length, self.max_length + 1)
            weights = lengths.astype(np.float64) ** -self.length_exponent
            length = rng.choice(lengths, p=weights / weights.sum())
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
