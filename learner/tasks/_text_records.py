"""The prompt records of a `TextTask`, computed when read."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from learner.tasks._text_task import TextTask


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
