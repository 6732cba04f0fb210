"""The Slurm plugin's rank side (hpc.schedulers): SlurmJob, what the ranks of a Slurm job ask after
a stop (hpc.rank.scheduler.Scheduler).

After a signal stopped training and the checkpoint is committed: why did we stop, and who
requeues the job? Decided from Slurm's own facts (`scontrol show job`), never from a guess.

- Preemption (PreemptTime set): we requeue. Measured on the test cluster (Slurm 22.05,
  PreemptMode=REQUEUE, GraceTime=20): a preempted job that ends by itself within GraceTime is
  NOT requeued by Slurm (it simply completes), while `scontrol requeue` from the job requeues it
  once (Restarts=1) and frees its nodes for the preemptor at once instead of after GraceTime.
- Time limit (the signal came within `--signal` seconds of EndTime): we requeue.
- Anything else (`scancel --signal`, an operator's SIGTERM): we requeue, so the job continues.
- A job Slurm is already requeueing (`scontrol requeue` by someone else): nothing to do.
Without scontrol (containers) we say so, and the rank exits with EXIT_RESUMABLE for a wrapper.

Who runs `scontrol requeue`: requeueing a job while its step runs makes Slurm kill the ranks
still alive (srun then reports "tasks 0-3: Terminated" for a clean stop). So where the batch
script offers it (REQUEST_DIR_VARIABLE, hpc.slurm.batch.exit_trap_lines), rank 0 only leaves a request
file, every rank exits 0, and the script's EXIT trap requeues once srun has returned. A hand-typed
sbatch script without that trap gets the requeue from rank 0 itself, as before.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path

from hpc.env import REQUEST_DIR_VARIABLE
from hpc.rank.lifecycle import EXIT_RESUMABLE
from hpc.rank.scheduler import StopPlan
from hpc.slurm import slurmctl
from hpc.slurm.environment import restart_count, slurm_job_id


def _time(value: str | None) -> datetime | None:
    if not value or value in ("None", "Unknown", "N/A"):
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None


def _epoch(value: str | None) -> float | None:
    found = _time(value)
    return found.timestamp() if found is not None and value and value[0].isdigit() else None


def stop_reason(fields: Mapping[str, str], received_at: datetime, signal_seconds: int, restart_count: int = 0) -> str:
    """`restart_count`: this start's SLURM_RESTART_COUNT. A job ending (COMPLETING) is being
    requeued when Slurm already counts a restart beyond ours (`scontrol requeue` counts at once,
    seen on Slurm 22.05) or it was preempted; otherwise it was cancelled."""
    state = fields.get("JobState", "")
    preempted = _time(fields.get("PreemptTime")) is not None
    if "REQUEUE" in state or state == "PENDING":
        return "requeue in progress"
    if state in ("COMPLETING", "CANCELLED"):
        requeued = int(fields.get("Restarts", "0") or 0) > restart_count or preempted
        return "requeue in progress" if requeued else "cancelled"
    if preempted:
        return "preemption"
    end = _time(fields.get("EndTime"))
    if end is not None and (end - received_at).total_seconds() <= signal_seconds + 30:
        return "time limit"
    return "external signal"


def plan_after_stop(env: Mapping[str, str], received_at: datetime, signal_seconds: int) -> tuple[str, str | None, int]:
    """(what happens, the job id to requeue or None, exit code for the rank)."""
    job_id = slurm_job_id(env)
    if job_id is None:
        return "not a Slurm job: run its command.txt (or start the same run dir again) to resume", None, EXIT_RESUMABLE
    if not slurmctl.available("scontrol"):
        return f"scontrol not found: job {job_id} cannot requeue itself; requeue it (or rerun the run dir) to resume", None, EXIT_RESUMABLE
    fields = slurmctl.job_fields(job_id)
    reason = stop_reason(fields, received_at, signal_seconds, restart_count(env)) if fields else "external signal"
    if reason == "requeue in progress":
        return f"{reason}: Slurm requeues job {job_id} itself", None, 0
    if reason == "cancelled":
        return f"job {job_id} was cancelled: not requeueing it", None, 0
    return f"{reason}: requeueing job {job_id}", job_id, 0


def request_requeue(env: Mapping[str, str], job_id: str, detail: str) -> Path | None:
    """Ask the batch script to requeue `job_id` once srun returns: a file named after the job and
    this start in the directory the script exported, holding `detail` (what stopped the ranks,
    for the script's message); None when the script offers no such trap."""
    folder = env.get(REQUEST_DIR_VARIABLE)
    if not folder:
        return None
    request = Path(folder) / f"{job_id}.restart-{restart_count(env)}"  # what the trap looks for
    request.parent.mkdir(parents=True, exist_ok=True)
    request.write_text(detail + "\n")
    return request


def mark_finished(env: Mapping[str, str]) -> Path | None:
    """Tell the batch script's EXIT trap that the training is complete: it never requeues the
    job after that, even if a rank dies while exiting. None outside such a batch script."""
    return _write_marker(env, "finished", "training complete\n")


def note_run_dir(env: Mapping[str, str], run_dir: Path) -> Path | None:
    """Tell the batch script's step supervisor where this job's checkpoints are (`<id>.run-dir`):
    it restarts the ranks only while the restarts commit new checkpoints. None outside such a script."""
    return _write_marker(env, "run-dir", f"{run_dir}\n")


def mark_error(env: Mapping[str, str], message: str) -> Path | None:
    """Tell the batch script's step supervisor that a rank hit an error that would repeat
    (`<id>.error-<start>`): it does not start the ranks again. None outside such a script."""
    return _write_marker(env, f"error-{restart_count(env)}", message + "\n")


def _write_marker(env: Mapping[str, str], suffix: str, text: str) -> Path | None:
    folder, job_id = env.get(REQUEST_DIR_VARIABLE), slurm_job_id(env)
    if not folder or job_id is None:
        return None
    marker = Path(folder) / f"{job_id}.{suffix}"
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(text)
    return marker


def trap_requeues(env: Mapping[str, str]) -> bool:
    """Whether this Slurm job's batch script requeues it after srun (hpc.slurm.batch.exit_trap_lines)."""
    return bool(env.get(REQUEST_DIR_VARIABLE)) and slurm_job_id(env) is not None and slurmctl.available("scontrol")


def forbid_failure_requeue(env: Mapping[str, str]) -> str | None:
    """A Python error repeats after a restart: tell the batch script's EXIT trap not to requeue
    by clearing the job's Requeue flag. Returns the job id when that was done."""
    job_id = slurm_job_id(env)
    if job_id is None or not slurmctl.available("scontrol"):
        return None
    return job_id if slurmctl.forbid_requeue(job_id) else None


class SlurmJob:
    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env

    def job_id(self) -> str | None:
        return slurm_job_id(self.env)

    def plan_after_stop(self, received_at: datetime, signal_seconds: int) -> StopPlan:
        return StopPlan(*plan_after_stop(self.env, received_at, signal_seconds))

    def can_requeue(self) -> bool:
        return slurmctl.available("scontrol")

    def requeue(self, job_id: str) -> str | None:
        return slurmctl.requeue(job_id, restart_count(self.env))

    def request_requeue(self, job_id: str, detail: str) -> Path | None:
        return request_requeue(self.env, job_id, detail)

    def requeued_by_batch_script(self) -> bool:
        return trap_requeues(self.env)

    def mark_finished(self) -> Path | None:
        return mark_finished(self.env)

    def mark_error(self, message: str) -> Path | None:
        return mark_error(self.env, message)

    def note_run_dir(self, run_dir: Path) -> Path | None:
        return note_run_dir(self.env, run_dir)

    def forbid_requeue(self) -> str | None:
        return forbid_failure_requeue(self.env)

    def resume_command(self, run_dir: Path) -> str:
        if not (run_dir / "config.yaml").is_file():  # ranks started by the user's own batch script
            return f"submit your batch script again (it resumes {shlex.quote(str(run_dir))})"
        # launch.py's job, submitted again into its run dir (its job.sbatch is bound to its job id)
        return f"python -m hpc.resubmit {shlex.quote(str(run_dir))}"

    def queue_times(self) -> tuple[float | None, float | None]:
        job_id = slurm_job_id(self.env)
        fields = slurmctl.job_fields(job_id) if job_id is not None else {}
        return _epoch(fields.get("EligibleTime")), _epoch(fields.get("StartTime"))
