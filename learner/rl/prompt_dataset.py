"""Prompt batches from a grain pipeline: sharded per process, reshuffled every epoch, checkpointable.

Pipeline (a grain ``MapDataset``, lazy and random-access)::

    records -> this process's shard -> shuffle(seed) -> map(encode) -> batch(global / processes) -> repeat

Every process builds the same pipeline with its own ``process_index``: the shards are disjoint and equally long
(records beyond a multiple of the process count are dropped), so every process yields the same number of batches.
``repeat`` reseeds the shuffle each epoch; a batch never spans two epochs (an epoch's last partial batch is
dropped). The iterator's state is a small JSON dict (``{"next_index": n}``) that `learner.checkpoints.checkpointer`
saves
per process, so a restored run continues with exactly the batches it had not seen.

Each process's local batch becomes one global ``jax.Array`` with `global_batch`::

    dataset = prompt_dataset(records, encode, global_batch_size=64, seed=0)
    batches = prompt_iterator(dataset)
    prompts = global_batch(next(batches), batch_sharding(mesh))  # {"prompt_ids": [64, T], "prompt_len": [64]}
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grain
import jax
import numpy as np

Batch = Mapping[str, np.ndarray]


def pad_prompt(prompt_ids: Sequence[int], max_len: int, pad_id: int = 0) -> dict[str, np.ndarray]:
    """Right-pads one prompt to ``max_len`` tokens, so that prompts batch into fixed shapes.

    Returns:
        ``{"prompt_ids": int32 [max_len], "prompt_len": int32 scalar}``.

    Example:
        >>> pad_prompt([5, 6, 7], max_len=5)
        {'prompt_ids': array([5, 6, 7, 0, 0], dtype=int32), 'prompt_len': array(3, dtype=int32)}
    """
    if not 0 < len(prompt_ids) <= max_len:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens: need 1 to max_len={max_len}")
    padded = np.full((max_len,), pad_id, np.int32)
    padded[:len(prompt_ids)] = prompt_ids
    return {"prompt_ids": padded, "prompt_len": np.asarray(len(prompt_ids), np.int32)}


def prompt_dataset(records: Sequence[Any], encode: Callable[[Any], Batch], *, global_batch_size: int, seed: int,
                   num_epochs: int | None = None, process_index: int | None = None,
                   process_count: int | None = None) -> grain.MapDataset:
    """This process's batches of encoded prompts (see the module docstring for the pipeline).

    Args:
        records: the prompt records, a sequence or a grain random-access data source (e.g. ArrayRecord).
        encode: record -> dict of fixed-shape numpy arrays (e.g. `pad_prompt` of its token ids plus task fields).
        global_batch_size: prompts per step over all processes; a multiple of the process count.
        seed: shuffle seed; the same on every process.
        num_epochs: passes over the data; None repeats forever.
        process_index: this process's index; defaults to ``jax.process_index()``.
        process_count: number of processes; defaults to ``jax.process_count()``.

    Returns:
        A ``MapDataset`` of dicts of ``[global_batch_size / process_count, ...]`` arrays.
    """
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} is not in [0, process_count={process_count})")
    if global_batch_size % process_count:
        raise ValueError(f"global_batch_size={global_batch_size} is not a multiple of {process_count} processes")
    local_batch_size = global_batch_size // process_count
    shard_size = len(records) // process_count
    if shard_size < local_batch_size:
        raise ValueError(f"{len(records)} records over {process_count} processes: fewer than one batch of "
                         f"{local_batch_size} per process")
    shard = grain.MapDataset.source(records)[process_index:shard_size * process_count:process_count]
    batches = shard.shuffle(seed=seed).map(encode).batch(local_batch_size, drop_remainder=True)
    return batches.repeat(num_epochs)


def prompt_iterator(dataset: grain.MapDataset, *, num_threads: int = 1,
                    prefetch_batches: int = 2) -> grain.DatasetIterator:
    """Iterator over ``dataset`` with bounded prefetching; ``get_state`` / ``set_state`` give its position.

    Args:
        dataset: from `prompt_dataset`.
        num_threads: threads encoding prompts ahead of the learner (encoding is cheap; the learner needs the CPU).
        prefetch_batches: batches prepared ahead.
    """
    read_options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch_batches)
    return iter(dataset.to_iter_dataset(read_options))


def global_batch(local_batch: Batch, sharding: jax.sharding.Sharding) -> dict[str, jax.Array]:
    """Assembles every process's local batch into global arrays laid out by ``sharding``.

    Each process passes its own rows (e.g. its `prompt_dataset` batch); they land on its own devices. With
    `learner.model.sharding.batch_sharding` on a mesh whose devices run over the processes in order (as
    `learner.model.sharding.make_mesh` builds them), the global batch is the local batches concatenated in process
    order.

    Args:
        local_batch: this process's batch, dict of ``[local_batch_size, ...]`` numpy arrays.
        sharding: sharding of the global arrays; its leading axis splits the batch.
    """
    return {name: jax.make_array_from_process_local_data(sharding, array) for name, array in local_batch.items()}
