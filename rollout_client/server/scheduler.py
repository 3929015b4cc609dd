"""Batches concurrent sequences through a `Generator` on one thread.

The scheduler owns what every engine needs the same way: a queue of admitted
sequences, stop and length rules, pause (abort / wait / keep) and resume, weight
updates while paused, and the policy version stamped on each generated token.
A sequence kept across a weight update (partial rollouts) decodes on with the new
weights from the next step, its tokens stamped with the new version; unless the
KEEP pause said `KvCache.KEEP`, the generator first rebuilds the kept sequences'
KV cache under the new weights (`Generator.recompute_cache`).
Outputs go to a per-sequence callback, called with the scheduler's lock held, so
callbacks must only hand the output over (e.g. `loop.call_soon_threadsafe`).
"""

import collections
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Mapping

import numpy as np

from rollout_client.protocol import MAX_POLICY_VERSION
from rollout_client.sampling_params import FinishReason, KvCache, PauseMode
from rollout_client.server.generator import Generator, PreconditionError, SequenceOutput, SequenceSpec

OutputSink = Callable[[SequenceOutput], None]


@dataclasses.dataclass
class _Sequence:
    spec: SequenceSpec
    sink: OutputSink
    chunk_tokens: int
    stop_token_ids: tuple[int, ...]
    arrived: float
    started: float = 0.0
    generated: int = 0
    emitted: int = 0
    pending_tokens: list = dataclasses.field(default_factory=list)
    pending_logprobs: list = dataclasses.field(default_factory=list)
    spans: list = dataclasses.field(default_factory=list)  # [start, end, version] lists.


class Scheduler:
    """Runs the generation loop on a daemon thread.

    Args:
      generator: the engine that advances sequences.
      policy_version: version of the generator's initial weights.
      on_failure: called (on the loop's thread) with the error that stopped the loop, e.g. the device running out of
        memory in ``generator.step``: the server must end then, not stay up with requests that nothing advances.
    """

    def __init__(self, generator: Generator, policy_version: int = 0,
                 on_failure: Callable[[BaseException], None] | None = None):
        if not 0 <= policy_version <= MAX_POLICY_VERSION:
            raise ValueError(f"policy_version: must be in [0, {MAX_POLICY_VERSION}], got {policy_version}")
        self._generator = generator
        self._policy_version = policy_version
        self._cond = threading.Condition()
        self._ids = itertools.count()
        self._queued: collections.OrderedDict[int, _Sequence] = collections.OrderedDict()
        self._active: dict[int, _Sequence] = {}
        self._to_remove: list[int] = []
        self._paused = False
        self._draining = False
        self._stepping = False
        self._closed = False
        self._kv_cache = KvCache.RECOMPUTE  # what the last KEEP pause asked for the kept sequences' cache
        self._stale_cache = False  # kept sequences hold keys and values of older weights, to be recomputed
        self._on_failure = on_failure
        self._thread = threading.Thread(target=self._run_until_failure, name="rollout-scheduler", daemon=True)
        self._thread.start()

    @property
    def policy_version(self) -> int:
        return self._policy_version

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def compiled_programs(self) -> int:
        """The generator's count of programs built (`Generator.compiled_programs`)."""
        return self._generator.compiled_programs

    def submit(self, spec: SequenceSpec, sink: OutputSink, chunk_tokens: int = 0) -> int:
        """Queues a sequence; returns its id. Outputs go to `sink`."""
        sequence = _Sequence(
            spec=spec,
            sink=sink,
            chunk_tokens=chunk_tokens,
            stop_token_ids=tuple(spec.sampling.stop_token_ids),
            arrived=time.monotonic(),
        )
        with self._cond:
            sequence_id = next(self._ids)
            self._queued[sequence_id] = sequence
            self._cond.notify_all()
        return sequence_id

    def cancel(self, sequence_id: int) -> bool:
        """Finishes a queued or active sequence with ABORT; False if it already finished."""
        with self._cond:
            return self._finish(sequence_id, FinishReason.ABORT)

    def pause(self, mode: PauseMode, timeout_s: float | None = None, kv_cache: KvCache = KvCache.RECOMPUTE
              ) -> None:
        """Stops generation as `mode` says; returns once no step is running. ``kv_cache``: what a weight update
        while paused does with the kept sequences' cache (KEEP mode).

        Raises:
          TimeoutError: WAIT mode and active sequences did not finish in time.
        """
        with self._cond:
            if mode == PauseMode.WAIT:
                self._draining = True
                drained = self._cond.wait_for(lambda: not self._active or self._closed, timeout_s)
                self._draining = False
                if not drained:
                    raise TimeoutError(f"pause(WAIT): {len(self._active)} sequences still active")
            self._paused = True
            self._kv_cache = kv_cache
            self._cond.wait_for(lambda: not self._stepping)
            if mode == PauseMode.ABORT:
                for sequence_id in list(self._active) + list(self._queued):
                    self._finish(sequence_id, FinishReason.ABORT)
            self._cond.notify_all()

    def resume(self) -> None:
        """Lets generation continue; kept sequences continue where they stopped."""
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def check_version(self, policy_version: int) -> None:
        """Raises ValueError unless `policy_version` exceeds the current one and is at most `MAX_POLICY_VERSION`."""
        if not self._policy_version < policy_version <= MAX_POLICY_VERSION:
            raise ValueError(f"policy_version: {policy_version} must exceed the server's {self._policy_version} "
                             f"and be at most {MAX_POLICY_VERSION}")

    def update_weights(self, weights: Mapping[str, np.ndarray], policy_version: int) -> None:
        """Loads new weights; tokens generated from now on carry `policy_version`. Kept sequences' caches are
        recomputed before their next token unless the pause said `KvCache.KEEP`.

        Raises:
          PreconditionError: not paused.
          ValueError: the version does not increase or is above `MAX_POLICY_VERSION`, or the weights do not match.
        """
        with self._cond:
            if not self._paused:
                raise PreconditionError("UpdateWeights: generation must be paused first")
            self.check_version(policy_version)
            self._generator.load_weights(weights)
            self._policy_version = policy_version
            self._stale_cache |= bool(self._active) and self._kv_cache == KvCache.RECOMPUTE

    def close(self) -> None:
        """Aborts everything and stops the thread."""
        with self._cond:
            for sequence_id in list(self._active) + list(self._queued):
                self._finish(sequence_id, FinishReason.ABORT)
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def _finish(self, sequence_id: int, reason: FinishReason) -> bool:
        sequence = self._queued.pop(sequence_id, None)
        if sequence is None:
            sequence = self._active.pop(sequence_id, None)
            if sequence is None:
                return False
            self._to_remove.append(sequence_id)
        now = time.monotonic()
        started = sequence.started or now
        tokens, logprobs = _take_pending(sequence)
        sequence.sink(SequenceOutput(
            token_ids=tokens,
            logprobs=logprobs,
            version_spans=tuple(tuple(span) for span in sequence.spans),
            finish_reason=reason,
            prompt_tokens=len(sequence.spec.prompt_token_ids),
            completion_tokens=sequence.generated,
            queue_s=started - sequence.arrived,
            generate_s=now - started,
        ))
        self._cond.notify_all()
        return True

    def _has_work(self) -> bool:
        if self._to_remove or self._closed:
            return True
        if self._paused:
            return False
        return bool(self._active) or (bool(self._queued) and not self._draining)

    def _run_until_failure(self) -> None:
        try:
            self._run()
        except BaseException as error:
            if self._on_failure is None:
                raise
            self._on_failure(error)

    def _run(self) -> None:
        capacity = self._generator.info.max_batch_size
        while True:
            with self._cond:
                self._cond.wait_for(self._has_work)
                if self._closed:
                    return
                for sequence_id in self._to_remove:
                    self._generator.remove(sequence_id)
                self._to_remove.clear()
                if self._paused:
                    continue
                while self._queued and len(self._active) < capacity and not self._draining:
                    sequence_id, sequence = self._queued.popitem(last=False)
                    sequence.started = time.monotonic()
                    self._generator.add(sequence_id, sequence.spec)
                    self._active[sequence_id] = sequence
                if not self._active:
                    continue
                self._stepping = True
                version = self._policy_version
                recompute, self._stale_cache = self._stale_cache, False
            try:
                if recompute:
                    self._generator.recompute_cache()
                outputs = self._generator.step()
            finally:
                with self._cond:
                    self._stepping = False
                    self._cond.notify_all()
            with self._cond:
                for sequence_id, (tokens, logprobs) in outputs.items():
                    if sequence_id in self._active:
                        self._append(sequence_id, tokens, logprobs, version)

    def _append(self, sequence_id: int, tokens: np.ndarray, logprobs: np.ndarray, version: int) -> None:
        sequence = self._active[sequence_id]
        limit = sequence.spec.sampling.max_new_tokens - sequence.generated
        tokens, logprobs = tokens[:limit], logprobs[:limit]
        stop = _first_stop(tokens, sequence.stop_token_ids)
        count = len(tokens) if stop is None else stop + 1
        if count:
            start = sequence.generated
            if sequence.spans and sequence.spans[-1][2] == version:
                sequence.spans[-1][1] = start + count
            else:
                sequence.spans.append([start, start + count, version])
            sequence.pending_tokens.append(tokens[:count])
            sequence.pending_logprobs.append(logprobs[:count])
            sequence.generated += count
        if stop is not None:
            self._finish(sequence_id, FinishReason.STOP)
        elif sequence.generated >= sequence.spec.sampling.max_new_tokens:
            self._finish(sequence_id, FinishReason.LENGTH)
        elif sequence.chunk_tokens and sequence.generated - sequence.emitted >= sequence.chunk_tokens:
            start = sequence.emitted
            tokens, logprobs = _take_pending(sequence)
            spans = tuple((max(s, start), e, v) for s, e, v in sequence.spans if e > start)
            sequence.sink(SequenceOutput(token_ids=tokens, logprobs=logprobs, version_spans=spans))


def _first_stop(tokens: np.ndarray, stop_token_ids: tuple[int, ...]) -> int | None:
    """Index of the first stop token in `tokens`, or None (a few comparisons: np.isin costs ~10x more)."""
    if not stop_token_ids or not tokens.size:
        return None
    hits = tokens == stop_token_ids[0]
    for token_id in stop_token_ids[1:]:
        hits |= tokens == token_id
    index = int(hits.argmax())
    return index if hits[index] else None


def _take_pending(sequence: _Sequence) -> tuple[np.ndarray, np.ndarray]:
    """Pops the tokens not yet delivered."""
    tokens = np.concatenate(sequence.pending_tokens or [np.zeros(0, np.int32)]).astype(np.int32, copy=False)
    logprobs = np.concatenate(sequence.pending_logprobs or [np.zeros(0, np.float32)]).astype(np.float32, copy=False)
    sequence.pending_tokens.clear()
    sequence.pending_logprobs.clear()
    sequence.emitted = sequence.generated
    return tokens, logprobs
