"""Metrics writers: JSONL (resumable), TensorBoard event files, and a fan-out to several.

The training loop hands each writer a flat dict of scalars per step (device arrays fresh from the jitted step).
``host_scalars`` brings them to the host with ONE ``jax.device_get`` for the whole dict, so logging costs one
host sync per step, not one per metric; ``FanOutWriter`` does it once for all its writers.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import struct
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from learner.reporting.run_files import open_for_append, write_atomically


class MetricsWriter(Protocol):
    """Receives one flat dict of scalar metrics per training step."""

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Records ``metrics`` (JAX / NumPy / Python scalars) for ``step``."""

    def close(self) -> None:
        """Flushes and releases the writer."""


def host_scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """``{name: float}`` of a dict of scalars, fetched from devices in one ``jax.device_get``.

    >>> import jax.numpy as jnp
    >>> host_scalars({"loss": jnp.float32(0.5), "tokens": jnp.int32(3)})
    {'loss': 0.5, 'tokens': 3.0}
    """
    return {name: float(np.asarray(value)) for name, value in jax.device_get(dict(metrics)).items()}


def read_metrics(path: str | os.PathLike) -> list[dict[str, float]]:
    """The records of a JSONL metrics file, in file order; a torn last line (a crash mid-write) is skipped."""
    path = pathlib.Path(path)
    if not path.exists():
        return []
    text = path.read_text()
    complete = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line]


class JsonlWriter:
    """Appends ``{"step": step, **metrics}`` as one JSON line per step, flushed at once.

    Resumable: opening an existing file keeps its records and ``write`` skips steps at or before the last one
    recorded, so a rerun never duplicates a step. Pass ``resume_step`` when resuming from a checkpoint older than
    the file's end: records after it are dropped, since the rerun logs those steps again. Non-finite values are
    written as Python's ``json`` writes them (``NaN``, ``Infinity``), which ``read_metrics`` reads back.
    """

    def __init__(self, path: str | os.PathLike, resume_step: int | None = None):
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open_for_append(self.path)  # a link or a non-regular file is refused before it is read
        text = self.path.read_text()
        records = read_metrics(self.path)
        kept = [r for r in records if resume_step is None or r["step"] <= resume_step]
        if len(kept) < len(records) or (text and not text.endswith("\n")):
            self._file.close()
            write_atomically(self.path, "".join(json.dumps(r) + "\n" for r in kept))
            self._file = open_for_append(self.path)
        self.last_step = max((int(r["step"]) for r in kept), default=None)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        if self.last_step is not None and step <= self.last_step:
            return
        self._file.write(json.dumps({"step": int(step), **host_scalars(metrics)}) + "\n")
        self._file.flush()
        self.last_step = int(step)

    def close(self) -> None:
        self._file.close()


class TensorBoardWriter:
    """Writes scalars to a TensorBoard event file in ``log_dir``, without the tensorflow / tensorboard packages.

    An event file is a TFRecord stream of ``Event`` protos; this writer encodes the few fields scalars need
    (wall time, step, a ``Summary`` of ``(tag, simple_value)`` pairs) by hand. Each writer starts a new file, as
    TensorBoard expects of a restarted run.
    """

    def __init__(self, log_dir: str | os.PathLike):
        log_dir = pathlib.Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{time.time():.6f}.{socket.gethostname()}.{os.getpid()}"
        self.path = log_dir / name
        self._file = open_for_append(self.path, binary=True)
        self._write_event(_field_bytes(3, b"brain.Event:2"), step=0)  # file_version, as TensorFlow writes it.

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        values = b"".join(
            _field_bytes(1, _field_bytes(1, tag.encode()) + _float_field(2, value))
            for tag, value in host_scalars(metrics).items()
        )
        self._write_event(_field_bytes(5, values), step)
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def _write_event(self, payload: bytes, step: int) -> None:
        event = _double_field(1, time.time()) + _varint_field(2, step) + payload
        header = struct.pack("<Q", len(event))
        self._file.write(header + struct.pack("<I", masked_crc32c(header)))
        self._file.write(event + struct.pack("<I", masked_crc32c(event)))


class FanOutWriter:
    """Sends each step's metrics to several writers, fetched from devices once."""

    def __init__(self, writers: Sequence[MetricsWriter]):
        self.writers = tuple(writers)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        scalars = host_scalars(metrics)
        for writer in self.writers:
            writer.write(step, scalars)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


# Protocol-buffer wire format, for the Event fields above.
def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # int64 two's complement, as protobuf encodes negative ints.
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _varint_field(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _double_field(number: int, value: float) -> bytes:
    return _varint(number << 3 | 1) + struct.pack("<d", value)


def _float_field(number: int, value: float) -> bytes:
    with np.errstate(over="ignore"):  # beyond float32's range: +-inf, as TensorBoard shows it.
        return _varint(number << 3 | 5) + np.float32(value).astype("<f4").tobytes()


def _field_bytes(number: int, value: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
        table.append(crc)
    return table


_CRC32C_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), the checksum of TFRecord framing.

    >>> hex(crc32c(b"123456789"))
    '0xe3069283'
    """
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC: rotated right by 15 bits plus a constant."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
