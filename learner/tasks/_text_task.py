"""Question/answer tasks on the character tokenizer, from two methods: a random question and its answer.

A prompt is ``[bos] + question + [sep]``; a correct completion is ``answer + [eos]``. ``reward`` re-derives the
answer from the prompt ids alone, so scoring a rollout needs nothing but the tokens the server returned.
Its prompts are `PromptRecords`, computed when read.
"""

from __future__ import annotations

import abc
import dataclasses
import operator
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from learner.tasks._tokenizer import TOKENIZER, CharTokenizer


class PromptRecords(Sequence):
    """The first ``num_prompts`` records of stream ``seed`` of a `TextTask`, computed when read: record ``i`` is
    ``{"prompt_ids", "answer"}`` of ``task.make_prompt(np.random.default_rng((seed, i)))``.

    A pure function of ``(seed, index)``, so a grain pipeline over it is deterministic, shuffleable and
    checkpointable without storing any prompt.
    """

    def __init__(self, task: TextTask, seed: int, num_prompts: int):
        self.task, self.seed, self.num_prompts = task, seed, num_prompts

    def __len__(self) -> int:
        return self.num_prompts

    def __getitem__(self, index: int) -> dict[str, Any]:
        index = range(self.num_prompts)[operator.index(index)]
        prompt_ids, answer = self.task.make_prompt(np.random.default_rng((self.seed, index)))
        return {"prompt_ids": prompt_ids, "answer": answer}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TextTask(abc.ABC):
    """A `Task` (and `Demonstrations`) given as text: subclasses set the class attributes and implement
    ``make_question`` and ``solve``.

    Prompts: record ``i`` is ``make_prompt`` with the generator ``np.random.default_rng((seed, i))``, for
    ``i < num_prompts``. Reward: 1.0 when the completion up to its first eos is exactly the answer, else 0.0 (no
    partial credit: a completion without eos, e.g. truncated at the length limit, scores 0; so does any extra
    character before eos). Tokens after the first eos are ignored (servers stop there; the rest is padding).
    Subclasses that are dataclasses must be frozen, like this one.

    >>> import numpy as np
    >>> class Double(TextTask):
    ...     name, max_question_chars, max_answer_chars = "double", 1, 2
    ...     def make_question(self, rng): return str(rng.integers(10))
    ...     def solve(self, question): return str(2 * int(question))
    >>> task = Double(num_prompts=100)
    >>> row = task.prompts()[0]
    >>> task.tokenizer.decode(row["prompt_ids"][1:-1]), row["answer"]
    ('8', '16')
    >>> task.rewards([row, row], [task.demonstration(row["prompt_ids"]), task.tokenizer.encode("16")])
    array([1., 0.], dtype=float32)
    """

    num_prompts: int = 4096  # prompt records.
    seed: int = 0  # the prompt stream: the same seed gives the same records.

    name: ClassVar[str]
    max_question_chars: ClassVar[int]
    max_answer_chars: ClassVar[int]
    answer_alphabet: ClassVar[str] = "0123456789"  # characters a noisy demonstration substitutes.
    tokenizer: ClassVar[CharTokenizer] = TOKENIZER

    @abc.abstractmethod
    def make_question(self, rng: np.random.Generator) -> str:
        """A random question, at most ``max_question_chars`` characters."""

    @abc.abstractmethod
    def solve(self, question: str) -> str:
        """The answer to ``question``, at most ``max_answer_chars`` characters."""

    @property
    def max_prompt_tokens(self) -> int:
        return self.max_question_chars + 2

    @property
    def max_completion_tokens(self) -> int:
        return self.max_answer_chars + 1

    def make_prompt(self, rng: np.random.Generator) -> tuple[np.ndarray, str]:
        """A new prompt: its int32 ids and the answer as text."""
        question = self.make_question(rng)
        tok = self.tokenizer
        prompt = np.concatenate([[tok.bos_id], tok.encode(question), [tok.sep_id]]).astype(np.int32)
        return prompt, self.solve(question)

    def prompts(self) -> PromptRecords:
        """``{"prompt_ids", "answer"}`` records, computed when read (see the class docstring)."""
        return PromptRecords(self, self.seed, self.num_prompts)

    def answer_ids(self, prompt_ids) -> np.ndarray:
        """The int32 ids of the answer to a prompt (``[bos] + question + [sep]``, right padding allowed)."""
        prompt_ids = np.asarray(prompt_ids)
        sep = np.flatnonzero(prompt_ids == self.tokenizer.sep_id)
        if prompt_ids.size == 0 or prompt_ids[0] != self.tokenizer.bos_id or sep.size == 0:
            raise ValueError(f"not a prompt of this task: {prompt_ids.tolist()}")
        question = self.tokenizer.decode(prompt_ids[1 : sep[0]])
        return self.tokenizer.encode(self.solve(question))

    def reward(self, prompt_ids, completion_ids) -> float:
        """The reward of one completion (ids as sampled, possibly without eos) for a prompt."""
        completion_ids = np.asarray(completion_ids)
        eos = np.flatnonzero(completion_ids == self.tokenizer.eos_id)
        if eos.size == 0:
            return 0.0
        return float(np.array_equal(completion_ids[: eos[0]], self.answer_ids(prompt_ids)))

    def rewards(self, rows: Sequence[Mapping[str, Any]], completions: Sequence) -> np.ndarray:
        """float32 ``[n]``: ``reward`` of completion ``b`` for ``rows[b]["prompt_ids"]``."""
        if len(rows) != len(completions):
            raise ValueError(f"{len(rows)} prompt records but {len(completions)} completions")
        return np.array([self.reward(row["prompt_ids"], c) for row, c in zip(rows, completions)], np.float32)

    def demonstration(self, prompt_ids) -> np.ndarray:
        """A correct completion's int32 ids, eos included: reward 1."""
        return np.append(self.answer_ids(prompt_ids), self.tokenizer.eos_id).astype(np.int32)

    def noisy_demonstration(self, prompt_ids, rng: np.random.Generator, noise: float) -> np.ndarray:
        """A demonstration whose answer characters are each replaced with probability ``noise``."""
        completion = self.demonstration(prompt_ids)
        answer = completion[:-1]
        replace = rng.random(answer.shape) < noise
        substitutes = self.tokenizer.encode(self.answer_alphabet)
        answer[replace] = rng.choice(substitutes, size=int(replace.sum()))
        return completion
