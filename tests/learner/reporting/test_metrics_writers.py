"""Metrics writers: JSONL records and resume without duplicates, TensorBoard event files, fan-out."""

import math
import struct

import jax.numpy as jnp
import numpy as np
import pytest

from learner.reporting.metrics_writers import (
    FanOutWriter,
    JsonlWriter,
    TensorBoardWriter,
    host_scalars,
    masked_crc32c,
    read_metrics,
)


def _metrics(step):
    return {"loss": jnp.float32(step / 4), "reward/mean": np.float64(0.5), "tokens": jnp.int32(step)}


def test_host_scalars_fetches_floats():
    assert host_scalars({"a": jnp.float32(1.5), "b": np.int64(2), "c": 3}) == {"a": 1.5, "b": 2.0, "c": 3.0}


def test_jsonl_one_flat_record_per_step(tmp_path):
    writer = JsonlWriter(tmp_path / "run" / "metrics.jsonl")
    for step in range(1, 4):
        writer.write(step, _metrics(step))
    writer.write(4, {"loss": jnp.float32(jnp.nan), "bound": jnp.float32(jnp.inf)})
    # Flushed per step: readable before close.
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    writer.close()
    assert records[:3] == [{"step": s, "loss": s / 4, "reward/mean": 0.5, "tokens": float(s)} for s in (1, 2, 3)]
    assert records[3]["step"] == 4 and math.isnan(records[3]["loss"]) and records[3]["bound"] == math.inf


def test_jsonl_rerun_appends_after_last_step_without_duplicates(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = JsonlWriter(path)
    for step in range(5):
        writer.write(step, _metrics(step))
    writer.close()
    writer = JsonlWriter(path)
    assert writer.last_step == 4
    for step in range(3, 8):  # a rerun overlapping the logged steps
        writer.write(step, {"loss": jnp.float32(-1.0)})
    writer.close()
    records = read_metrics(path)
    assert [r["step"] for r in records] == list(range(8))
    assert [r["loss"] for r in records[3:]] == [0.75, 1.0, -1.0, -1.0, -1.0]


def test_jsonl_resume_from_an_older_checkpoint_drops_later_records(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = JsonlWriter(path)
    for step in range(6):
        writer.write(step, _metrics(step))
    writer.close()
    writer = JsonlWriter(path, resume_step=2)
    assert writer.last_step == 2
    writer.write(3, {"loss": jnp.float32(-3.0)})
    writer.close()
    records = read_metrics(path)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[3] == {"step": 3, "loss": -3.0}


def test_jsonl_drops_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "lo')
    writer = JsonlWriter(path)
    assert writer.last_step == 0
    writer.write(1, {"loss": 2.0})
    writer.close()
    assert read_metrics(path) == [{"step": 0, "loss": 1.0}, {"step": 1, "loss": 2.0}]


def _read_tfrecords(path):
    """Payloads of a TFRecord file, checking both CRCs of every record."""
    data, records, offset = path.read_bytes(), [], 0
    while offset < len(data):
        header = data[offset : offset + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[offset + 8 : offset + 12])[0] == masked_crc32c(header)
        payload = data[offset + 12 : offset + 12 + length]
        assert struct.unpack("<I", data[offset + 12 + length : offset + 16 + length])[0] == masked_crc32c(payload)
        records.append(payload)
        offset += 16 + length
    return records


def test_tensorboard_event_file_framing(tmp_path):
    writer = TensorBoardWriter(tmp_path / "tb")
    for step in range(3):
        writer.write(step, _metrics(step))
    writer.close()
    assert writer.path.name.startswith("events.out.tfevents.")
    records = _read_tfrecords(writer.path)
    assert len(records) == 4
    assert b"brain.Event:2" in records[0]
    assert b"reward/mean" in records[1] and struct.pack("<f", 0.25) in records[2]


def test_tensorboard_reads_the_scalars_back(tmp_path):
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator",
        reason="reading the file back needs the tensorboard package (in the test extras); the framing test above runs "
               "without it")
    writer = TensorBoardWriter(tmp_path)
    for step in range(5):
        writer.write(step, _metrics(step))
    writer.write(2**40, {"loss": -1.5, "tokens": 1e300})
    writer.close()
    accumulator = event_accumulator.EventAccumulator(str(tmp_path))
    accumulator.Reload()
    assert set(accumulator.Tags()["scalars"]) == {"loss", "reward/mean", "tokens"}
    loss = accumulator.Scalars("loss")
    assert [e.step for e in loss] == [0, 1, 2, 3, 4, 2**40]
    assert [e.value for e in loss] == [0.0, 0.25, 0.5, 0.75, 1.0, -1.5]
    assert [e.value for e in accumulator.Scalars("tokens")] == [0.0, 1.0, 2.0, 3.0, 4.0, float("inf")]


def test_fan_out_fetches_once_and_writes_everywhere(tmp_path, monkeypatch):
    import learner.reporting.metrics_writers as metrics_writers

    fetches = []
    real_device_get = metrics_writers.jax.device_get
    monkeypatch.setattr(metrics_writers.jax, "device_get", lambda tree: fetches.append(tree) or real_device_get(tree))
    jsonl_a, jsonl_b = JsonlWriter(tmp_path / "a.jsonl"), JsonlWriter(tmp_path / "b.jsonl")
    writer = FanOutWriter([jsonl_a, jsonl_b, TensorBoardWriter(tmp_path / "tb")])
    writer.write(0, _metrics(0))
    writer.write(1, _metrics(1))
    writer.close()
    # One fetch of device arrays per step; the writers then see host floats only.
    device_fetches = [t for t in fetches if any(isinstance(v, jnp.ndarray) for v in t.values())]
    assert len(device_fetches) == 2
    assert read_metrics(tmp_path / "a.jsonl") == read_metrics(tmp_path / "b.jsonl")
    assert [r["loss"] for r in read_metrics(tmp_path / "a.jsonl")] == [0.0, 0.25]
