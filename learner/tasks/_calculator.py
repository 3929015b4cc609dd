"""The built-in multi-turn example: multi-digit multiplication that the tiny model solves only with a calculator.

An episode (character tokenizer)::

    [bos] 37*84 [sep]          first prompt
    37*84=                     policy turn 1: a tool call, ended by the stop id of "=" (the tool-call tag)
    3108 [sep]                 observation: the calculator's result (masked, never trained)
    3108 [eos]                 policy turn 2: the answer

The reward is 1 when the episode's answer (a turn ending with a stop id of the tokenizer) is the product, else 0.
A turn ending with a stop id answers directly (the tiny model cannot multiply: that scores ~0); a call the
calculator cannot read is a tool error, answered with ``?``.

With ``chat = true`` the task uses the checkpoint's tokenizer and chat template (``model.hf_path``): the question is
a user message, the calculator's result a ``tool`` message rendered by the template after the policy's turn
(`learner.tasks.message_segment_ids`), and the answer ends with the template's end of turn.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from learner.tasks._environment import EpisodeLimits, Segment, StepResult, segment_ids, turn_end_id
from learner.tasks._hf_tokenizer import HFTokenizer
from learner.tasks._tokenizer import TOKENIZER

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
    """One episode: the policy may call the calculator (``"<expression>="``), and answers with ``"<number>"`` and a
    stop id."""

    def __init__(self, task: Calculator):
        self.task = task
        self.answer = ""

    def reset(self, record: Mapping[str, Any]) -> np.ndarray:
        self.answer = record["answer"]
        return record["prompt_ids"]

    def step(self, generated: np.ndarray) -> StepResult:
        tok = self.task.tokenizer
        if generated.size and int(generated[-1]) in tok.eos_ids:  # an answer
            return StepResult(reward=float(_text(tok, generated[:-1]) == self.answer), done=True)
        text = _text(tok, generated)
        if text is None or not text.endswith(CALL_TAG):  # neither an answer nor a call: the turn ran out of tokens
            return StepResult(done=True)
        value = calculate(text[:-1])
        return StepResult(observation=self.task.observation("?" if value is None else value),
                          info={"tool_call": True, "tool_error": value is None})


def _text(tokenizer, ids: np.ndarray) -> str | None:
    """The text of ``ids``; None if the character tokenizer cannot decode them (a special id, or an id beyond it:
    the model's vocabulary is larger)."""
    try:
        return tokenizer.decode(ids)
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
    chat: bool = False  # the checkpoint's tokenizer and chat template (model_path) instead of the character one
    # Share of the warm-up's demonstrations that call the calculator; the others answer directly (a noisy product
    # the tiny model cannot compute), so the warmed-up policy calls the tool in about this share of its episodes.
    tool_demonstrations: float = 1.0
    model_path: str | None = None  # a checkpoint directory with tokenizer files (default: the run's model.hf_path)

    name = "tool_calculator"

    def __post_init__(self):
        if self.chat and self.model_path is None:
            raise ValueError("task.args: chat = true renders messages with a checkpoint's chat template: set "
                             "model.hf_path (or task.args.model_path) to a directory with tokenizer files")
        if not 0 <= self.tool_demonstrations <= 1:
            raise ValueError(f"task.args.tool_demonstrations={self.tool_demonstrations!r}: must be a share in [0, 1] "
                             "(of the warm-up's demonstrations that call the calculator)")
        if self.tokenizer.encode(CALL_TAG).size != 1:
            raise ValueError(f"task.args.model_path: the tokenizer encodes the tool-call tag {CALL_TAG!r} as several "
                             "tokens; it must be one (a turn's stop id): use a checkpoint whose tokenizer has it as "
                             "one token (`python -m learner.tools.make_hf_tiny --tool-calculator` writes one)")

    @functools.cached_property
    def tokenizer(self):
        return HFTokenizer.from_directory(self.model_path) if self.chat else TOKENIZER

    @property
    def limits(self) -> EpisodeLimits:
        return EpisodeLimits(max_turns=self.max_turns, max_turn_tokens=self.max_turn_tokens,
                             max_observation_tokens=self._observation_tokens,
                             stop_ids=tuple(self.tokenizer.encode(CALL_TAG).tolist()),
                             step_timeout_s=self.step_timeout_s)

    @property
    def max_prompt_tokens(self) -> int:
        return self.prompt_ids(f"{'9' * self.digits}*{'9' * self.digits}").size

    @property
    def max_completion_tokens(self) -> int:
        """The episode budget after the first prompt: every turn at its limit, observations between them."""
        return self.max_turns * self.max_turn_tokens + (self.max_turns - 1) * self._observation_tokens

    @functools.cached_property
    def _observation_tokens(self) -> int:
        """The longest observation: the largest product's, after a turn the template has to close."""
        return segment_ids(self.tokenizer, self.observation("9" * (2 * self.digits + 1))).size

    def observation(self, result: str) -> Segment:
        """The calculator's answer as the policy sees it: the result and sep, or a tool message."""
        tok = self.tokenizer
        if self.chat:
            return [{"role": "tool", "content": result}]
        return np.append(tok.encode(result), tok.sep_id).astype(np.int32)

    def prompt_ids(self, question: str) -> np.ndarray:
        """The first prompt: ``[bos] question [sep]``, or the question as a user message with the generation
        prompt."""
        tok = self.tokenizer
        if self.chat:
            return np.asarray(tok.encode(tok.apply_chat_template([{"role": "user", "content": question}])), np.int32)
        return np.concatenate([[tok.bos_id], tok.encode(question), [tok.sep_id]]).astype(np.int32)

    def environment(self) -> CalculatorEnvironment:
        return CalculatorEnvironment(self)

    def make_prompt(self, rng: np.random.Generator) -> tuple[np.ndarray, str]:
        """A new prompt: its int32 ids and the product as text."""
        a, b = rng.integers(10 ** (self.digits - 1), 10**self.digits, size=2)
        return self.prompt_ids(f"{a}*{b}"), str(a * b)

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
        calculator's answer to the call as written, so a wrong call shows its wrong result). With probability
        ``1 - tool_demonstrations`` the episode answers directly instead: the product, as noisy, and no call."""
        tok = self.tokenizer
        digits = tok.encode("0123456789")

        def noisy(text: str) -> np.ndarray:
            ids = np.array(tok.encode(text), np.int32)
            replace = (rng.random(ids.shape) < noise) & np.isin(ids, digits)
            ids[replace] = rng.choice(digits, size=int(replace.sum()))
            return ids

        question = _EXPRESSION.search(tok.decode(prompt_ids, skip_special_tokens=True))[0]
        if self.tool_demonstrations < 1 and rng.random() >= self.tool_demonstrations:
            answer = np.append(noisy(calculate(question)), turn_end_id(tok)).astype(np.int32)
            return answer, np.ones(answer.size, np.float32)
        call = np.append(noisy(question), tok.encode(CALL_TAG))
        result = calculate(tok.decode(call[:-1]))
        observation = segment_ids(tok, self.observation(result), turn=call)
        answer = np.append(noisy(result), turn_end_id(tok))
        ids = np.concatenate([call, observation, answer]).astype(np.int32)
        mask = np.concatenate([np.ones(call.size), np.zeros(observation.size), np.ones(answer.size)])
        return ids, mask.astype(np.float32)
