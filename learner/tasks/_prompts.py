"""Prompts in bulk, as fixed-shape NumPy records, and rewards of a batch of completions."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from learner.tasks._base import Task


def prompt_example(task: Task, seed: int, index: int) -> dict[str, np.ndarray]:
    """Prompt number ``index`` of stream ``seed``, right-padded to ``task.max_prompt_tokens``.

    A pure function of ``(seed, index)``, so a grain ``MapDataset.range(n).map(...)`` over it is deterministic,
    shuffleable and checkpointable.

    Returns:
      ``{"prompt_ids": int32 [max_prompt_tokens], "prompt_length": int32 scalar}``.

    >>> from learner.tasks import get_task
    >>> example = prompt_example(get_task("reverse_digits"), seed=0, index=3)
    >>> example["prompt_ids"].shape, int(example["prompt_length"]) <= 8
    ((8,), True)
    """
    prompt, _ = task.make_prompt(np.random.default_rng((seed, index)))
    prompt_ids = np.full(task.max_prompt_tokens, task.tokenizer.pad_id, np.int32)
    prompt_ids[: len(prompt)] = prompt
    return {"prompt_ids": prompt_ids, "prompt_length": np.int32(len(prompt))}


def batch_rewards(task: Task, prompt_ids: Sequence, completions: Sequence) -> np.ndarray:
    """float32 ``[B]`` rewards of completion ``b`` (ids, padding after eos allowed) for prompt ``b``."""
    if len(prompt_ids) != len(completions):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completions)} completions")
    return np.array([task.reward(p, c) for p, c in zip(prompt_ids, completions)], np.float32)
