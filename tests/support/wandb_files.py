"""Reading back W&B's offline run files (`wandb/offline-run-*-ID/run-ID.wandb`): the records
wandb-core wrote, in LevelDB's log format (32 KiB blocks; each record a 7-byte header:
checksum, length, type) after W&B's own 7-byte file header. wandb 0.31 ships no reader."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
FILE_HEADER = 7  # b":W&B", a 2-byte magic, a version byte
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    out, pos, pieces = [], FILE_HEADER, b""
    while pos + 7 <= len(data):
        room = BLOCK - pos % BLOCK
        if room < 7:  # a block's tail too short for a header is padding
            pos += room
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pieces = payload if kind in (FULL, FIRST) else pieces + payload
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            out.append(record)
    return out


def history(wandb_dir: Path, run_id: str) -> list[dict[str, Any]]:
    """Every history row logged under `run_id`, over all its offline run dirs, in the order written."""
    rows = []
    for path in sorted(wandb_dir.glob(f"offline-run-*-{run_id}*/run-{run_id}.wandb")):
        for record in records(path):
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
    return rows


def run_records(wandb_dir: Path, run_id: str) -> list[Any]:
    """The run records (id, name, group, ...) of `run_id`'s offline run dirs, one per start."""
    found = []
    for path in sorted(wandb_dir.glob(f"offline-run-*-{run_id}*/run-{run_id}.wandb")):
        found += [record.run for record in records(path) if record.WhichOneof("record_type") == "run"]
    return found
