"""The ranks' side of the launcher seam: the job they run in, as its scheduler knows it, and what
follows a stop. hpc.rank.main, the watchdog hookup, the timeline and the run handle (hpc.run) ask
the Scheduler of their environment (`scheduler_of`), never a scheduler's variables or tools.

- A scheduler plugin's `job` (hpc.schedulers): chosen where its environment claims the job
  (Slurm's: hpc.slurm.job.SlurmJob, where SLURM_JOB_ID is set).
- NoScheduler: ranks mpirun started (cluster=local, or by hand): nothing to requeue; a stopped
  run exits EXIT_RESUMABLE for whoever starts the run dir again.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Protocol

from hpc.env import scheduler_named
from hpc.rank.lifecycle import EXIT_RESUMABLE
from hpc.schedulers import loaded


@dataclass(frozen=True)
class StopPlan:
    what: str  # what follows, for the log: "time limit: requeueing job 41"
    requeue_id: str | None  # the job to requeue; None: nothing to requeue from here
    exit_code: int  # the rank's


class Scheduler(Protocol):
    def job_id(self) -> str | None:
        """The scheduler's id of this job (an array task's own); None outside a scheduler's job."""
        ...

    def plan_after_stop(self, received_at: datetime, signal_seconds: int) -> StopPlan: ...

    def can_requeue(self) -> bool:
        """Whether a rank can requeue its own job here."""
        ...

    def requeue(self, job_id: str) -> str | None:
        """Requeue the job now; the error text, None on success."""
        ...

    def request_requeue(self, job_id: str, detail: str) -> Path | None:
        """Leave the requeue to the batch script, once every rank has exited; None where it offers none."""
        ...

    def requeued_by_batch_script(self) -> bool: ...

    def mark_finished(self) -> Path | None:
        """The training is complete: the batch script never requeues the job after this."""
        ...

    def mark_error(self, message: str) -> Path | None:
        """An error that would repeat: the step supervisor starts no restart."""
        ...

    def note_run_dir(self, run_dir: Path) -> Path | None: ...

    def forbid_requeue(self) -> str | None:
        """The job is never requeued again (an error that would repeat); its id where that was done."""
        ...

    def resume_command(self, run_dir: Path) -> str:
        """What a person types to start the run again from its newest committed checkpoint."""
        ...

    def queue_times(self) -> tuple[float | None, float | None]:
        """(eligible, started): when this start of the job became eligible to run again after a
        requeue, and when the scheduler started it (epoch seconds); None where it cannot say."""
        ...


class NoScheduler:
    """Ranks outside any scheduler's job: mpirun's (cluster=local), or started by hand."""

    def job_id(self) -> str | None:
        return None

    def plan_after_stop(self, received_at: datetime, signal_seconds: int) -> StopPlan:
        return StopPlan("not a Slurm job: run its command.txt (or start the same run dir again) to resume", None, EXIT_RESUMABLE)

    def can_requeue(self) -> bool:
        return False

    def requeue(self, job_id: str) -> str | None:
        return f"job {job_id}: no scheduler runs these ranks"

    def request_requeue(self, job_id: str, detail: str) -> Path | None:
        return None

    def requeued_by_batch_script(self) -> bool:
        return False

    def mark_finished(self) -> Path | None:
        return None

    def mark_error(self, message: str) -> Path | None:
        return None

    def note_run_dir(self, run_dir: Path) -> Path | None:
        return None

    def forbid_requeue(self) -> str | None:
        return None

    def resume_command(self, run_dir: Path) -> str:
        if not (run_dir / "command.txt").is_file():  # ranks started by hand (torchrun, mpirun)
            return f"start the same command again (it resumes {shlex.quote(str(run_dir))})"
        return f"bash {shlex.quote(str(run_dir / 'command.txt'))}"

    def queue_times(self) -> tuple[float | None, float | None]:
        return None, None


def scheduler_of(env: Mapping[str, str]) -> Scheduler:
    """The scheduler whose job these ranks run in, from their environment."""
    named = scheduler_named(env)
    if named is None:
        return NoScheduler()
    job: Scheduler = loaded(named[0], "job")(env)
    return job
