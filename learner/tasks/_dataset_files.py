"""Dataset rows from local files, with pyarrow (no ``datasets`` package): jsonl, parquet, arrow, and the folders
``datasets.Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` write.

`read_rows` returns a random-access sequence of row dicts: what grain's ``MapDataset.source`` takes.
"""

from __future__ import annotations

import glob
import json
import operator
import pathlib
from collections.abc import Sequence
from typing import Any

FORMATS = ("jsonl", "parquet", "arrow", "save_to_disk")
_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".arrow": "arrow", ".feather": "arrow"}


class ArrowRows(Sequence):
    """The rows of a pyarrow Table as dicts, converted when read."""

    def __init__(self, table):
        self.table = table

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, index: int) -> dict[str, Any]:
        index = range(len(self))[operator.index(index)]
        return self.table.slice(index, 1).to_pylist()[0]

    @property
    def columns(self) -> list[str]:
        return self.table.column_names


class ListRows(list):
    """Rows read as Python dicts (jsonl); ``columns`` are the keys of all rows, in first-seen order."""

    @property
    def columns(self) -> list[str]:
        return list(dict.fromkeys(key for row in self for key in row))


def _read_arrow_file(path: pathlib.Path):
    """An Arrow IPC file (the random-access "file" format) or stream (what ``datasets`` writes)."""
    import pyarrow as pa

    source = pa.memory_map(str(path))
    try:
        return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid:
        source.seek(0)
        return pa.ipc.open_stream(source).read_all()


def _read_jsonl(path: pathlib.Path) -> list[dict]:
    rows = []
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not a JSON line ({err})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: a JSON object per line is needed, got {type(row).__name__}")
            rows.append(row)
    return rows


def _save_to_disk_files(directory: pathlib.Path, split: str | None) -> list[pathlib.Path]:
    """The arrow files of a ``save_to_disk`` folder, in order; for a DatasetDict folder, those of ``split``."""
    if (directory / "dataset_dict.json").is_file():
        splits = json.loads((directory / "dataset_dict.json").read_text()).get("splits", [])
        if split is None:
            raise ValueError(f"{directory} holds the splits {splits}: choose one with split")
        if split not in splits:
            raise ValueError(f"{directory}: no split {split!r}; it holds {splits}")
        directory = directory / split
    state_path = directory / "state.json"
    if not state_path.is_file():
        raise ValueError(f"{directory}: not a save_to_disk folder (no state.json or dataset_dict.json)")
    state = json.loads(state_path.read_text())
    return [directory / entry["filename"] for entry in state.get("_data_files", [])]


def detect_format(path: str | pathlib.Path) -> str:
    """The format of ``path`` from its suffix (or a folder: ``save_to_disk``)."""
    path = pathlib.Path(path)
    if path.is_dir():
        return "save_to_disk"
    suffix = path.suffix.lower()
    if suffix not in _SUFFIXES:
        raise ValueError(f"{path}: unknown suffix {suffix!r}; name the format ({', '.join(FORMATS)})")
    return _SUFFIXES[suffix]


def read_rows(path: str | pathlib.Path, format: str | None = None, split: str | None = None) -> Sequence[dict]:
    """The rows of a local dataset, as a random-access sequence of dicts with a ``columns`` list.

    Args:
      path: a file, a glob of files of one format (``data/train-*.parquet``, read in sorted order), or a
        ``save_to_disk`` folder.
      format: ``jsonl``, ``parquet``, ``arrow`` or ``save_to_disk``; None: from the suffix (``.jsonl``/``.json``,
        ``.parquet``, ``.arrow``/``.feather``) or a folder.
      split: the split of a ``DatasetDict.save_to_disk`` folder.

    Raises:
      ValueError: an unknown format, no matching file, or a malformed file; the message names the path.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    if format is not None and format not in FORMATS:
        raise ValueError(f"format={format!r}: use one of {', '.join(FORMATS)}")
    paths = [pathlib.Path(p) for p in sorted(glob.glob(str(path)))] if glob.has_magic(str(path)) else [
        pathlib.Path(path)]
    if not paths or not paths[0].exists():
        raise ValueError(f"{path}: no such file or folder")
    format = format or detect_format(paths[0])
    if format == "jsonl":
        return ListRows(row for p in paths for row in _read_jsonl(p))
    if format == "save_to_disk":
        if len(paths) != 1 or not paths[0].is_dir():
            raise ValueError(f"{path}: a save_to_disk dataset is one folder")
        paths = _save_to_disk_files(paths[0], split)
        format = "arrow"
    read = pq.read_table if format == "parquet" else _read_arrow_file
    tables = []
    for p in paths:
        try:
            tables.append(read(p))
        except (pa.ArrowInvalid, OSError) as err:
            raise ValueError(f"{p}: not a readable {format} file ({err})") from None
    return ArrowRows(pa.concat_tables(tables) if len(tables) > 1 else tables[0])
