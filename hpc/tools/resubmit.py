"""A run, or a sweep's points, that ended without completing, started again.

    python -m hpc.resubmit RUN_DIR | SWEEP_DIR [--dry-run]

A run dir (launch.py's, holding config.yaml) that failed, was cancelled or stopped goes again as
it was first submitted, with its frozen code, into the same run dir: it resumes from its newest
committed checkpoint (on Slurm a new job, which job.json then names; locally its command.txt).
This is the command a fault's line names on Slurm: the run's job.sbatch cannot simply be given
to sbatch again (its job id names the function submitit runs and the log folders).

A point that failed, was cancelled, ran out of time or memory, lost its node, or (a local sweep)
died or was stopped goes again into its own run dir, so it resumes from its newest committed
checkpoint; points that completed, run or wait are left alone. On Slurm: one job array per
distinct sbatch script, with the sweep's concurrency limit, its code frozen at the first
submission, recorded in sweep.json (the point's entry names its new job); local points run
again one after another. A search's trials are not resubmitted: running its command again
continues the study. Login-node code: no torch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hpc.errors import UserError
from hpc.launching.launch import rank_environment
from hpc.launching.launchers import QueuedLauncher, launcher_for
from hpc.launching.sweep import SweepPoint, queued, read_record, run_here, submit_arrays, write_record
from hpc.rundir import RunDir
from hpc.tools.status import RunStatus, statuses_of, still_going


def unfinished(sweep_dir: Path) -> list[tuple[dict[str, Any], RunStatus]]:
    """sweep.json's point entries that ended without completing, with their status, by point number."""
    record = read_record(sweep_dir)
    if record.get("search"):
        raise UserError(f"{sweep_dir} holds a search: run its command again to continue the study (its trials are the sweeper's to choose)")
    listed = {int(e["num"]): e for e in record.get("points", [])}
    if not listed:
        raise UserError(f"{sweep_dir} is not a sweep dir (no points in its sweep.json)")
    # A local sweep lists a point as it starts it: the points an interrupt left unrun have a run dir only.
    for run in (p for p in sweep_dir.iterdir() if p.name.isdigit() and (p / "config.yaml").is_file() and int(p.name) not in listed):
        listed[int(run.name)] = {"num": int(run.name), "run_dir": str(run), "overrides": [], "job_id": None}
    entries = sorted(listed.items())
    runs = [RunDir(Path(entry["run_dir"])) for _, entry in entries]
    found = statuses_of(runs)
    by_dir = {status.run_dir: status for status in found}
    return [(entry, status) for (_, entry), run in zip(entries, runs, strict=True) if not _ended_well(status := by_dir[run.path])]


def _ended_well(status: RunStatus) -> bool:
    return status.state == "COMPLETED" or still_going(status)


def point_of(entry: dict[str, Any]) -> SweepPoint:
    """The point again, from the config.yaml its ranks read (the job as first submitted)."""
    run = RunDir(Path(entry["run_dir"]))
    if not run.config.is_file():
        raise UserError(f"point #{entry['num']}: {run.config} is missing; it cannot be submitted again")
    return SweepPoint(int(entry["num"]), tuple(entry.get("overrides") or ()), job_of(run), entry.get("trial"))


def job_of(run: RunDir) -> Any:
    """The job as first submitted, from the config.yaml its ranks read."""
    from omegaconf import OmegaConf

    from hpc.config.schema import to_job_config

    return to_job_config(OmegaConf.load(run.config))


def resubmit_run(run: RunDir, dry_run: bool, emit: Any = print) -> int:
    """One run (not a sweep's point) again, into its own run dir; the launcher's exit code here."""
    (status,) = statuses_of([run])
    if _ended_well(status):
        emit(f"nothing to resubmit: {run.path} {'completed' if status.state == 'COMPLETED' else 'runs or waits'} ({status.state})")
        return 0
    job = job_of(run)
    launcher = launcher_for(job)
    emit(f"{run.path}: {status.state}")
    if dry_run:
        emit("dry run: it would be submitted again, to resume from its newest committed checkpoint")
        return 0
    env = rank_environment(job)
    if isinstance(launcher, QueuedLauncher):
        job_id = launcher.submit(job, env, run, run.code)  # the code frozen at its first submission
        known = run.read_json(run.job) if run.job.is_file() else {}
        run.write_json(run.job, {**(known if isinstance(known, dict) else {}), "job_id": job_id})
        emit(f"submitted job {job_id} to {job.cluster.name}: it resumes {run.path} from its newest committed checkpoint")
        return 0
    emit(f"{run.path}: running locally again")
    return launcher.run(job, env, run, code=run.code)


def resubmit(sweep_dir: Path, dry_run: bool, emit: Any = print) -> int:
    again = unfinished(sweep_dir)
    if not again:
        emit(f"nothing to resubmit: every point of {sweep_dir} completed, runs or waits")
        return 0
    for entry, status in again:
        emit(f"point #{entry['num']} ({status.swept or ' '.join(entry.get('overrides') or []) or 'no overrides'}): {status.state}")
    if dry_run:
        emit(f"dry run: {len(again)} points would be submitted again")
        return 0
    points = [point_of(entry) for entry, _ in again]
    record = read_record(sweep_dir)
    if queued(points):
        record.setdefault("arrays", [])
        submit_arrays(points, sweep_dir, record, emit)
        record["points"] = sorted({int(e["num"]): e for e in record["points"]}.values(), key=lambda e: int(e["num"]))  # each point's newest entry
        write_record(sweep_dir, record)
    worst = 0
    for point, launcher in run_here(points):
        emit(f"point #{point.num}: running locally again")
        run_dir = RunDir(sweep_dir / str(point.num))
        worst = max(worst, launcher.run(point.job, rank_environment(point.job), run_dir, {"overrides": list(point.overrides)}))
    return worst


def main(argv: list[str]) -> int:
    from hpc.cli import Parser

    parser = Parser("python -m hpc.resubmit", __doc__ or "")
    parser.add_argument("where", type=Path, metavar="RUN_DIR|SWEEP_DIR", help="the run, or the sweep whose unfinished points, go again")
    parser.add_argument("--dry-run", action="store_true", help="list what would go again; submit nothing")
    args = parser.parse_args(argv)
    try:
        if not (args.where / "sweep.json").is_file() and (args.where / "config.yaml").is_file():
            return resubmit_run(RunDir(args.where), args.dry_run)
        return resubmit(args.where, args.dry_run)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
