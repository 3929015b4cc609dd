"""Host-side batches of a run: rollout groups -> a fixed-shape `TrainBatch`, demonstrations for the warm-up, and
the typed payload process 0 broadcasts to the other processes.

Every step's payload has one shape (``rows`` x ``length``). `PayloadSpec` is that shape, derived from the config
alone (the update then trains at the shortest of a few lengths that holds the batch's longest row: `Trainer.fit`):
process 0 checks the payload it built against it, and the other processes receive into zeros of it
(`jax.experimental.multihost_utils.broadcast_one_to_all` needs the same tree everywhere).

An update with a scored window (``update.scored_window``: `learner.update.UpdateConfig.scored_window`) computes
logprobs only for each row's first ``W`` tokens from its first trained one; a trained token beyond them would
silently get logprob 0, so every batch built here is checked to fit (`check_scored_window`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

import corrections
from learner.logprobs.sampler_replay import SamplerParams, transforms
from learner.tasks import REWARD_BOUND, EnvironmentTask
from learner.update.batch import TrainBatch
from learner.update.bucketing import BucketConfig, pad_batch
from learner.update.logprob_mode import replay_params
from rollout_client import RolloutBatch, collate
from rollout_client.sampling_params import SamplerOrder

logger = logging.getLogger(__name__)
_LOGGED_REWARD_ERRORS = 5  # out-of-bound rewards named per step; the rest counted

TRAIN_BATCH_DTYPES = TrainBatch(tokens=np.int32, positions=np.int32, attention_mask=np.bool_, loss_mask=np.float32,
                                advantages=np.float32, rollout_logprobs=np.float32, policy_version=np.int32)


class NoUsableRolloutsError(RuntimeError):
    """No group of a rollout batch kept 2 scored samples: the engine keeps returning invalid or stale ones, or the
    rewards (the environment) keep failing."""


class Payload(NamedTuple):
    """One step's data, as process 0 broadcasts it."""

    batch: TrainBatch  # [rows, length]; rows past real_rows are fully masked padding
    rewards: np.ndarray  # float32 [rows]
    real_rows: np.ndarray  # int32 scalar: rows holding samples


@dataclasses.dataclass(frozen=True)
class PayloadSpec:
    """The shape and dtypes of every step's `Payload`, the same on every process.

    >>> spec = PayloadSpec(rows=4, length=8, sampling=True, raw=False)
    >>> zeros = spec.zeros()
    >>> zeros.batch.tokens.shape, zeros.batch.sampling.top_k.dtype, zeros.batch.sampling.order is None
    ((4, 8), dtype('int32'), True)
    >>> spec.check(zeros._replace(rewards=np.zeros(3, np.float32)))
    Traceback (most recent call last):
    ...
    ValueError: rollout payload: rewards is float32 (3,), the spec says float32 (4,)
    """

    rows: int
    length: int
    sampling: bool  # the batch carries [rows] sampling params to replay (the sampler changes the distribution)
    raw: bool  # its rollout logprobs are RAW: rebuilt as the sampling distribution's before the update
    order: SamplerOrder = SamplerOrder.TEMPERATURE_FIRST  # the engine's sampler order, as the learner replays it
    scored_window: int | None = None  # the update's scored window: every row's trained tokens must fit in it

    @classmethod
    def of_run(cls, rollout, rows: int, length: int, order: SamplerOrder = SamplerOrder.TEMPERATURE_FIRST,
               scored_window: int | None = None) -> PayloadSpec:
        """The spec a run's ``rollout`` section implies, for an engine whose order replays as ``order`` and an
        update that scores ``scored_window`` tokens per row (`learner.update.UpdateConfig.scored_window`)."""
        transformed = transforms(rollout.temperature, rollout.top_k, rollout.top_p, rollout.min_p)
        return cls(rows, length, sampling=transformed, raw=rollout.logprob_mode == "raw" and transformed,
                   order=order, scored_window=scored_window)

    @property
    def sampler_dtypes(self) -> SamplerParams:
        """The dtypes of ``batch.sampling``; order codes only for a temperature-last engine."""
        order = np.int32 if self.order != SamplerOrder.TEMPERATURE_FIRST else None
        return SamplerParams(temperature=np.float32, top_k=np.int32, top_p=np.float32, min_p=np.float32, order=order)

    def structs(self) -> Payload:
        """The payload as a tree of ``jax.ShapeDtypeStruct``."""
        table, row = (self.rows, self.length), (self.rows,)
        sampler = jax.tree.map(lambda dtype: jax.ShapeDtypeStruct(row, dtype), self.sampler_dtypes)
        batch = jax.tree.map(lambda dtype: jax.ShapeDtypeStruct(table, dtype), TRAIN_BATCH_DTYPES)
        return Payload(batch.replace(sampling=sampler if self.sampling else None),
                       jax.ShapeDtypeStruct(row, np.float32), jax.ShapeDtypeStruct((), np.int32))

    def zeros(self) -> Payload:
        return jax.tree.map(lambda struct: np.zeros(struct.shape, struct.dtype), self.structs())

    def check(self, payload: Payload) -> None:
        """Raises ValueError unless ``payload`` has exactly the spec's structure, shapes and dtypes, and its trained
        tokens fit the scored window."""
        expected = jax.tree_util.tree_flatten_with_path(self.structs())
        actual = jax.tree_util.tree_flatten_with_path(payload)
        if expected[1] != actual[1]:
            raise ValueError(f"rollout payload: structure {actual[1]}, the spec says {expected[1]}")
        for (path, want), (_, got) in zip(expected[0], actual[0]):
            if (np.shape(got), np.asarray(got).dtype) != (want.shape, want.dtype):
                name = jax.tree_util.keystr(path, simple=True, separator=".")
                raise ValueError(f"rollout payload: {name} is {np.asarray(got).dtype} {np.shape(got)}, the spec "
                                 f"says {np.dtype(want.dtype)} {want.shape}")
        check_scored_window(payload.batch.loss_mask, self.scored_window)


def check_scored_window(loss_mask, scored_window: int | None) -> None:
    """Raises ValueError unless every row's trained tokens (``loss_mask`` nonzero, host ``[B, T]``) lie within
    ``scored_window`` tokens of its first one, the only tokens an update with that window scores.

    >>> mask = np.array([[0, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 1]])
    >>> check_scored_window(mask, 4)
    >>> check_scored_window(mask, 3)
    Traceback (most recent call last):
    ...
    ValueError: update.scored_window: the update scores 3 tokens per row from its first trained one, but row 2 trains
    tokens 0 to 3 (a span of 4): the tokens past the window would silently get logprob 0. Set update.scored_window to at
    least 4, or to "off" (every token); "auto" is the completion budget (rollout.max_new_tokens or the task's) rounded
    up to a multiple of 8
    """
    if scored_window is None:
        return
    trained = np.asarray(loss_mask) != 0
    if trained.shape[1] == 0:
        return
    any_trained = trained.any(axis=1)
    first = np.argmax(trained, axis=1)
    last = trained.shape[1] - 1 - np.argmax(trained[:, ::-1], axis=1)
    span = np.where(any_trained, last - first + 1, 0)
    if span.max() > scored_window:
        row = int(np.argmax(span))
        raise ValueError(f"update.scored_window: the update scores {scored_window} tokens per row from its first "
                         f"trained one, but row {row} trains tokens {first[row]} to {last[row]} (a span of "
                         f"{span[row]}): the tokens past the window would silently get logprob 0. Set "
                         f"update.scored_window to at least {span[row]}, or to \"off\" (every token); \"auto\" is "
                         "the completion budget (rollout.max_new_tokens or the task's) rounded up to a multiple of 8")


def _cast(tree, dtypes):
    return jax.tree.map(lambda x, dtype: np.asarray(x, dtype), tree, dtypes)


def bounded_rewards(rewards) -> tuple[np.ndarray, list[str]]:
    """float32 rewards with NaN (skipped) where a task's reward is infinite or beyond ``|r| <= REWARD_BOUND``, and
    one line per such sample. Checked in float64, before the cast: 1e300 is finite there and inf in float32. A task
    built on `learner.tasks.RewardSet` skips these itself; a plug-in task's rewards are checked here.

    >>> values, lines = bounded_rewards([1.0, 1e300, float("nan"), -2e6])
    >>> np.isnan(values).tolist(), len(lines)
    ([False, True, True, True], 2)
    >>> print(lines[1])
    reward -2e+06 of sample 3 is beyond |reward| <= 1e+06 (rewards are trained in float32): skipped
    """
    rewards = np.asarray(rewards, np.float64)
    beyond = ~np.isnan(rewards) & ~(np.abs(rewards) <= REWARD_BOUND)
    lines = [f"reward {rewards[i]:.6g} of sample {i} is beyond |reward| <= {REWARD_BOUND:g} (rewards are trained in "
             "float32): skipped" for i in np.flatnonzero(beyond)]
    return np.where(beyond, np.nan, rewards).astype(np.float32), lines


def assemble_payload(groups: Sequence[Sequence[Any]], rows_of_groups: Sequence[Mapping[str, Any]], task,
                     spec: PayloadSpec, num_samples: int, logprob_mode: str,
                     reward_errors: list[str] | None = None,
                     drops: collections.Counter | None = None) -> tuple[Payload, RolloutBatch]:
    """Groups -> ``(payload, collated)``: the step's `Payload` (checked against ``spec``) and the
    `rollout_client.collate` batch with the sampler settings the engine echoed.

    A failed sample costs itself, not its group. Rewards come from ``task.rewards`` with each group's prompt record
    (``rows_of_groups[g]``); an environment task's rewards are its episodes' (`learner.rl.episodes.Episode.reward`:
    NaN after an environment error). A sample is left out when it is missing from its group (dropped as stale or
    invalid) or its reward is NaN (a reward the task skipped, e.g. one that raised) or infinite or beyond
    `learner.tasks.REWARD_BOUND` (`bounded_rewards`: logged, and the lines appended to ``reward_errors`` when given;
    the run counts them in ``reward/skipped_samples``). The group's other samples train, with GRPO advantages over
    the samples that scored (`corrections.grpo_advantages` with ``scored``: verl's advantages over the samples left
    after a filter), broadcast over each sample's trained tokens (an episode's observations are masked:
    `rollout_client.Sample.completion_mask`). A group left with fewer than 2 scored samples has no advantage to
    learn from: it is dropped, and counted in ``drops["groups_dropped"]`` when ``drops`` is given. Missing rows
    are fully masked padding.
    """
    present = [(group, row) for group, row in zip(groups, rows_of_groups) if len(group)]
    if not present:
        raise NoUsableRolloutsError("every sample of this rollout batch was dropped (stale or invalid samples)")
    records = [row for group, row in present for _ in group]
    flat = [s for group, _ in present for s in group]
    rewards, lines = bounded_rewards([s.reward for s in flat] if isinstance(task, EnvironmentTask)  # episodes'
                                     else task.rewards(records, [s.completion_token_ids for s in flat]))
    for line in lines[:_LOGGED_REWARD_ERRORS]:
        logger.warning("%s", line)
    if len(lines) > _LOGGED_REWARD_ERRORS:
        logger.warning("... and %d more rewards beyond the bound", len(lines) - _LOGGED_REWARD_ERRORS)
    if reward_errors is not None:
        reward_errors.extend(lines)
    table = np.full((len(present), num_samples), np.nan, np.float32)  # [group, sample]: NaN where none scored
    starts = np.cumsum([0] + [len(group) for group, _ in present])
    for g, (group, _) in enumerate(present):
        table[g, :len(group)] = rewards[starts[g]:starts[g + 1]]
    scored = ~np.isnan(table)
    trained = scored & (scored.sum(axis=1, keepdims=True) >= 2)
    if drops is not None:
        drops["groups_dropped"] += len(groups) - int(trained.any(axis=1).sum())
    if not trained.any():
        lost = len(groups) * num_samples - len(flat)
        raise NoUsableRolloutsError(f"no group of this rollout batch had 2 scored samples: {lost} lost samples "
                                    f"(stale or invalid), {len(flat) - int(scored.sum())} had a skipped reward")
    advantages = np.asarray(corrections.grpo_advantages(np.where(scored, table, 0.0).reshape(-1), num_samples,
                                                        scored=scored.reshape(-1)), np.float32)[trained.reshape(-1)]
    samples = [sample for g, (group, _) in enumerate(present) for j, sample in enumerate(group) if trained[g, j]]
    rewards = table[trained]
    collated = collate(samples, pad_to_multiple=spec.length, pad_token_id=task.tokenizer.pad_id)
    width = collated.tokens.shape[1]
    lengths = collated.prompt_lengths + collated.completion_lengths
    batch = TrainBatch(
        tokens=collated.tokens, positions=np.broadcast_to(np.arange(width, dtype=np.int32), collated.tokens.shape),
        attention_mask=np.arange(width) < lengths[:, None], loss_mask=collated.loss_mask,
        advantages=advantages[:, None] * collated.loss_mask, rollout_logprobs=collated.rollout_logprobs,
        policy_version=collated.policy_versions, sampling=replay_params(logprob_mode, collated, spec.order))
    batch = pad_batch(batch, BucketConfig(min_length=spec.length, max_length=spec.length), row_multiple=spec.rows)
    batch = _cast(batch.replace(sampling=None), TRAIN_BATCH_DTYPES).replace(
        sampling=None if batch.sampling is None else _cast(batch.sampling, spec.sampler_dtypes))
    payload = Payload(batch, np.pad(rewards, (0, spec.rows - len(samples))), np.int32(len(samples)))
    spec.check(payload)
    return payload, collated


def demonstration_batch(task, rng: np.random.Generator, size: int, noise: float, length: int,
                        row_multiple: int, scored_window: int | None = None) -> TrainBatch:
    """A supervised batch of noisy demonstrations of random prompts of ``task`` (loss on the completion tokens).

    Needs a task with ``make_prompt`` and ``noisy_demonstration`` (`learner.tasks.Demonstrations`): fresh prompts,
    not the RL prompt stream. Host NumPy ``[size', length]``. The loss covers every completion token, the stop id
    included, also when it is the pad id (rows end where their tokens do, whatever their ids); a demonstration
    longer than the row is cut there, as a rollout at its length limit. A multi-turn task's demonstration may be
    ``(ids, mask)``: the loss then covers the completion tokens where ``mask`` is 1 (its policy turns, not the
    observations). ``scored_window``: the update's
    (`check_scored_window`); a longer demonstration raises.
    """
    tokens = np.full((size, length), task.tokenizer.pad_id, np.int32)
    loss_mask = np.zeros((size, length), np.float32)
    lengths = np.zeros(size, np.int32)  # real tokens per row (not `tokens != pad_id`: pad may equal eos)
    for row in range(size):
        prompt = np.asarray(task.make_prompt(rng)[0], np.int32)
        completion = task.noisy_demonstration(prompt, rng, noise)
        completion, trained = completion if isinstance(completion, tuple) else (completion, np.ones(len(completion)))
        keep = max(length - len(prompt), 0)  # cut at the row's end
        completion, trained = np.asarray(completion, np.int32)[:keep], np.asarray(trained, np.float32)[:keep]
        tokens[row, :len(prompt) + len(completion)] = np.concatenate([prompt, completion])
        loss_mask[row, len(prompt):len(prompt) + len(completion)] = trained
        lengths[row] = len(prompt) + len(completion)
    zeros = np.zeros_like(loss_mask)
    check_scored_window(loss_mask, scored_window)
    attention = np.arange(length) < lengths[:, None]
    batch = TrainBatch(tokens=tokens, positions=np.broadcast_to(np.arange(length, dtype=np.int32), tokens.shape),
                       attention_mask=attention, loss_mask=loss_mask, advantages=zeros, rollout_logprobs=zeros,
                       policy_version=np.zeros_like(tokens))
    return pad_batch(batch, BucketConfig(min_length=length, max_length=length), row_multiple=row_multiple)
