"""The checkpoint directory layout, owned here and read by the login-node tools (hpc.tools.status)
without torch:

    <checkpoints>/step-000000123/shared.ckpt         model, optimizer, schedule, data position
    <checkpoints>/step-000000123/rank-00000.ckpt     that rank's RNG states (every rank writes its own)
    <checkpoints>/step-000000123/COMMITTED           JSON: step, world size, sha256 and size of every file
    <checkpoints>/best.json                          checkpoint.best: the kept best step, its figure and value
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

STEP_PREFIX = "step-"
MARKER = "COMMITTED"
SHARED = "shared.ckpt"
BEST = "best.json"


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:09d}"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.ckpt"


def rank_files(directory: Path) -> list[Path]:
    """Every rank's own file of a checkpoint directory, in rank order."""
    return sorted(directory.glob("rank-*.ckpt"))


def step_number(name: str) -> int | None:
    """The step a `step-NNNNNNNNN` name holds; None for any other name."""
    digits = name.removeprefix(STEP_PREFIX)
    return int(digits) if name.startswith(STEP_PREFIX) and digits.isdigit() else None


def step_of(directory: Path) -> int | None:
    """The step a `step-NNNNNNNNN` directory holds; None for any other name."""
    return step_number(directory.name)


def committed_steps(checkpoints: Path) -> list[int]:
    """Steps whose directory carries the COMMITTED marker, oldest first (the marker is checked
    against the files only when a checkpoint is loaded, trainers.checkpoint.checkpointer)."""
    steps = [step_of(d) for d in checkpoints.glob(f"{STEP_PREFIX}*") if (d / MARKER).is_file()]
    return sorted(step for step in steps if step is not None)


def read_best(checkpoints: Path) -> dict[str, Any] | None:
    """best.json: {"step", "metric", "value", "mode"}; None when absent or unreadable (then no
    checkpoint is kept for its figure until the next evaluation names one)."""
    try:
        return parse_best((checkpoints / BEST).read_bytes())
    except OSError:
        return None


def parse_best(text: bytes | None) -> dict[str, Any] | None:
    """best.json's record, or None (absent, unreadable, or not such a record)."""
    try:
        record = json.loads(text) if text is not None else None
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int) or not isinstance(record.get("value"), int | float):
        return None
    return record
