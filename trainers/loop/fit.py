"""The data-parallel training loop, on one screen: pass after pass until the epochs (or max_steps)
are done or a stop is agreed; the parts are trainers.loop's (build, passes, engine, data plan, policies)."""

from __future__ import annotations

from typing import Any

from collectives.base import Collectives
from trainers.context import FitConfig, FitResult, RunContext
from trainers.loop.build import build_loop
from trainers.loop.records import EpochEnd
from trainers.task import adapt


def fit(cfg: FitConfig, comm: Collectives, task: Any, run: RunContext | None = None) -> FitResult:
    """Train `task` (trainers.task.Task: a built-in one from trainers.tasks.build_task, or a user's)."""
    task = adapt(task, f"{type(task).__module__}.{type(task).__qualname__}")
    loop = build_loop(cfg, comm, task, run or RunContext())
    epoch_end = EpochEnd()
    stopped_by = loop.stop_agreed()  # a stop during start-up or resume: the newest checkpoint stays as it is
    ended_as = "FAILED"  # how this start ends, for the trackers (an exception leaves it so)
    try:
        while stopped_by is None and loop.more_to_train():
            ended = loop.train_pass()
            if ended.stopped_by:
                stopped_by = ended.stopped_by
                break  # the partial epoch is evaluated after the restart
            if ended.rollback is not None:
                loop.roll_back_past(ended.rollback)
                continue
            if loop.in_skipped_range():
                continue  # the epoch goes on past the skipped range
            epoch_end = loop.end_epoch(ended)
            if loop.epoch_unfinished():
                break  # max_steps ended the epoch midway: a later run with more steps goes on from here
            loop.progress.next_epoch()
        if loop.progress.step > (loop.resumed_from or 0):  # nothing trained since the start or the checkpoint resumed: nothing to save
            loop.save(synchronous=True)  # the last save before exit is synchronous
        elif stopped_by is None and loop.resumed_from is not None and not epoch_end.val:
            # Resumed from the final checkpoint (the ranks ended after saving it, before reporting):
            # the result still gives the model's validation metrics. The last epoch's training loss is in metrics.jsonl.
            epoch_end = EpochEnd(val=loop.evaluate())
        # The held-out split is evaluated once, by the run that completes training, never during it.
        tested, test_step = loop.test_once() if stopped_by is None and not loop.more_to_train() else ({}, None)
        ended_as = "STOPPED" if stopped_by is not None else "FINISHED"
    finally:
        loop.close(ended_as)
    progress = loop.progress
    return FitResult(
        progress.epoch - 1,
        progress.step,
        epoch_end.loss,
        epoch_end.samples_per_s,
        progress.train_seconds,
        epoch_end.step_ms,
        epoch_end.comm_wait_ms,
        stopped_by,
        loop.resumed_from,
        dict(epoch_end.val),
        tested,
        progress.epoch if progress.position > 0 else progress.epoch - 1,
        progress.bad_steps,
        progress.rollbacks,
        test_step,
        dict(run.steps.trackers) if run is not None else {},
    )
