"""Reading W&B's transaction logs (`WANDB_DIR/wandb/<mode>-<time>-ID/run-ID.wandb`, one per start
of a run): the records wandb-core wrote, in LevelDB's log format (32 KiB blocks; each record a
7-byte header: checksum, length, type) after W&B's own 7-byte file header. wandb ships no reader.

Why the toolkit reads them: offline, nothing else says which steps a start killed before
`finish()` returned left on disk (wandb-core writes what it was given until it is killed, and
SIGTERM reaches it with the ranks), and giving those steps again would repeat them.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7  # checksum (4), length (2), type (1)
FILE_HEADER = 7  # b":W&B", a 2-byte magic, a version byte
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def payloads(data: bytes) -> Iterator[bytes]:
    """Each whole record's bytes, in order; a record cut by a kill (short, or never finished) ends it."""
    pos, pieces = FILE_HEADER, b""
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:  # a block's tail too short for a header is padding
            pos += room
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        payload = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if len(payload) < length:
            return
        if kind == 0 and length == 0:
            continue
        pieces = payload if kind in (FULL, FIRST) else pieces + payload
        if kind in (FULL, LAST):
            yield pieces


def records(path: Path) -> list[Any]:
    """The log's records (wandb's protobuf Record), as many as were written whole."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B transaction log")
    out = []
    for payload in payloads(data):
        record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]  # generated code
        try:
            record.ParseFromString(payload)
        except DecodeError:
            break
        out.append(record)
    return out


def logs_of(wandb_dir: Path, run_id: str) -> list[Path]:
    """The run's transaction logs under `wandb_dir`, one per start (dirs `<mode>-<time>-ID[-N]`)."""
    return sorted(wandb_dir.glob(f"*-{run_id}*/run-{run_id}.wandb"))


def readable(log: Path) -> list[Any]:
    """The log's records; an unreadable log holds none."""
    try:
        return records(log)
    except (OSError, ValueError):
        return []


def last_step_of(held: list[Any]) -> int | None:
    """The highest history step among the records (None: none)."""
    steps = [record.history.step.num for record in held if record.WhichOneof("record_type") == "history"]
    return max(steps) if steps else None


def last_step_written(logs: list[Path]) -> int | None:
    """The highest history step the logs hold (None: none); an unreadable log counts as holding none."""
    return last_step_of([record for path in logs for record in readable(path)])


def ended(held: list[Any]) -> bool:
    """Whether the records hold their start's exit record, the last one wandb-core writes."""
    return any(record.WhichOneof("record_type") == "exit" for record in held)
