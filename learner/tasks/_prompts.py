"""Prompt records of a generator task, and the padded and batched forms `learner.train` reads."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from learner.tasks._protocols import Task
    from learner.tasks._text_task import TextTask


def _prompt_record(task: TextTask, seed: int, index: int) -> dict[str, Any]:
    """Prompt number ``index`` of stream ``seed`` of a `TextTask`."""
    prompt_ids, answer = task.make_prompt(np.random.default_rng((seed, index)))
    return {"prompt_ids": prompt_ids, "answer": answer}


class PromptRecords(Sequence):
    """The first ``num_prompts`` records of stream ``seed`` of a `TextTask`, computed when read.

    A pure function of ``(seed, index)``, so a grain pipeline over it is deterministic, shuffleable and
    checkpointable without storing any prompt.
    """

    def __init__(self, task: TextTask, seed: int, num_prompts: int):
        self.task, self.seed, self.num_prompts = task, seed, num_prompts

    def __len__(self) -> int:
        return self.num_prompts

    def __getitem__(self, index: int) -> dict[str, Any]:
        return _prompt_record(self.task, self.seed, range(self.num_prompts)[operator.index(index)])


def prompt_example(task: TextTask, seed: int, index: int) -> dict[str, np.ndarray]:
    """Prompt number ``index`` of stream ``seed``, right-padded to ``task.max_prompt_tokens``.

    Returns:
      ``{"prompt_ids": int32 [max_prompt_tokens], "prompt_length": int32 scalar}``.

    >>> from learner.tasks import load_task
    >>> example = prompt_example(load_task("reverse_digits"), seed=0, index=3)
    >>> example["prompt_ids"].shape, int(example["prompt_length"]) <= 8
    ((8,), True)
    """
    prompt = _prompt_record(task, seed, index)["prompt_ids"]
    prompt_ids = np.full(task.max_prompt_tokens, task.tokenizer.pad_id, np.int32)
    prompt_ids[: len(prompt)] = prompt
    return {"prompt_ids": prompt_ids, "prompt_length": np.int32(len(prompt))}


def batch_rewards(task: Task, prompt_ids: Sequence, completions: Sequence) -> np.ndarray:
    """float32 ``[B]`` rewards of completion ``b`` for prompt ids ``b``: ``task.rewards`` of records holding only
    ``"prompt_ids"`` (enough for a `TextTask`)."""
    return task.rewards([{"prompt_ids": p} for p in prompt_ids], completions)
