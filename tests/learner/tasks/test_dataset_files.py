"""read_rows: the same rows from every format the test writes with pyarrow (jsonl, parquet, Arrow IPC file and stream,
a glob of shards, save_to_disk folders of a Dataset and of a DatasetDict), and errors that name the path."""

import json

import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from learner.tasks import read_rows

ROWS = [{"question": f"{a} + {a}?", "answer": str(2 * a), "level": a % 3,
         "messages": [{"role": "user", "content": f"{a} + {a}?"}]} for a in range(7)]


def _table(rows=ROWS):
    return pa.Table.from_pylist(rows)


def _write_stream(path, table):
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=3)


def _save_to_disk(directory, table, shards=2):
    """A folder as ``datasets.Dataset.save_to_disk`` writes it: Arrow streams named in state.json."""
    directory.mkdir(parents=True)
    bounds = [round(i * table.num_rows / shards) for i in range(shards + 1)]
    files = []
    for shard in range(shards):
        name = f"data-{shard:05d}-of-{shards:05d}.arrow"
        _write_stream(directory / name, table.slice(bounds[shard], bounds[shard + 1] - bounds[shard]))
        files.append({"filename": name})
    (directory / "state.json").write_text(json.dumps({"_data_files": files, "_fingerprint": "0", "_split": None}))
    (directory / "dataset_info.json").write_text("{}")


@pytest.mark.parametrize("name, write", [
    ("train.jsonl", lambda path: path.write_text("\n".join(json.dumps(row) for row in ROWS) + "\n\n")),
    ("train.parquet", lambda path: pq.write_table(_table(), path, row_group_size=2)),
    ("train.arrow", lambda path: feather.write_feather(_table(), path, compression="uncompressed")),  # IPC file
    ("stream.arrow", lambda path: _write_stream(path, _table())),  # IPC stream, as datasets writes
    ("train.feather", lambda path: feather.write_feather(_table(), path)),
    ("saved", lambda path: _save_to_disk(path, _table())),
])
def test_every_format_gives_the_same_rows(tmp_path, name, write):
    write(tmp_path / name)
    rows = read_rows(tmp_path / name)
    assert len(rows) == len(ROWS) and list(rows) == ROWS and rows[-1] == ROWS[-1]
    assert rows.columns == ["question", "answer", "level", "messages"]
    with pytest.raises(IndexError):
        rows[len(ROWS)]


def test_a_glob_of_shards_reads_them_in_sorted_order(tmp_path):
    for shard, (start, stop) in enumerate([(0, 3), (3, 5), (5, 7)]):
        pq.write_table(_table(ROWS[start:stop]), tmp_path / f"train-{2 - shard}.parquet")  # names sort backwards
    rows = read_rows(tmp_path / "train-*.parquet")
    assert list(rows) == ROWS[5:7] + ROWS[3:5] + ROWS[0:3]


def test_a_dataset_dict_folder_needs_a_split(tmp_path):
    folder = tmp_path / "dict"
    _save_to_disk(folder / "train", _table(ROWS[:5]))
    _save_to_disk(folder / "test", _table(ROWS[5:]), shards=1)
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    assert list(read_rows(folder, split="test")) == ROWS[5:]
    with pytest.raises(ValueError, match=r"holds the splits \['train', 'test'\]: choose one with split"):
        read_rows(folder)
    with pytest.raises(ValueError, match="no split 'validation'"):
        read_rows(folder, split="validation")


def test_format_can_be_named_for_other_suffixes(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text(json.dumps(ROWS[0]) + "\n")
    with pytest.raises(ValueError, match=r"unknown suffix '.txt'; name the format \(jsonl, parquet, arrow"):
        read_rows(path)
    assert list(read_rows(path, format="jsonl")) == ROWS[:1]


@pytest.mark.parametrize("content, message", [
    ('{"a": 1}\n[1, 2]\n', r"bad.jsonl:2: a JSON object per line is needed, got list"),
    ('{"a": 1}\n{"a": \n', r"bad.jsonl:2: not a JSON line"),
])
def test_malformed_jsonl_names_the_line(tmp_path, content, message):
    (tmp_path / "bad.jsonl").write_text(content)
    with pytest.raises(ValueError, match=message):
        read_rows(tmp_path / "bad.jsonl")


def test_unreadable_and_missing_files_are_named(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="bad.parquet: not a readable parquet file"):
        read_rows(tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="nothing.jsonl: no such file or folder"):
        read_rows(tmp_path / "nothing.jsonl")
    (tmp_path / "folder").mkdir()
    with pytest.raises(ValueError, match="not a save_to_disk folder"):
        read_rows(tmp_path / "folder")
    with pytest.raises(ValueError, match="format='csv': use one of jsonl, parquet, arrow, save_to_disk"):
        read_rows(tmp_path / "bad.parquet", format="csv")
