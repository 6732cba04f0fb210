"""The checkpoint directory layout, owned here and read by the login-node tools (hpc.tools.status)
without torch:

    <checkpoints>/step-000000123/shared.ckpt         model, optimizer, schedule, data position
    <checkpoints>/step-000000123/rank-00000.ckpt     that rank's RNG states (every rank writes its own)
    <checkpoints>/step-000000123/COMMITTED           JSON: step, world size, sha256 and size of every file
"""

from __future__ import annotations

from pathlib import Path

STEP_PREFIX = "step-"
MARKER = "COMMITTED"
SHARED = "shared.ckpt"


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:09d}"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.ckpt"


def step_of(directory: Path) -> int | None:
    """The step a `step-NNNNNNNNN` directory holds; None for any other name."""
    digits = directory.name.removeprefix(STEP_PREFIX)
    return int(digits) if directory.name.startswith(STEP_PREFIX) and digits.isdigit() else None


def committed_steps(checkpoints: Path) -> list[int]:
    """Steps whose directory carries the COMMITTED marker, oldest first (the marker is checked
    against the files only when a checkpoint is loaded, trainers.checkpoint)."""
    steps = [step_of(d) for d in checkpoints.glob(f"{STEP_PREFIX}*") if (d / MARKER).is_file()]
    return sorted(step for step in steps if step is not None)
