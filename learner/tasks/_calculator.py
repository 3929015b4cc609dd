"""The built-in multi-turn example: multi-digit multiplication that the tiny model solves only with a calculator.

An episode (character tokenizer)::

    [bos] 37*84 [sep]          first prompt
    37*84=                     policy turn 1: a tool call, ended by the stop id of "=" (the tool-call tag)
    3108 [sep]                 observation: the calculator's result (masked, never trained)
    3108 [eos]                 policy turn 2: the answer

The reward is 1 when the episode's answer (a turn ending with eos) is the product, else 0. A turn ending with eos
answers directly (the tiny model cannot multiply: that scores ~0); a call the calculator cannot read is a tool
error, answered with ``?``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from learner.tasks._environment import EpisodeLimits, StepResult
from learner.tasks._tokenizer import TOKENIZER, CharTokenizer

CALL_TAG = "="  # ends a tool call: a stop id of every policy turn
_EXPRESSION = re.compile(r"(\d{1,6})([*+-])(\d{1,6})")


def calculate(expression: str) -> str | None:
    """The value of ``"a*b"``, ``"a+b"`` or ``"a-b"`` (non-negative integers), or None if it is not one.

    >>> calculate("37*84"), calculate("3+"), calculate("12-20")
    ('3108', None, '-8')
    """
    match = _EXPRESSION.fullmatch(expression)
    if match is None:
        return None
    a, op, b = int(match[1]), match[2], int(match[3])
    return str(a * b if op == "*" else a + b if op == "+" else a - b)


class CalculatorEnvironment:
    """One episode: the policy may call the calculator (``"<expression>="``), and answers with ``"<number>"`` and
    eos."""

    def __init__(self, tokenizer: CharTokenizer):
        self.tokenizer = tokenizer
        self.answer = ""

    def reset(self, record: Mapping[str, Any]) -> np.ndarray:
        self.answer = record["answer"]
        return record["prompt_ids"]

    def step(self, generated: np.ndarray) -> StepResult:
        tok = self.tokenizer
        if generated.size and generated[-1] == tok.eos_id:  # an answer
            return StepResult(reward=float(self._text(generated[:-1]) == self.answer), done=True)
        text = self._text(generated)
        if text is None or not text.endswith(CALL_TAG):  # neither an answer nor a call: the turn ran out of tokens
            return StepResult(done=True)
        value = calculate(text[:-1])
        observation = np.append(tok.encode("?" if value is None else value), tok.sep_id).astype(np.int32)
        return StepResult(observation=observation, info={"tool_call": True, "tool_error": value is None})

    def _text(self, ids: np.ndarray) -> str | None:
        """The characters of ``ids``; None if one is a special id or beyond the tokenizer (the model's vocabulary
        is larger)."""
        try:
            return self.tokenizer.decode(ids)
        except ValueError:
            return None


@dataclasses.dataclass(frozen=True)
class Calculator:
    """``"a*b"`` with ``digits``-digit factors; a `learner.tasks.EnvironmentTask` (and `Demonstrations`).

    >>> task = Calculator(num_prompts=4)
    >>> row = task.prompts()[0]
    >>> ids, mask = task.noisy_demonstration(row["prompt_ids"], np.random.default_rng(0), noise=0.0)
    >>> task.tokenizer.decode(row["prompt_ids"][1:-1]), task.tokenizer.decode(ids[mask == 0][:-1])
    ('86*67', '5762')
    """

    num_prompts: int = 4096  # prompt records
    seed: int = 0  # the same seed gives the same records
    digits: int = 2  # digits per factor
    max_turns: int = 3
    max_turn_tokens: int = 8
    step_timeout_s: float = 10.0

    name = "tool_calculator"
    tokenizer = TOKENIZER

    @property
    def limits(self) -> EpisodeLimits:
        return EpisodeLimits(max_turns=self.max_turns, max_turn_tokens=self.max_turn_tokens,
                             max_observation_tokens=2 * self.digits + 2,
                             stop_ids=tuple(self.tokenizer.encode(CALL_TAG).tolist()),
                             step_timeout_s=self.step_timeout_s)

    @property
    def max_prompt_tokens(self) -> int:
        return 2 * self.digits + 3  # bos, a, *, b, sep

    @property
    def max_completion_tokens(self) -> int:
        """The episode budget after the first prompt: every turn at its limit, observations between them."""
        return self.max_turns * self.max_turn_tokens + (self.max_turns - 1) * (2 * self.digits + 2)

    def environment(self) -> CalculatorEnvironment:
        return CalculatorEnvironment(self.tokenizer)

    def make_prompt(self, rng: np.random.Generator) -> tuple[np.ndarray, str]:
        """A new prompt: its int32 ids and the product as text."""
        a, b = rng.integers(10 ** (self.digits - 1), 10**self.digits, size=2)
        tok = self.tokenizer
        return np.concatenate([[tok.bos_id], tok.encode(f"{a}*{b}"), [tok.sep_id]]).astype(np.int32), str(a * b)

    def prompts(self) -> list[dict[str, Any]]:
        """``{"prompt_ids", "answer"}`` record ``i`` from the generator ``(seed, i)``."""
        records = []
        for index in range(self.num_prompts):
            prompt_ids, answer = self.make_prompt(np.random.default_rng((self.seed, index)))
            records.append({"prompt_ids": prompt_ids, "answer": answer})
        return records

    def noisy_demonstration(self, prompt_ids, rng: np.random.Generator, noise: float
                            ) -> tuple[np.ndarray, np.ndarray]:
        """A tool-using episode (the call, the calculator's result, the answer copied from it) and its policy mask;
        each digit the policy writes is replaced by a random one with probability ``noise`` (the result is the
        calculator's answer to the call as written, so a wrong call shows its wrong result)."""
        tok = self.tokenizer
        digits = tok.encode("0123456789")

        def noisy(text: str) -> np.ndarray:
            ids = tok.encode(text)
            replace = (rng.random(ids.shape) < noise) & np.isin(ids, digits)
            ids[replace] = rng.choice(digits, size=int(replace.sum()))
            return ids

        call = np.append(noisy(tok.decode(np.asarray(prompt_ids)[1:-1])), tok.encode(CALL_TAG))
        result = calculate(tok.decode(call[:-1]))
        observation = np.append(tok.encode(result), tok.sep_id)
        answer = np.append(noisy(result), tok.eos_id)
        ids = np.concatenate([call, observation, answer]).astype(np.int32)
        mask = np.concatenate([np.ones(call.size), np.zeros(observation.size), np.ones(answer.size)])
        return ids, mask.astype(np.float32)
