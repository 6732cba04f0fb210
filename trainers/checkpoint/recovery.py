"""Where a run starts and where it goes back to: resume from the newest committed checkpoint (the
same one on every rank), and roll back past a range of non-finite steps."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from collectives.base import Collectives
from trainers.checkpoint.checkpointer import CheckpointError
from trainers.checkpoint.registry import Registry, restore_checkpoint
from trainers.checkpoint.restart import load_held
from trainers.checkpoint.saving import SaveCoordinator
from trainers.checkpoint.state import Progress
from trainers.config import CheckpointConfig

log = logging.getLogger("trainers")


def agree_on_newest(comm: Collectives, step: int | None) -> None:
    """Every rank must have found the same newest checkpoint (None: none); one max-allreduce of
    (step, -step) shows the highest and the lowest."""
    found = torch.tensor([step if step is not None else -1, -(step if step is not None else -1)], dtype=torch.float64)
    comm.allreduce_(found, op="max")
    if found[0] != -found[1]:
        raise CheckpointError(f"ranks found different newest checkpoints (steps {int(-found[1])}..{int(found[0])}); check the shared file system")


def restore_newest(coordinator: SaveCoordinator | None, comm: Collectives, registry: Registry, task: str, resume: bool = True) -> tuple[int, bool] | None:
    """The newest committed checkpoint, the same on every rank, restored into `registry` (every
    loop's resume and the built-in loop's rollback): its step and whether this rank had its own
    file (False: the world size changed); None: none (or checkpoints off, or resume=False)."""
    restored = None
    if coordinator is not None and resume:  # the same on every rank: load_held is collective
        restored = load_held(coordinator.checkpointer, comm) or coordinator.checkpointer.load_latest()
    agree_on_newest(comm, restored[0] if restored else None)
    if coordinator is None or restored is None:
        return None
    step, shared, own = restored
    restore_checkpoint(registry, step, shared, own, lambda: coordinator.checkpointer.rank_states(step), task)
    return step, own is not None


def roll_back(comm: Collectives, coordinator: SaveCoordinator | None, registry: Registry, progress: Progress, task: str, bad_range: list[int]) -> bool:
    """Back to the newest committed checkpoint after too many non-finite steps in a row; the
    data of those steps is skipped from now on (the record travels in every later checkpoint).
    False: no checkpoint to go back to (the weights are still finite: no bad update was applied)."""
    if coordinator is not None:
        coordinator.fence()  # a pending asynchronous save still copying the weights the restore overwrites
    step_before, bad_steps, rollbacks, skipped = progress.step, progress.bad_steps, progress.rollbacks, progress.skip
    restored = restore_newest(coordinator, comm, registry, task)
    if restored is None:
        progress.skip = [*progress.skip, bad_range]
        log.warning(
            "non-finite steps in a row but no committed checkpoint yet: going on without a rollback; samples %d..%d of epoch %d are skipped from now on",
            bad_range[1],
            bad_range[2],
            bad_range[0],
        )
        return False
    progress.bad_steps, progress.rollbacks, progress.skip = bad_steps, rollbacks + 1, [*skipped, bad_range]
    log.warning(
        "rolled back from step %d to checkpoint step %d after non-finite steps; samples %d..%d of epoch %d are skipped from now on",
        step_before,
        restored[0],
        bad_range[1],
        bad_range[2],
        bad_range[0],
    )
    return True


def resume_or_start(
    cfg: CheckpointConfig, checkpoint_dir: Path | None, comm: Collectives, registry: Registry, progress: Progress, task: str
) -> tuple[SaveCoordinator | None, int | None]:
    """The save coordinator (None: checkpoints off) and the step of the checkpoint resumed from
    into `registry` (None: a fresh start)."""
    if not cfg.enabled or checkpoint_dir is None:
        return None, None
    coordinator = SaveCoordinator.in_dir(checkpoint_dir, comm, cfg)
    restored = restore_newest(coordinator, comm, registry, task, cfg.resume)
    if restored is None:
        return coordinator, None
    step, own_file = restored
    log.info(
        "resumed from checkpoint step %d (epoch %d, sample %d)%s",
        step,
        progress.epoch,
        progress.position,
        "" if own_file else "; world size changed: data re-sharded by global sample index, fresh RNG",
    )
    return coordinator, step
