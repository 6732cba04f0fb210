"""After a signal stopped training and the checkpoint is committed: why did we stop, and who
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
script offers it (REQUEST_DIR_VARIABLE, hpc.slurm.exit_trap_lines), rank 0 only leaves a request
file, every rank exits 0, and the script's EXIT trap requeues once srun has returned. A hand-typed
sbatch script without that trap gets the requeue from rank 0 itself, as before.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path

EXIT_RESUMABLE = 75  # "stopped with a committed checkpoint; start the same run dir again"
REQUEST_DIR_VARIABLE = "HPCTK_REQUEUE_DIR"  # exported by the sbatch script whose EXIT trap requeues


def slurm_job_id(env: Mapping[str, str]) -> str | None:
    """Array tasks are requeued as <array job id>_<task id>, plain jobs by their id."""
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID")


def parse_job_fields(text: str) -> dict[str, str]:
    """`scontrol show job -o` output -> {Key: Value} (values hold no spaces in -o mode, except
    the command line, which we do not read)."""
    fields = {}
    for token in text.split():
        key, sep, value = token.partition("=")
        if sep and key not in fields:
            fields[key] = value
    return fields


def job_fields(job_id: str) -> dict[str, str]:
    """`scontrol show job -o JOB` as {Key: Value}; empty when Slurm does not know the job."""
    shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True)
    return parse_job_fields(shown.stdout) if shown.returncode == 0 else {}


def _time(value: str | None) -> datetime | None:
    if not value or value in ("None", "Unknown", "N/A"):
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None


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
    if shutil.which("scontrol") is None:
        return f"scontrol not found: job {job_id} cannot requeue itself; requeue it (or rerun the run dir) to resume", None, EXIT_RESUMABLE
    fields = job_fields(job_id)
    restart_count = int(env.get("SLURM_RESTART_COUNT") or 0)
    reason = stop_reason(fields, received_at, signal_seconds, restart_count) if fields else "external signal"
    if reason == "requeue in progress":
        return f"{reason}: Slurm requeues job {job_id} itself", None, 0
    if reason == "cancelled":
        return f"job {job_id} was cancelled: not requeueing it", None, 0
    return f"{reason}: requeueing job {job_id}", job_id, 0


def requeue(job_id: str) -> str | None:
    """`scontrol requeue`; returns the error text, or None on success."""
    done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    return None if done.returncode == 0 else done.stderr.strip() or f"exit code {done.returncode}"


def request_requeue(env: Mapping[str, str], job_id: str, detail: str) -> Path | None:
    """Ask the batch script to requeue `job_id` once srun returns: a file named after the job and
    this start in the directory the script exported, holding `detail` (what stopped the ranks,
    for the script's message); None when the script offers no such trap."""
    folder = env.get(REQUEST_DIR_VARIABLE)
    if not folder:
        return None
    request = Path(folder) / f"{job_id}.restart-{env.get('SLURM_RESTART_COUNT') or 0}"  # what the trap looks for
    request.parent.mkdir(parents=True, exist_ok=True)
    request.write_text(detail + "\n")
    return request
