"""A rollout log: every trained batch, stored with tensorstore (zarr v3), for offline analysis.

Layout under the log directory: one array per per-token field, ``[rows, max_length]`` (rows of all batches
concatenated, each right-padded with zeros to the log's ``max_length``), ``rewards`` ``[rows]``,
``learner_version`` ``[rows]`` (the learner's policy version when the row was trained, so that each token's
staleness can be recomputed; -1 in rows of logs written before it was kept), and ``index`` ``[batches, 4]`` int64
holding ``(step, first_row, num_rows, length)`` per batch, where ``length`` is the batch's true T. Arrays grow
along their first axis by doubling; the index's leading entries with ``num_rows > 0`` are the logged batches,
everything after them is spare capacity.

Writes are asynchronous: ``append`` starts the writes of a batch and returns; the next ``append`` waits for them
(they have had a training step to finish), then starts writing the batch's index entry. A batch is thus in the
log only once its arrays are written, and a crash loses at most the last batch or two.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Iterator

import numpy as np
import tensorstore as ts

TOKEN_FIELDS = {  # per-token [B, T] fields and their stored dtypes
    "tokens": np.int32,
    "loss_mask": np.float32,
    "rollout_logprobs": np.float32,
    "proximal_logprobs": np.float32,
    "advantages": np.float32,
    "policy_version": np.int32,
}
ROW_FIELDS = {"rewards": (np.float32, 0), "learner_version": (np.int32, -1)}  # per-row [B] fields: dtype, fill
_INDEX_COLUMNS = 4  # step, first_row, num_rows, length
_ROWS_PER_CHUNK = 64
_INDEX_ROWS_PER_CHUNK = 4096


@dataclasses.dataclass(frozen=True)
class LoggedBatch:
    """One trained batch: per-token fields ``[B, T]`` (column ``t`` describes ``tokens[:, t]``), rewards ``[B]``."""

    step: int
    tokens: np.ndarray  # int32 token ids, prompt then completion, right-padded.
    loss_mask: np.ndarray  # float32 0/1: tokens the loss trained on.
    rollout_logprobs: np.ndarray  # float32 logprobs the inference server sampled with.
    proximal_logprobs: np.ndarray  # float32 logprobs the learner recomputed before the update (0 outside each row's
    # scored window, prompt tokens included, when update.scored_window is set).
    rewards: np.ndarray  # float32 [B] sequence rewards.
    advantages: np.ndarray  # float32 per-token advantages.
    policy_version: np.ndarray  # int32 policy version that sampled each token.
    learner_version: np.ndarray | int | None = None  # int32 [B] (or one int for all rows): the learner's policy
    # version when the batch was trained (learner - token version = the token's staleness); None / -1: unknown.


def _spec(path: pathlib.Path, dtype, shape, chunk_shape, fill_value=0) -> dict:
    return {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(path)},
        "metadata": {
            "shape": list(shape),
            "data_type": np.dtype(dtype).name,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk_shape)}},
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "zstd"}],
            "fill_value": fill_value,
        },
    }


def _open_arrays(path: pathlib.Path, max_length: int | None, create: bool, writable: bool = True
                 ) -> dict[str, ts.TensorStore]:
    """The log's arrays, created (empty) when ``create``, else opened as they are; a per-row array an older log
    lacks is added (``writable``: for a writer, its rows read as the fill value) or left out (for a reader)."""
    layout = {name: (dtype, [0, max_length], [_ROWS_PER_CHUNK, max_length], 0)
              for name, dtype in TOKEN_FIELDS.items()}
    layout |= {name: (dtype, [0], [_ROWS_PER_CHUNK], fill) for name, (dtype, fill) in ROW_FIELDS.items()}
    layout["index"] = (np.int64, [0, _INDEX_COLUMNS], [_INDEX_ROWS_PER_CHUNK, _INDEX_COLUMNS], 0)
    context = ts.Context()
    futures = {}
    for name, (dtype, shape, chunks, fill) in layout.items():
        spec = _spec(path / name, dtype, shape, chunks, fill)
        new = create or (name in ROW_FIELDS and not (path / name / "zarr.json").exists())
        if new and not create and not writable:
            continue  # a reader of an older log: that field is unknown
        if not new:
            del spec["metadata"]
        futures[name] = ts.open(spec, create=new, open=not new, context=context)
    return {name: future.result() for name, future in futures.items()}


def _logged_entries(index: np.ndarray) -> np.ndarray:
    """The index's leading entries with ``num_rows > 0``: the batches logged."""
    spare = np.flatnonzero(index[:, 2] == 0)
    return index[: spare[0] if spare.size else len(index)]


def _grow(array: ts.TensorStore, needed: int) -> ts.TensorStore:
    """``array``, its first dimension grown (by doubling) to at least ``needed``."""
    if array.shape[0] >= needed:
        return array
    bounds = [max(needed, 2 * array.shape[0])] + [None] * (array.rank - 1)
    return array.resize(exclusive_max=bounds, expand_only=True).result()


class RolloutLogWriter:
    """Appends trained batches to a rollout log; creates the log, or continues an existing one.

    Args:
      path: the log directory (a run's ``rollout_log``).
      max_length: T that every batch is padded to; a new log needs it, an existing one keeps its own.
      resume_step: when resuming from a checkpoint older than the log's end, the batches logged after it are
        dropped, since the rerun logs those steps again.
    """

    def __init__(self, path: str | os.PathLike, max_length: int | None = None, resume_step: int | None = None):
        self.path = pathlib.Path(path)
        exists = (self.path / "index" / "zarr.json").exists()
        if not exists and max_length is None:
            raise ValueError(f"no rollout log at {self.path}: pass max_length to create one")
        self._arrays = _open_arrays(self.path, max_length, create=not exists)
        self.max_length = self._arrays["tokens"].shape[1]
        if max_length is not None and max_length != self.max_length:
            raise ValueError(f"the log at {self.path} has max_length {self.max_length}, not {max_length}")
        self._index = _logged_entries(self._arrays["index"].read().result())
        if resume_step is not None:
            later = np.flatnonzero(self._index[:, 0] > resume_step)
            if later.size:
                self._arrays["index"][later[0] : len(self._index)].write(0).result()
                self._index = self._index[: later[0]]
        self._pending: tuple[list[ts.Future], np.ndarray] | None = None  # data writes in flight, their entry
        self._index_write: ts.Future | None = None

    @property
    def num_rows(self) -> int:
        """Rows logged so far, including the batch in flight."""
        last = self._pending[1] if self._pending else (self._index[-1] if len(self._index) else None)
        return 0 if last is None else int(last[1] + last[2])

    def append(self, batch: LoggedBatch) -> None:
        """Starts writing ``batch`` (NumPy or JAX arrays) and returns; waits for the previous batch's writes."""
        rows, length = np.shape(batch.tokens)
        if rows == 0 or length > self.max_length:
            raise ValueError(f"batch of shape {(rows, length)}: need rows > 0 and length <= {self.max_length}")
        first_row = self.num_rows
        self._commit_pending()
        end = first_row + rows
        if self._arrays["index"].shape[0] <= len(self._index):
            self._wait_index_write()
            self._arrays["index"] = _grow(self._arrays["index"], len(self._index) + 1)
        for name in (*TOKEN_FIELDS, *ROW_FIELDS):
            self._arrays[name] = _grow(self._arrays[name], end)
        writes = []
        for name, dtype in TOKEN_FIELDS.items():
            values = np.zeros((rows, self.max_length), dtype)
            values[:, :length] = np.asarray(getattr(batch, name))
            writes.append(self._arrays[name][first_row:end].write(values).commit)
        writes.append(self._arrays["rewards"][first_row:end].write(np.asarray(batch.rewards, np.float32)).commit)
        learner_version = -1 if batch.learner_version is None else batch.learner_version
        writes.append(self._arrays["learner_version"][first_row:end].write(
            np.broadcast_to(np.asarray(learner_version, np.int32), (rows,))).commit)
        self._pending = (writes, np.array([batch.step, first_row, rows, length], np.int64))

    def flush(self) -> None:
        """Waits for every write in flight, the index included."""
        self._commit_pending()
        self._wait_index_write()

    def close(self) -> None:
        """Flushes; the log can be reopened to read or to append more."""
        self.flush()

    def __enter__(self) -> RolloutLogWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _commit_pending(self) -> None:
        """Waits for the pending batch's data, then starts writing its index entry (one entry in flight at most)."""
        self._wait_index_write()
        if self._pending is None:
            return
        writes, entry = self._pending
        for future in writes:
            future.result()
        self._index_write = self._arrays["index"][len(self._index)].write(entry).commit
        self._index = np.concatenate([self._index, entry[None]])
        self._pending = None

    def _wait_index_write(self) -> None:
        if self._index_write is not None:
            self._index_write.result()
            self._index_write = None


class RolloutLogReader:
    """Reads logged batches back, exactly as appended (padding beyond each batch's true T removed)."""

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        self._arrays = _open_arrays(self.path, None, create=False, writable=False)
        self._index = _logged_entries(self._arrays["index"].read().result())
        self.max_length = self._arrays["tokens"].shape[1]

    @property
    def steps(self) -> np.ndarray:
        """int64 steps of the logged batches, in log order."""
        return self._index[:, 0].copy()

    def read(self, step: int) -> LoggedBatch:
        """The batch logged at ``step`` (the latest one if a rerun logged it twice)."""
        matches = np.flatnonzero(self._index[:, 0] == step)
        if matches.size == 0:
            raise KeyError(f"no batch logged at step {step}")
        return self._read_entry(self._index[matches[-1]])

    def read_range(self, start: int, stop: int) -> list[LoggedBatch]:
        """The batches logged at steps ``start <= step < stop``, in log order."""
        entries = self._index[(self._index[:, 0] >= start) & (self._index[:, 0] < stop)]
        return [self._read_entry(entry) for entry in entries]

    def batches(self) -> Iterator[LoggedBatch]:
        """Every logged batch, in log order, read one at a time."""
        for entry in self._index:
            yield self._read_entry(entry)

    def _read_entry(self, entry: np.ndarray) -> LoggedBatch:
        step, first_row, rows, length = (int(v) for v in entry)
        rows_slice = slice(first_row, first_row + rows)
        futures = {name: self._arrays[name][rows_slice, :length].read() for name in TOKEN_FIELDS}
        futures |= {name: self._arrays[name][rows_slice].read() for name in ROW_FIELDS if name in self._arrays}
        return LoggedBatch(step=step, **{name: future.result() for name, future in futures.items()})
