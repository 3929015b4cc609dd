"""The prompt stream of a run: the task's records, shuffled and batched by grain, with a resumable position."""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from learner.rl.episodes import EpisodeRequest
from learner.rl.prompt_dataset import prompt_dataset, prompt_iterator
from rollout_client import LogprobMode, RolloutRequest, SamplingParams
from rollout_client.sampling_params import derived_seed


class DataPosition:
    """A saved prompt-stream position in the form grain's orbax handler stores (``get_state`` / ``set_state``)."""

    def __init__(self, state: dict):
        self.state = state

    def get_state(self) -> bytes:
        return json.dumps(self.state).encode()

    def set_state(self, state: bytes) -> None:
        self.state = json.loads(state)

    def start_prefetch(self) -> None:
        """Nothing to prefetch: the caller applies ``state`` to its own iterator."""


class PromptStream:
    """Rollout requests, one per prompt record, in the order of a grain pipeline over the task's records.

    The pipeline shuffles record indices with ``seed`` and reshuffles every epoch (`learner.rl.prompt_dataset`); every
    process
    walks the whole stream (process 0 issues the requests). ``position(n)`` is the iterator state before the
    ``n``-th batch pulled: after ``n`` trained batches, the position to resume from. `next_record` gives the
    prompt records of the issued requests in issue order (the order `rollout_client.RolloutBuffer` returns them).
    ``episodes``: the requests are `learner.rl.episodes.EpisodeRequest` of the records (an environment task's).
    ``sampling_seed``: each request is drawn with a seed derived from it, the batch's number in the stream and the
    request's place in the batch (`rollout_client.sampling_params.derived_seed`), so a resumed or repeated run
    asks for the same draws; None: the client draws a random seed per request.
    """

    def __init__(self, records, batch_size: int, seed: int, sampling: SamplingParams, num_samples: int,
                 logprob_mode: LogprobMode, episodes: bool = False, sampling_seed: int | None = None):
        self._records = records
        dataset = prompt_dataset(np.arange(len(records)), lambda index: {"index": np.int64(index)},
                                 global_batch_size=batch_size, seed=seed, process_index=0, process_count=1)
        self._iterator = prompt_iterator(dataset)
        self._sampling, self._num_samples, self._mode = sampling, num_samples, logprob_mode
        self._episodes = episodes
        self._sampling_seed = sampling_seed
        self._positions: list[dict] = []
        self._issued: collections.deque[Mapping[str, Any]] = collections.deque()

    def get_state(self) -> dict:
        return self._iterator.get_state()

    def set_state(self, state: dict) -> None:
        self._iterator.set_state(state)
        self._positions.clear()

    def position(self, batches_trained: int) -> dict:
        return self._positions[batches_trained] if batches_trained < len(self._positions) else self.get_state()

    def skip_batch(self) -> None:
        """Advances by one batch without issuing it (processes other than 0 keep their position in step)."""
        self._positions.append(self.get_state())
        next(self._iterator)

    def requests(self) -> Iterator[RolloutRequest]:
        while True:
            state = self.get_state()
            self._positions.append(state)
            for place, index in enumerate(next(self._iterator)["index"]):
                record = self._records[int(index)]
                sampling = self._sampling if self._sampling_seed is None else dataclasses.replace(
                    self._sampling, seed=derived_seed(self._sampling_seed, state["next_index"], place))
                if self._episodes:
                    request = EpisodeRequest(record, sampling=sampling, num_samples=self._num_samples,
                                             logprob_mode=self._mode)
                else:
                    request = RolloutRequest(np.asarray(record["prompt_ids"], np.int32), sampling=sampling,
                                             num_samples=self._num_samples, logprob_mode=self._mode)
                self._issued.append(record)
                yield request

    def next_record(self) -> Mapping[str, Any]:
        """The prompt record of the oldest issued request not asked for yet."""
        return self._issued.popleft()
