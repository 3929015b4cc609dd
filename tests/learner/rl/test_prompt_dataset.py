"""Prompt data: padding, seeded order reshuffled per epoch, exact resume from iterator state, disjoint process
shards, global arrays on the 8-device mesh."""

import itertools

import numpy as np
import pytest

from learner.model.sharding import batch_sharding, make_mesh
from learner.rl.prompt_dataset import global_batch, pad_prompt, prompt_dataset, prompt_iterator

MAX_PROMPT_LEN = 6
RECORDS = [{"id": i, "prompt_ids": list(range(1, 1 + i % MAX_PROMPT_LEN + 1))} for i in range(24)]


def _encode(record):
    return {"id": np.asarray(record["id"], np.int32)} | pad_prompt(record["prompt_ids"], MAX_PROMPT_LEN)


def _ids(batches, count):
    return [batch["id"].tolist() for batch in itertools.islice(batches, count)]


def test_pad_prompt_right_pads_and_rejects_bad_lengths():
    padded = pad_prompt([3, 4], max_len=4, pad_id=9)
    np.testing.assert_array_equal(padded["prompt_ids"], [3, 4, 9, 9])
    assert padded["prompt_ids"].dtype == np.int32 and int(padded["prompt_len"]) == 2
    for bad in ([], [1] * 5):
        with pytest.raises(ValueError, match="max_len=4"):
            pad_prompt(bad, max_len=4)


def test_batches_hold_encoded_prompts():
    batch = next(prompt_iterator(prompt_dataset(RECORDS, _encode, global_batch_size=4, seed=0)))
    assert batch["prompt_ids"].shape == (4, MAX_PROMPT_LEN) and batch["prompt_len"].shape == (4,)
    for row, record_id in enumerate(batch["id"]):
        expected = RECORDS[record_id]["prompt_ids"]
        assert batch["prompt_len"][row] == len(expected)
        np.testing.assert_array_equal(batch["prompt_ids"][row], expected + [0] * (MAX_PROMPT_LEN - len(expected)))


def test_order_is_fixed_by_the_seed_and_reshuffled_each_epoch():
    def epochs(seed):
        ids = _ids(prompt_iterator(prompt_dataset(RECORDS, _encode, global_batch_size=4, seed=seed)), 12)
        return np.asarray(ids[:6]).ravel().tolist(), np.asarray(ids[6:]).ravel().tolist()

    first, second = epochs(seed=0)
    assert epochs(seed=0) == (first, second)
    assert sorted(first) == sorted(second) == list(range(24))  # every prompt once per epoch
    assert first != second and first != list(range(24))
    assert epochs(seed=1)[0] != first


def test_finite_epochs_end_and_drop_partial_batches():
    dataset = prompt_dataset(RECORDS[:10], _encode, global_batch_size=4, seed=0, num_epochs=2)
    ids = _ids(prompt_iterator(dataset), 100)
    assert len(ids) == 4 and all(len(batch) == 4 for batch in ids)  # 2 full batches per epoch of 10
    assert len(set(ids[0] + ids[1])) == 8


def test_resume_from_iterator_state_yields_the_same_next_batches():
    dataset = prompt_dataset(RECORDS, _encode, global_batch_size=4, seed=3)
    iterator = prompt_iterator(dataset)
    _ids(iterator, 5)  # one short of the epoch boundary
    state = iterator.get_state()
    expected = _ids(iterator, 4)
    resumed = prompt_iterator(dataset)
    resumed.set_state(state)
    assert _ids(resumed, 4) == expected


def test_process_shards_are_disjoint_and_equal():
    records = RECORDS[:23]  # 23 over 3 processes: one record dropped so the shards are equal
    shards = []
    for process_index in range(3):
        dataset = prompt_dataset(records, _encode, global_batch_size=6, seed=0, num_epochs=1,
                                 process_index=process_index, process_count=3)
        ids = np.asarray(_ids(prompt_iterator(dataset), 100))
        assert ids.shape == (3, 2)  # 7 records per process -> 3 local batches of 2, one dropped
        shards.append(set(ids.ravel().tolist()))
    assert all(a.isdisjoint(b) for a, b in itertools.combinations(shards, 2))


def test_every_record_is_in_exactly_one_process_shard():
    epoch = {}
    for process_index in range(4):
        dataset = prompt_dataset(RECORDS, _encode, global_batch_size=4, seed=0, num_epochs=1,
                                 process_index=process_index, process_count=4)
        epoch[process_index] = np.asarray(_ids(prompt_iterator(dataset), 100)).ravel().tolist()
    assert sorted(itertools.chain(*epoch.values())) == list(range(24))


@pytest.mark.parametrize("kwargs, message", [
    (dict(global_batch_size=5, process_index=0, process_count=2), "multiple of 2"),
    (dict(global_batch_size=4, process_index=2, process_count=2), "process_index=2"),
    (dict(global_batch_size=32, process_index=0, process_count=2), "fewer than one batch"),
])
def test_invalid_sharding_is_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        prompt_dataset(RECORDS, _encode, seed=0, **kwargs)


def test_global_batch_on_the_8_device_mesh():
    mesh = make_mesh(data=4, fsdp=2, tensor=1)
    local = next(prompt_iterator(prompt_dataset(RECORDS, _encode, global_batch_size=16, seed=0)))
    batch = global_batch(local, batch_sharding(mesh))
    assert set(batch) == {"id", "prompt_ids", "prompt_len"}
    prompt_ids = batch["prompt_ids"]
    assert prompt_ids.shape == (16, MAX_PROMPT_LEN) and prompt_ids.sharding == batch_sharding(mesh)
    np.testing.assert_array_equal(prompt_ids, local["prompt_ids"])
    np.testing.assert_array_equal(batch["id"], local["id"])
    rows_by_device = {shard.device: shard.index[0] for shard in prompt_ids.addressable_shards}
    assert len(rows_by_device) == 8
    for shard in prompt_ids.addressable_shards:
        assert shard.data.shape == (2, MAX_PROMPT_LEN)
        np.testing.assert_array_equal(shard.data, local["prompt_ids"][shard.index[0]])
    assert sorted(rows.start for rows in rows_by_device.values()) == list(range(0, 16, 2))
