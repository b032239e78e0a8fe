"""Reading a W&B offline run back: its history records, as the run logged them.

wandb >= 0.2x writes runs from its Go core and ships no Python reader, so this reads the
file format directly: a 7-byte `:W&B` header, then a LevelDB-style log (32 KiB blocks of
records with a 7-byte header: CRC32, little-endian length, type FULL/FIRST/MIDDLE/LAST)
whose payloads are `wandb_internal_pb2.Record` protobufs.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import orjson
from wandb.proto import wandb_internal_pb2

__all__ = ["read_wandb_history"]

_BLOCK = 32 * 1024
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _payloads(data: bytes) -> list[bytes]:
    assert data[:4] == b":W&B", "not a W&B run file"
    out: list[bytes] = []
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        if _BLOCK - pos % _BLOCK < _HEADER:  # a block's tail too short for a header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        pos += _HEADER
        if kind == 0:
            break
        pending += data[pos:pos + length]
        pos += length
        if kind in (_FULL, _LAST):
            out.append(pending)
            pending = b""
    return out


def read_wandb_history(wandb_dir: Path) -> list[dict[str, Any]]:
    """Every history row of the one offline run under `wandb_dir`, keys to decoded values."""
    (run_file,) = wandb_dir.glob("offline-run-*/run-*.wandb")
    rows = []
    for payload in _payloads(run_file.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            rows.append({".".join(item.nested_key) if item.nested_key else item.key: orjson.loads(item.value_json)
                         for item in record.history.item})
    return rows
