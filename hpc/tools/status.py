"""What jobs are doing: one line per run (a job, an array task, or a local run).

    python -m hpc.status                 every run under runs/
    python -m hpc.status RUN_OR_SWEEP_DIR

State comes from Slurm (squeue, then sacct where accounting runs), and from the run directory
once Slurm has forgotten the job; restarts, the last step, the newest committed checkpoint and
the current samples/s, the last step's loss and the task's metrics (by the task's names) come from
the run directory. A run that was interrupted ends its line with what the interruptions cost in
all (`python -m hpc.report RUN_DIR` has the table). Login-node code: no torch.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc import slurmctl
from hpc.errors import UserError
from hpc.interruptions import TIMELINE, total_line
from hpc.rundir import RunDir, find_runs, last_record, read_jsonl
from trainers.layout import committed_steps
from trainers.reporting import task_metrics


@dataclass(frozen=True)
class RunStatus:
    run_dir: Path
    job_id: str | None
    state: str
    restarts: int
    last_step: int | None
    checkpoint_step: int | None
    samples_per_s: float | None
    log: Path
    # Why a pending job waits (Slurm's Reason): "BeginTime" after a requeue, "Priority", "JobHeldUser"
    reason: str = ""
    swept: str = ""  # what sets this sweep point apart from the others: "optim.lr=0.1 model=cnn"
    metrics: str = ""  # the last step's loss and the task's metrics, by the task's names: "loss=0.31 accuracy=0.91"
    # What the interruptions cost in all (hpc.interruptions): "2 interruptions: 41s from cause to resumed step, 3 steps redone"
    interrupted: str = ""

    def line(self, swept_width: int = 0, metrics_width: int = 0) -> str:
        step = "-" if self.last_step is None else str(self.last_step)
        ckpt = "-" if self.checkpoint_step is None else str(self.checkpoint_step)
        # A job waiting to run (again) has no current rate; its last one would read as progress.
        rate = "-" if self.samples_per_s is None or self.state in slurmctl.WAITING_STATES else f"{self.samples_per_s:.0f}"
        state = f"{self.state}({self.reason})" if self.reason else self.state
        swept = f"{self.swept or '-':<{swept_width}} " if swept_width else ""
        metrics = f"{self.metrics or '-':<{metrics_width}}  " if metrics_width else ""
        interrupted = f"  ({self.interrupted})" if self.interrupted else ""
        return f"{self.job_id or 'local':<12} {swept}{state:<24} {self.restarts:>8} {step:>8} {ckpt:>8} {rate:>10}  {metrics}{self.log}{interrupted}"


def header(swept_width: int = 0, metrics_width: int = 0) -> str:
    swept = f"{'swept':<{swept_width}} " if swept_width else ""
    metrics = f"{'last step':<{metrics_width}}  " if metrics_width else ""
    return f"{'job':<12} {swept}{'state':<24} {'restarts':>8} {'step':>8} {'ckpt':>8} {'samples/s':>10}  {metrics}log"


def step_metrics(record: dict[str, Any] | None) -> str:
    """A step record's loss and task metrics as `name=value`, under the names the task chose."""
    if not record or not isinstance(record.get("loss"), int | float):
        return ""
    shown = {"loss": float(record["loss"]), **task_metrics(record)}
    return " ".join(f"{name}={value:.4g}" for name, value in shown.items())


HEADER = header()


def point_overrides(run_dir: RunDir) -> list[str] | None:
    """The overrides of a sweep point: its job.json (written at launch), else its sweep's
    sweep.json; None for a run that is no sweep point."""
    overrides = _read_json(run_dir.job).get("overrides")
    if isinstance(overrides, list):
        return [str(o) for o in overrides]
    for point in _read_json(run_dir.path.parent / "sweep.json").get("points", []):
        if isinstance(point, dict) and Path(str(point.get("run_dir"))) == run_dir.path and isinstance(point.get("overrides"), list):
            return [str(o) for o in point["overrides"]]
    return None


def swept_values(runs: Sequence[RunDir]) -> dict[Path, dict[str, str]]:
    """For each sweep point among `runs`: the overrides whose values differ between the points
    of its sweep (those that name the point), in the order given. Other runs are left out."""
    sweeps: dict[Path, list[tuple[RunDir, dict[str, str]]]] = {}
    for run in runs:
        overrides = point_overrides(run)
        if overrides is not None:
            parsed = dict(o.lstrip("+~").partition("=")[::2] for o in overrides)
            sweeps.setdefault(run.path.parent, []).append((run, parsed))
    swept: dict[Path, dict[str, str]] = {}
    for points in sweeps.values():
        keys = list(dict.fromkeys(key for _, parsed in points for key in parsed))
        varying = [key for key in keys if len({parsed.get(key) for _, parsed in points}) > 1]
        swept.update((run.path, {key: parsed.get(key, "-") for key in varying}) for run, parsed in points)
    return swept


def swept_label(values: dict[str, str]) -> str:
    return " ".join(f"{key}={value}" for key, value in values.items())


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def newest_checkpoint(run_dir: RunDir) -> int | None:
    return max(committed_steps(run_dir.checkpoints), default=None)


def _local_state(job: dict[str, Any], result: dict[str, Any]) -> str:
    if result:
        return "COMPLETED" if result.get("status") == "completed" else "STOPPED"
    if job.get("host") == socket.gethostname() and isinstance(job.get("pid"), int):
        try:
            os.kill(job["pid"], 0)
            return "RUNNING"
        except ProcessLookupError:
            return "DIED"
        except PermissionError:
            return "RUNNING"
    return "UNKNOWN"


def run_status(run_dir: RunDir, slurm: dict[str, dict[str, str]], accounting: dict[str, str], swept: str = "") -> RunStatus:
    job = _read_json(run_dir.job)
    result = _read_json(run_dir.result)
    job_id = job.get("job_id")
    fields = (slurm.get(job_id) or slurm.get(f"{job_id.split('_')[0]}_*", {})) if job_id else {}
    if job_id is None:
        state = _local_state(job, result)
    elif fields:
        state = fields.get("JobState", "UNKNOWN")
    elif job_id in accounting:
        state = accounting[job_id]
    elif result:  # Slurm forgot the job (MinJobAge) and keeps no accounting: the run dir knows
        state = "COMPLETED" if result.get("status") == "completed" else "STOPPED"
    else:
        state = "UNKNOWN"
    restarts = int(fields["Restarts"]) if fields.get("Restarts", "").isdigit() else int(result.get("restarts", 0))
    step = last_record(run_dir.steps)
    rate = step.get("samples_per_s") if step else None
    if rate is None:
        rate = (last_record(run_dir.metrics) or {}).get("samples_per_s")
    reason = fields.get("Reason", "") if state == "PENDING" and fields.get("Reason") not in (None, "None") else ""
    return RunStatus(
        run_dir.path,
        job_id,
        state,
        restarts,
        step.get("step") if step else None,
        newest_checkpoint(run_dir),
        float(rate) if rate is not None else None,
        run_dir.rank_log(0),
        reason,
        swept,
        step_metrics(step),
        total_line(read_jsonl(run_dir.path / TIMELINE)) or "",
    )


def statuses(path: Path) -> list[RunStatus]:
    runs = find_runs(path)
    job_ids = [j for j in (_read_json(r.job).get("job_id") for r in runs) if isinstance(j, str)]
    slurm = slurmctl.job_records(job_ids)
    accounting = slurmctl.accounting_states([j for j in job_ids if j not in slurm])
    swept = swept_values(runs)
    return [run_status(run, slurm, accounting, swept_label(swept.get(run.path, {}))) for run in runs]


def main(argv: list[str]) -> int:
    from hpc.cli import Parser

    parser = Parser("python -m hpc.status", __doc__ or "")
    parser.add_argument("path", nargs="?", default="runs", metavar="RUN_OR_SWEEP_DIR", help="a run dir, a sweep dir or any dir holding them (default: runs)")
    args = parser.parse_args(argv)
    try:
        found = statuses(Path(args.path))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the listing quietly
    width = max((len(status.swept) for status in found), default=0)
    metrics_width = max((len(status.metrics) for status in found), default=0)
    print(header(width, metrics_width))
    for status in found:
        print(status.line(width, metrics_width))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
