"""What the training loop needs of a task and its tokenizer, as protocols: any class with these members plugs in."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> ids, and the special ids the loop and the inference server need.

    `CharTokenizer` is one; for a Hugging Face tokenizer, a small adapter exposing these five members is enough.
    """

    vocab_size: int  # ids are in [0, vocab_size); at most the model's vocabulary.
    pad_id: int  # fills prompts and completions to fixed shapes.
    eos_ids: tuple[int, ...]  # ids that end a completion: the server's stop ids (instruct models may have several).

    def encode(self, text: str) -> np.ndarray:
        """int32 ids of ``text``."""

    def decode(self, ids) -> str:
        """The text of ``ids``."""


@runtime_checkable
class Task(Protocol):
    """A prompt dataset, its tokenizer and a reward: what the RL loop trains on.

    The loop shuffles, batches and checkpoints its position in ``prompts()``, so a task knows nothing of epochs,
    processes or restarts; it only has to return the same records for the same index every time.
    """

    name: str  # for logs.
    tokenizer: Tokenizer
    max_prompt_tokens: int  # length of the longest prompt: prompts are padded to it.
    max_completion_tokens: int  # default number of new tokens to sample.

    def prompts(self) -> Sequence[Mapping[str, Any]]:
        """Random-access prompt records (``len`` and ``[i]``; computed when read is fine).

        Each record has ``"prompt_ids"`` (int32 1-D, unpadded, at most ``max_prompt_tokens``) and whatever else
        ``rewards`` needs (e.g. the answer).
        """

    def rewards(self, rows: Sequence[Mapping[str, Any]], completions: Sequence[np.ndarray]) -> np.ndarray:
        """float32 ``[n]``: the reward of completion ``b`` for prompt record ``rows[b]``.

        Completions are ids as sampled: ending with a stop id from ``tokenizer.eos_ids``, or without one when
        truncated at the length limit. NaN skips a sample (its group trains on its other samples); so does a
        reward that is infinite or beyond `learner.tasks.REWARD_BOUND`, which the loop also names and counts
        (``reward/skipped_samples``).
        """


@runtime_checkable
class Demonstrations(Protocol):
    """Optional: a task that can draw fresh prompts and write (noisy) correct completions feeds the warm-up."""

    def make_prompt(self, rng: np.random.Generator) -> tuple[np.ndarray, Any]:
        """A new random prompt: its int32 ids, and whatever else the task knows of it (e.g. the answer)."""

    def noisy_demonstration(self, prompt_ids, rng: np.random.Generator, noise: float) -> np.ndarray:
        """int32 ids of a correct completion (stop id included) for ``prompt_ids``, corrupted at rate ``noise``."""


def missing_members(obj: Any, protocol: type) -> list[str]:
    """Names of ``protocol``'s members that ``obj`` lacks (or has but cannot call, for methods), in order."""
    methods = [name for name, value in vars(protocol).items() if not name.startswith("_") and callable(value)]
    return [name for name in [*protocol.__annotations__, *methods]
            if not hasattr(obj, name) or (name in methods and not callable(getattr(obj, name)))]
