"""The agreed stop, asked for by hand: every rank stops at the same step and saves.

    python -m hpc.stop RUN_DIR

A local run (cluster=local): the run's stop signal (cluster.signal, SIGUSR1 by default) goes to
its rank processes, found by the pids the ranks recorded in RUN_DIR/heartbeats (trainers.watchdog)
and each checked first to be that rank still: its command line is `python -m hpc.rank.main
RUN_DIR` and it started before it wrote its heartbeat. Never the launcher or mpirun (their
command lines name the run dir too), nor a process that took the pid of a rank that ended. The
ranks exit with code 75 and `bash RUN_DIR/command.txt` resumes the run.

A queued job: its scheduler's signal to every rank (the launcher its job.json names; Slurm:
`scancel --signal=USR1 JOB`, which signals the tasks of every step, as a preemption does, not the
batch shell, whose EXIT trap requeues the job). Rank 0 asks for the requeue, and the job resumes
by itself from the checkpoint.

One line says what was sent. A directory that is no run dir, a run that is not running and a
run whose ranks recorded no pid are one line each, with exit code 2. Login-node code: no torch.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from hpc.errors import UserError
from hpc.launching.launchers import GONE, QueuedLauncher, job_launcher
from hpc.rankprocs import CLOCK_SLACK_S, RANK_MODULE, is_rank_of, live_ranks, pids_of, process_facts, stop_signal
from hpc.rundir import RunDir

__all__ = ["CLOCK_SLACK_S", "RANK_MODULE", "is_rank_of", "live_ranks", "process_facts", "stop_signal"]  # where hpc.stop's users found them


def read_run(path: Path) -> tuple[RunDir, dict[str, Any]]:
    """The run dir at `path` and its job.json; UserError naming what `path` is instead."""
    run_dir = RunDir(path.resolve())
    if not path.is_dir():
        raise UserError(f"{path}: no such directory; name the run directory launch.py printed")
    if (path / "sweep.json").is_file():
        raise UserError(f"{path} is a sweep directory; name one of its points ({path / '0'}, ...)")
    if not run_dir.config.is_file():
        raise UserError(f"{path} is not a run directory (no config.yaml); name the run directory launch.py printed")
    try:
        job = json.loads(run_dir.job.read_text())
    except (OSError, ValueError):
        why = "launch.py did not start this run; a hand-typed sbatch script's job stops with scancel --signal=USR1 JOB_ID"
        raise UserError(f"{path}: no job.json ({why})") from None
    return run_dir, job if isinstance(job, dict) else {}


def stop_queued_job(launcher: QueuedLauncher, job_id: str, name: str) -> str:
    """The stop to every rank of the scheduler's job `job_id` (Slurm's: scancel), when it runs."""
    tool = launcher.query_tool()
    if shutil.which(tool) is None:
        raise UserError(f"job {job_id} is a {launcher.traits.scheduler} job and {tool} is not here; run python -m hpc.stop on the cluster's login node")
    state = launcher.jobs([job_id])[job_id].state
    if state == GONE:
        raise UserError(f"job {job_id} is not running: {launcher.traits.scheduler} no longer knows it")
    if not launcher.stoppable(state):
        hint = f" ({launcher.cancel_hint(job_id)})" if state in launcher.waiting_states else ""
        raise UserError(f"job {job_id} is not running ({state}): no rank to stop{hint}")
    sent = launcher.signal_command(job_id, name)
    error = launcher.signal(job_id, name)
    if error is not None:
        raise UserError(f"{sent}: {error}")
    return f"sent SIG{name} to every rank of job {job_id} ({sent}): they stop at the same step and save, and the job is requeued"


def stop_local_ranks(run_dir: RunDir, name: str, host: str) -> str:
    """The stop signal to each rank of a local run that runs now."""
    sent = []
    for beat in live_ranks(run_dir, host):
        try:
            os.kill(beat.pid, signal.Signals[f"SIG{name}"])
        except ProcessLookupError:
            continue  # ended since it was checked
        except PermissionError:
            raise UserError(f"not allowed to signal pid {beat.pid}, rank {beat.rank} of {run_dir.path} (another user's run?)") from None
        sent.append(beat)
    if not sent:
        raise UserError(f"{run_dir.path} is not running: its ranks ended just now")
    ranks = f"{len(sent)} rank{'' if len(sent) == 1 else 's'}"
    return (
        f"sent SIG{name} to {ranks} of {run_dir.path} (pids {pids_of(sent)}): they stop at the same step and save; bash {run_dir.path / 'command.txt'} resumes"
    )


def stop_run(path: Path, host: str | None = None) -> str:
    """The agreed stop for the run at `path`, local or on Slurm; the line saying what was sent."""
    run_dir, job = read_run(path)
    name = stop_signal(run_dir)
    job_id = job.get("job_id")
    if isinstance(job_id, str) and job_id:
        return stop_queued_job(job_launcher(job), job_id, name)
    return stop_local_ranks(run_dir, name, host or socket.gethostname())


def main(argv: list[str]) -> int:
    from hpc.cli import Parser

    parser = Parser("python -m hpc.stop", __doc__ or "")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory launch.py printed")
    args = parser.parse_args(argv)
    try:
        print(stop_run(Path(args.run_dir)))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
