"""Multi-turn episodes against any engine: token in, token out, with per-token provenance.

An episode of an `learner.tasks.EnvironmentTask` is ONE token sequence: the first prompt, then policy turns and
the environment's observations. Turn ``k``'s prompt is exactly the ids of turn ``k - 1``'s prompt, the ids the
engine returned for it and the observation's ids (`learner.tasks.segment_ids`): nothing is decoded and
re-tokenized, so the ids trained on are the ids each engine was given and returned.

The episode is returned as an `Episode`, a `rollout_client.Sample` whose completion is everything after the first
prompt and whose ``completion_mask`` is 1 on policy tokens only: observations are never trained and count in no
denominator or sequence statistic. Each policy token keeps the logprob and the policy version the engine stamped
on it, so a publish between two turns shows as version v on the first and v + 1 on the second, and the
corrections see each token's own behaviour logprob and staleness.

`EpisodeRunner` wraps a run's engine: ``submit(EpisodeRequest)`` runs a group of ``num_samples`` episodes of one
prompt record (a GRPO group per first prompt) and resolves to their list, as ``Engine.submit`` does for samples, so
`rollout_client.RolloutBuffer` keeps many in flight; each episode runs in its own worker thread, so turns of
different episodes interleave on the engine. The environment is called, checked and given up on at a boundary
(`learner.rl.environment_calls`): an error, a timeout or a bad value ends its episode with a NaN reward (the sample
is left out of the batch, as a skipped reward), is counted, and never stops the run.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from learner.rl.environment_calls import EnvironmentCalls, EnvironmentFailure, segment_ids_of, step_result
from learner.tasks import Environment, EnvironmentTask
from rollout_client import Engine, LogprobMode, RolloutRequest, Sample, SamplingParams
from rollout_client.sampling_params import FinishReason, derived_seed

ENDINGS = ("done", "max_turns", "max_tokens", "env_error", "lost")  # why an episode ended (Episode.ended_by)


@dataclasses.dataclass(frozen=True)
class EpisodeRequest:
    """``num_samples`` episodes of the prompt record ``record``: one GRPO group."""

    record: Mapping[str, Any]
    sampling: SamplingParams  # every policy turn's (max_new_tokens and stop ids are set per turn)
    num_samples: int = 1
    logprob_mode: LogprobMode = LogprobMode.PROCESSED
    request_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)


@dataclasses.dataclass(frozen=True)
class Episode(Sample):
    """A whole episode as one `Sample` (see the module docstring), with what the environment reported."""

    reward: float = 0.0  # sum of the steps' rewards; NaN after an environment error
    turns: int = 0  # policy turns
    tool_calls: int = 0  # steps whose info said "tool_call"
    tool_errors: int = 0  # steps whose info said "tool_error"
    ended_by: str = "done"  # one of ENDINGS
    observations_cut: int = 0  # observations cut to the task's max_observation_tokens


def turn_seed(seed: int | None, episode: int, turn: int) -> int | None:
    """The sampling seed of one turn of a seeded group: each turn is its own one-sample request (sample index 0), so
    a shared seed would give every episode of the group the same draws. None: unseeded (the client draws one).

    >>> turn_seed(None, 0, 0), turn_seed(7, 0, 1) == turn_seed(7, 0, 1) != turn_seed(7, 1, 0)
    (None, True)
    """
    return None if seed is None else derived_seed(seed, episode, turn)


def stop_string_end(tokenizer, ids, stop_strings: Sequence[str]) -> int:
    """How many of a turn's ``ids`` to keep: up to the first token whose text completes one of ``stop_strings``
    (all of them when none appears).

    >>> from learner.tasks import CharTokenizer
    >>> tokenizer = CharTokenizer()
    >>> stop_string_end(tokenizer, tokenizer.encode("12</call>34"), ["</call>"]), stop_string_end(tokenizer, [], [])
    (9, 0)
    """
    if stop_strings:
        for end in range(1, len(ids) + 1):
            try:
                text = tokenizer.decode(ids[:end])
            except ValueError:  # an id the tokenizer cannot decode (the character one's specials): no text there
                continue
            if any(stop in text for stop in stop_strings):
                return end
    return len(ids)


class EpisodeRunner(Engine):
    """``engine`` running episodes of ``task`` (see the module docstring); everything else passes through.

    Args:
      engine: the run's engine (its ``submit`` takes `rollout_client.RolloutRequest`).
      task: an `learner.tasks.EnvironmentTask`.
      max_workers: episodes run at once (each holds a thread while it waits on the engine or the environment).
    """

    def __init__(self, engine: Engine, task: EnvironmentTask, max_workers: int = 64):
        self.engine = engine
        self.name, self.capabilities = engine.name, engine.capabilities
        self.task, self.limits = task, task.limits
        self._episodes = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="episode")
        self._environment_calls = EnvironmentCalls(task.name)
        self._lock = threading.Lock()
        self._counts = collections.Counter()
        self._version = 0  # the last version published: stamped on an episode that has no policy token
        self.last_environment_error: str | None = None  # the latest environment failure's message, for debugging

    def info(self):
        return self.engine.info()

    def publish(self, policy_version: int, weights) -> int:
        self._version = self.engine.publish(policy_version, weights)
        return self._version

    def submit(self, request: EpisodeRequest) -> concurrent.futures.Future:
        """Starts the group's episodes; the future resolves to the episodes that ended (a lost one is left out)."""
        group: concurrent.futures.Future = concurrent.futures.Future()
        episodes = [self._episodes.submit(self.run_episode, request, index) for index in range(request.num_samples)]

        finishing = threading.Lock()  # the last two episodes may end at once, on two threads

        def finish(_):
            with finishing:
                if group.done() or not all(episode.done() for episode in episodes):
                    return
                if any(episode.cancelled() for episode in episodes):  # closed before it ran
                    group.cancel()
                    return
                errors = [episode.exception() for episode in episodes if episode.exception() is not None]
                if errors:
                    group.set_exception(errors[0])
                else:
                    group.set_result([e for e in (episode.result() for episode in episodes) if e is not None])

        for episode in episodes:
            episode.add_done_callback(finish)
        return group

    def run_episode(self, request: EpisodeRequest, index: int) -> Episode | None:
        """One episode of ``request.record``; None if the engine lost a turn (dropped as invalid, counted there)."""
        limits, tokenizer = self.limits, self.task.tokenizer
        calls = self._environment_calls
        stop_ids = tuple(dict.fromkeys([*tokenizer.eos_ids, *limits.stop_ids]))
        try:
            environment = calls.call(self.task.environment, timeout_s=limits.step_timeout_s)
            if not isinstance(environment, Environment):
                raise EnvironmentFailure(f"{calls.describe(self.task.environment)} returned "
                                         f"{type(environment).__name__}: it needs reset and step methods")
            what = calls.describe(environment.reset)
            prompt = segment_ids_of(tokenizer, calls.call(environment.reset, request.record,
                                                          timeout_s=limits.step_timeout_s),
                                    what, "a first prompt", first=True)
            if not 0 < prompt.size <= self.task.max_prompt_tokens:
                raise EnvironmentFailure(f"{what} returned a first prompt of {prompt.size} tokens: it must have 1 to "
                                         f"{self.task.max_prompt_tokens} (the task's max_prompt_tokens)")
        except EnvironmentFailure as error:
            return self._failed_reset(request, index, error)
        budget = self.task.max_completion_tokens
        ids, mask, logprobs, versions = [], [], [], []  # per completion token
        reward, turns, tool_calls, tool_errors, cut, ended_by = 0.0, 0, 0, 0, 0, "done"
        sample = None
        while True:
            room = budget - len(ids)
            sampling = dataclasses.replace(request.sampling, max_new_tokens=min(limits.max_turn_tokens, room),
                                           stop_token_ids=stop_ids, stop_strings=limits.stop_strings,
                                           seed=turn_seed(request.sampling.seed, index, turns))
            turn_prompt = np.concatenate([prompt, np.asarray(ids, np.int32)]).astype(np.int32)
            samples = self.engine.submit(RolloutRequest(
                turn_prompt, sampling=sampling, num_samples=1, logprob_mode=request.logprob_mode,
                request_id=f"{request.request_id}-{index}-{turns}")).result()
            if not samples:
                self._count("lost")
                return None
            sample = samples[0]
            kept = stop_string_end(tokenizer, sample.completion_token_ids, limits.stop_strings)
            if kept < sample.completion_token_ids.size:
                self._count("stop_string_cuts")
            generated = np.asarray(sample.completion_token_ids[:kept], np.int32)
            ids += generated.tolist()
            mask += [1.0] * generated.size
            logprobs += np.asarray(sample.logprobs[:kept], np.float32).tolist()
            versions += np.asarray(sample.policy_versions[:kept], np.int64).tolist()
            turns += 1
            try:
                what = calls.describe(environment.step)
                result = step_result(calls.call(environment.step, generated.copy(), timeout_s=limits.step_timeout_s),
                                     what)
                reward += float(result.reward)
                tool_calls += bool(result.info.get("tool_call"))
                tool_errors += bool(result.info.get("tool_error"))
                if result.done:
                    break
                if turns >= limits.max_turns:
                    ended_by = "max_turns"
                    break
                observation = segment_ids_of(tokenizer, result.observation, what, "observation", turn=generated)
            except EnvironmentFailure as error:
                reward, ended_by = float("nan"), "env_error"
                self._count("env_errors")
                self._note_error(error)
                break
            if observation.size > limits.max_observation_tokens:
                observation, cut = observation[:limits.max_observation_tokens], cut + 1
            if len(ids) + observation.size >= budget:  # no room left for a policy token after it
                ended_by = "max_tokens"
                break
            ids += observation.tolist()
            mask += [0.0] * observation.size
            logprobs += [0.0] * observation.size
            versions += [versions[-1]] * observation.size  # the version of the turn it answers (Sample's rule)
        self._count(ended_by)
        self._count("observations_cut", cut)
        return Episode(request_id=request.request_id, sample_index=index, prompt_token_ids=prompt,
                       completion_token_ids=np.asarray(ids, np.int32), logprobs=np.asarray(logprobs, np.float32),
                       policy_versions=np.asarray(versions, np.int64), finish_reason=sample.finish_reason,
                       sampling=sample.sampling, logprob_mode=sample.logprob_mode,
                       completion_mask=np.asarray(mask, np.float32), reward=reward, turns=turns,
                       tool_calls=tool_calls, tool_errors=tool_errors, ended_by=ended_by, observations_cut=cut)

    def _failed_reset(self, request: EpisodeRequest, index: int, error: Exception) -> Episode:
        """An episode whose reset failed: no policy token, a NaN reward (left out of the batch)."""
        self._count("env_errors")
        self._note_error(error)
        return Episode(request_id=request.request_id, sample_index=index, prompt_token_ids=np.zeros(0, np.int32),
                       completion_token_ids=np.asarray([self.task.tokenizer.pad_id], np.int32),
                       logprobs=np.zeros(1, np.float32), policy_versions=np.asarray([self._version], np.int64),
                       finish_reason=FinishReason.ABORT, sampling=request.sampling,
                       logprob_mode=request.logprob_mode, completion_mask=np.zeros(1, np.float32),
                       reward=float("nan"), ended_by="env_error")

    def _count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[name] += amount

    def _note_error(self, error: Exception) -> None:
        with self._lock:
            self.last_environment_error = str(error)
        self._environment_calls.note(error)

    def metrics(self) -> dict[str, float]:
        """The engine's counters and the episodes' (cumulative): environment errors, lost episodes, how episodes
        ended (each limit hit), observations cut and turns cut at a stop string."""
        with self._lock:
            counts = dict(self._counts)
        return {**self.engine.metrics(), "multiturn/env_errors": counts.get("env_errors", 0),
                "multiturn/episodes_lost": counts.get("lost", 0),
                "multiturn/observations_cut": counts.get("observations_cut", 0),
                "multiturn/stop_string_cuts": counts.get("stop_string_cuts", 0), **self._environment_calls.metrics(),
                **{f"multiturn/ended_by/{name}": counts.get(name, 0) for name in ENDINGS[:3]}}

    def close(self) -> None:
        """Stops the episode workers (episodes in flight are abandoned) and closes the engine."""
        self._episodes.shutdown(wait=False, cancel_futures=True)
        self.engine.close()


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """Means over one step's episodes: turns, tool calls and errors per episode, and the fraction of the tokens
    after the first prompt that the environment wrote (masked, never trained)."""
    if not episodes:
        return {}
    completion = sum(e.completion_token_ids.size for e in episodes)
    env_tokens = sum(float((e.completion_mask == 0).sum()) for e in episodes)
    return {"multiturn/turns_mean": float(np.mean([e.turns for e in episodes])),
            "multiturn/tool_calls_mean": float(np.mean([e.tool_calls for e in episodes])),
            "multiturn/tool_errors": float(sum(e.tool_errors for e in episodes)),
            "multiturn/env_tokens_fraction": env_tokens / max(completion, 1)}
