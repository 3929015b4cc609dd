"""Environments: multi-turn tasks whose episodes alternate policy turns with observations (tool results, feedback).

An `EnvironmentTask` is a task (tokenizer, prompt records, token budgets) whose ``environment()`` makes one fresh
`Environment` per episode. ``reset(record)`` gives the first prompt; after each policy turn, ``step(generated)``
gives the observation that follows it, the turn's reward contribution, whether the episode is done, and an info
dict. Prompts and observations are token ids, text (encoded alone with the task's tokenizer) or chat messages
(rendered as a segment of the tokenizer's chat template, `message_segment_ids`): the episode's history is never
re-tokenized (`learner.rl.episodes`). ``reset`` and ``step`` may be ``async def``.

The task's ``limits`` (`EpisodeLimits`) bound each episode. The run config names an environment task as any task:
``task.name = "my_envs:Calculator"``, ``task.args = {...}`` (`learner.tasks.load_task`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

Message = Mapping[str, Any]  # {"role": ..., "content": ...}, as chat templates take them
Segment = np.ndarray | Sequence[int] | str | Sequence[Message]  # what reset and step may return as tokens


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What an environment answers to one policy turn."""

    observation: Segment = ()  # tokens appended after the turn (masked: never trained); () for none
    reward: float = 0.0  # this turn's contribution to the episode's reward (the episode's reward is their sum)
    done: bool = False  # the episode ends here (the observation is then dropped)
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # "tool_call" / "tool_error": bools, counted


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
    """Bounds of every episode of an environment task; each one hit is counted in the run's metrics.

    >>> EpisodeLimits(max_turns=0)
    Traceback (most recent call last):
    ...
    ValueError: task.args: max_turns=0: must be >= 1
    """

    max_turns: int = 4  # policy turns per episode; the episode ends after the last one
    max_turn_tokens: int = 64  # new tokens per policy turn (fewer when the episode's budget is nearly spent)
    max_observation_tokens: int = 64  # an observation longer than this is cut to it
    stop_ids: tuple[int, ...] = ()  # ids that end a policy turn besides the tokenizer's eos ids (tool-call tags)
    stop_strings: tuple[str, ...] = ()  # texts that end a turn (a tag of several tokens): the turn is cut after the
    # first token whose text completes one (the engine's later tokens are dropped, never trained)
    step_timeout_s: float = 30.0  # a reset or step taking longer ends its episode as an environment error

    def __post_init__(self):
        for name in ("max_turns", "max_turn_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"task.args: {name}={getattr(self, name)}: must be >= 1")
        if self.max_observation_tokens < 0:
            raise ValueError(f"task.args: max_observation_tokens={self.max_observation_tokens}: must be >= 0")
        if not self.step_timeout_s > 0:
            raise ValueError(f"task.args: step_timeout_s={self.step_timeout_s}: must be > 0")


@runtime_checkable
class Environment(Protocol):
    """One episode's environment: made fresh per episode by `EnvironmentTask.environment`, so it may keep state."""

    def reset(self, record: Mapping[str, Any]) -> Segment:
        """The first prompt of an episode for the prompt record ``record`` (the same for every sample of a group)."""

    def step(self, generated: np.ndarray) -> StepResult:
        """The answer to the policy turn ``generated`` (int32 ids as sampled, its stop id included)."""


@runtime_checkable
class EnvironmentTask(Protocol):
    """A multi-turn task: what the RL loop needs to run its episodes.

    ``max_prompt_tokens`` bounds the first prompt and ``max_completion_tokens`` everything after it (policy turns
    and observations): the episode's token budget, which also fixes the training batch's length.
    """

    name: str
    tokenizer: Any  # a `learner.tasks.Tokenizer`
    max_prompt_tokens: int
    max_completion_tokens: int
    limits: EpisodeLimits

    def prompts(self) -> Sequence[Mapping[str, Any]]:
        """Random-access prompt records, as `learner.tasks.Task.prompts` (no ``prompt_ids`` needed)."""

    def environment(self) -> Environment:
        """A fresh environment for one episode."""


_SENTINEL = "\u2063tether-turn\u2063"  # stands for the policy's turn in the template's rendering


def _closing(tokenizer) -> str:
    """The text the chat template puts right after an assistant turn's content (e.g. ``<|im_end|>\n``)."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "?"},
                                              {"role": "assistant", "content": _SENTINEL}], add_generation_prompt=False)
    return rendered[rendered.index(_SENTINEL) + len(_SENTINEL):]


def turn_end_id(tokenizer) -> int:
    """The stop id that ends an assistant turn: the eos id the chat template closes a turn with (e.g. Qwen's
    ``<|im_end|>``), else the first eos id."""
    closing = _closing(tokenizer) if getattr(tokenizer, "chat_template", None) else ""
    return next((i for i in tokenizer.eos_ids if closing and closing.startswith(tokenizer.decode([i]))),
                tokenizer.eos_ids[0])


def message_segment_ids(tokenizer, messages: Sequence[Message], turn=()) -> np.ndarray:
    """int32 ids of ``messages`` as the chat template renders them after an assistant turn, with the generation
    prompt of the next assistant turn: the template's own text and special tokens, encoded alone.

    The segment is the text that the template puts after an assistant turn's content when ``messages`` follow it
    (rendered once with a placeholder turn, so no earlier turn is rendered into it and the history's ids stay those
    the engine saw). It starts with the template's closing of the assistant turn (e.g. ``<|im_end|>\n``), less
    the stop token that ended ``turn`` (the policy's ids) where the policy wrote it itself.
    """
    if not hasattr(tokenizer, "apply_chat_template"):
        raise ValueError(f"an observation given as chat messages needs a tokenizer with a chat template; "
                         f"{type(tokenizer).__name__} has none: return token ids or text")
    base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _SENTINEL}]
    rendered = tokenizer.apply_chat_template([*base, *messages], add_generation_prompt=True)
    if rendered.count(_SENTINEL) != 1:
        raise ValueError("the chat template does not render an assistant turn's content as given; return the "
                         "observation as token ids instead")
    text = rendered[rendered.index(_SENTINEL) + len(_SENTINEL):]
    turn = np.asarray(turn).reshape(-1)
    if turn.size and int(turn[-1]) in tokenizer.eos_ids:
        stop = tokenizer.decode([int(turn[-1])])
        text = text[len(stop):] if text.startswith(stop) else text
    return np.asarray(tokenizer.encode(text), np.int32)


def segment_ids(tokenizer, segment: Segment, first: bool = False, turn=()) -> np.ndarray:
    """int32 ids of a prompt or observation given as ids, text or chat messages (`message_segment_ids`, after the
    policy's ``turn``; the first prompt renders the whole conversation with the generation prompt)."""
    if isinstance(segment, str):
        return np.asarray(tokenizer.encode(segment), np.int32)
    if isinstance(segment, np.ndarray) or all(isinstance(item, (int, np.integer)) for item in segment):
        return np.asarray(segment, np.int32).reshape(-1)
    if first:
        if not hasattr(tokenizer, "apply_chat_template"):
            raise ValueError(f"a first prompt given as chat messages needs a tokenizer with a chat template; "
                             f"{type(tokenizer).__name__} has none")
        return np.asarray(tokenizer.encode(tokenizer.apply_chat_template(list(segment))), np.int32)
    return message_segment_ids(tokenizer, segment, turn)
