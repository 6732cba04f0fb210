"""A run ended by a write its file system refused (trainers.faults): the one line every rank logs,
rank 0 on the console too, and the end recorded where it can be (RunDir.write_result).

    error: no space left on /small (0 B free of 24 MiB) writing /small/runs/.../steps.jsonl: the
    run stopped at step 34; its newest committed checkpoint is step 20; free space, then bash
    /small/runs/.../command.txt

Every rank raised the same StorageFailure at the same step boundary, so none aborts the others
(no MPI_ABORT banner): each ends its part and exits. A full disk, a quota or a read-only file
system stays until someone acts: the job is not restarted or requeued (hpc.rank.scheduler's
forbid_requeue), and once the cause is fixed the command the line names resumes from the newest
committed checkpoint. EIO and ESTALE may pass: counted as a failure (restart or requeue within
the job's failure budget), as hpc.rank.failures counts them.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from hpc.env import RankInfo
from hpc.rank.scheduler import scheduler_of
from hpc.rundir import RunDir

log = logging.getLogger("hpc.rank")


def storage_line(line: str, step: int, remedy: str, run_dir: RunDir) -> str:
    """The fault, where the run stopped, what was kept and what to do, in one line."""
    from trainers.checkpoint.storage import newest_committed_or_none

    newest = newest_committed_or_none(run_dir.checkpoints)
    kept = f"its newest committed checkpoint is step {newest}" if newest is not None else "no checkpoint was committed"
    return f"{line}: the run stopped at step {step}; {kept}; {remedy}, then {scheduler_of(os.environ).resume_command(run_dir.path)}"


def end_on_storage_failure(err: Any, run_dir: RunDir, rank: RankInfo, summary: dict[str, Any] | None = None) -> dict[str, Any]:
    """`err` (a trainers.faults.StorageFailure, raised alike on every rank) told in one line and
    recorded: the summary this rank ends with (`recorded`: rank 0 wrote it somewhere)."""
    line = storage_line(err.line, err.step, err.remedy, run_dir)
    log.error("error: %s", line)
    ended = {**(summary or {}), "status": "failed", "finished": False, "exit_code": 1, "reason": err.reason, "error": line, "told": True}
    ended.update({"failed_rank": err.rank if err.rank is not None else rank.rank, "steps": err.step, "world_size": rank.world_size})
    if not rank.is_main:
        return {**ended, "recorded": True}  # rank 0 records the run's end
    if err.lasting:  # a full disk stays full: no restart, no requeue; the line says how to resume once fixed
        scheduler = scheduler_of(os.environ)
        try:
            scheduler.mark_error(f"rank {rank.rank}: {err.reason}")  # the step supervisor starts no restart (its folder may be on that disk)
        except OSError:
            pass
        scheduler.forbid_requeue()
    return {**ended, "recorded": run_dir.write_result(ended) is not None}
