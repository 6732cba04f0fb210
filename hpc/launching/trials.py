"""The trials of a search (hydra/sweeper=optuna: hpc.launching.study asks for them).

Each batch the study asks for goes out as one job array per resource shape (on cluster=local:
one run after another, here). The launcher then waits for the batch, printing one line each time
a trial's state changes, and hands back each trial's objective (`sweep.objective`, read from its
result.json), or why it has none. A trial whose job is preempted or reaches its time limit is
requeued and resumes like any job; it is done only when its run completes or its job ends for
good. Everything goes into sweep.json as it happens, so hpc.status shows the study and a
launcher started again (hpc.launching.study) finds the trials it had
submitted.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc.errors import UserError
from hpc.launching.launch import rank_environment
from hpc.launching.launchers import GONE, ForegroundLauncher, QueuedLauncher
from hpc.launching.sweep import SweepPoint, prepare_points, queued, read_record, run_here, submit_arrays, write_point_dirs, write_record
from hpc.objective import objective_value, reported_objectives
from hpc.rank.main import EXIT_RESUMABLE
from hpc.rundir import RunDir
from hpc.shown import shown_override

POLL_S = 2.0
COMMAND_LINE = frozenset(sys.argv[1:])  # what every trial shares (the study adds it to each one's overrides)
GONE_POLLS = 5  # answers in a row that Slurm no longer knows a job (or squeue fails) before it counts as ended
ENDED_POLLS = 2  # an ended state seen twice: Slurm shows NODE_FAIL or PREEMPTED for a moment before it requeues


class SearchInterrupted(UserError):
    """Ctrl-C (or SIGTERM) stopped a local trial at a checkpoint: the study stops here."""

    exit_code = 75


@dataclass(frozen=True)
class Outcome:
    num: int
    value: float | None
    error: str | None = None  # why there is no value: "job 41_2 ended FAILED (see ...)"


def run_batch(points: Sequence[SweepPoint], sweep_dir: Path, objective: str, search: dict[str, Any], emit: Callable[[str], None] = print) -> list[Outcome]:
    """Submit (or run) one batch of trials and wait for all of them; outcomes in `points` order."""
    prepared = prepare_points(points)
    if any(p.job.dry_run for p in prepared):
        raise UserError("dry_run=true with a search: launch.py prints the search without running it")
    write_point_dirs(prepared, sweep_dir)
    record = read_record(sweep_dir)
    record["search"] = search
    submit_arrays(prepared, sweep_dir, record, emit)
    for point, _ in run_here(prepared):
        record["points"].append(point.entry(sweep_dir / str(point.num), None))
    write_record(sweep_dir, record)
    return wait_for(prepared, sweep_dir, objective, emit)


def trial_name(num: int, trial: int | None) -> str:
    """`trial #4`: the point's number (its run dir, sweep.json, hpc.status), with Optuna's own
    number where it differs (`trial #4 (Optuna's 6)`: trials an interrupt closed unrun count there)."""
    return f"trial #{num}" if trial is None or trial == num else f"trial #{num} (Optuna's {trial})"


def wait_for(points: Sequence[SweepPoint], sweep_dir: Path, objective: str, emit: Callable[[str], None] = print) -> list[Outcome]:
    """The outcome of each trial, once its run has one: local trials are run (or resumed) here,
    one after another; Slurm's are waited for."""
    outcomes = {point.num: run_local_trial(point, launcher, sweep_dir, objective, emit) for point, launcher in run_here(points)}
    submitted = {point.get("num"): point.get("job_id") for point in read_record(sweep_dir)["points"]}
    for launcher, on_queue in queued(points):
        job_ids = {p.num: submitted.get(p.num) for p in on_queue}
        outcomes.update(wait_for_jobs(launcher, on_queue, job_ids, sweep_dir, objective, emit))
    return [outcomes[p.num] for p in points]


def run_local_trial(point: SweepPoint, launcher: ForegroundLauncher, sweep_dir: Path, objective: str, emit: Callable[[str], None]) -> Outcome:
    """Run the trial on local ranks; a run stopped earlier resumes from its newest checkpoint."""
    run_dir = RunDir(sweep_dir / str(point.num))
    done = trial_outcome(point.num, run_dir, objective)
    if done is not None and done.value is not None:
        return done  # it completed before the launcher was interrupted
    emit(f"{trial_name(point.num, point.trial)} ({_label(point)}): running locally")
    stops: list[int] = []
    code = launcher.run(point.job, rank_environment(point.job), run_dir, {"overrides": list(point.overrides)}, stops=stops)
    if code == EXIT_RESUMABLE:
        raise SearchInterrupted(f"{trial_name(point.num, point.trial)} stopped at a checkpoint; run the same command again to continue the study")
    outcome = trial_outcome(point.num, run_dir, objective) or Outcome(point.num, None, f"its ranks exited with code {code} (see {run_dir.rank_log(0)})")
    emit(f"{trial_name(point.num, point.trial)} ({_label(point)}): {_describe(outcome, objective)}")
    if stops:  # the signal came as the trial ended: it stops the study all the same
        raise SearchInterrupted(f"interrupted as {trial_name(point.num, point.trial)} ended; run the same command again to continue the study")
    return outcome


def wait_for_jobs(
    launcher: QueuedLauncher,
    points: Sequence[SweepPoint],
    job_ids: dict[int, str | None],
    sweep_dir: Path,
    objective: str,
    emit: Callable[[str], None],
    poll_s: float = POLL_S,
) -> dict[int, Outcome]:
    """Poll the scheduler until every trial's run completed or its job ended for good."""
    outcomes: dict[int, Outcome] = {}
    shown: dict[int, str] = {}
    ended: dict[int, int] = {}  # polls in a row that showed the job ended (or gone)
    for point in points:
        if job_ids[point.num] is None:  # the launcher stopped between sbatch and sweep.json
            outcomes[point.num] = Outcome(point.num, None, "never submitted (the launcher was interrupted while submitting it)")
    while len(outcomes) < len(points):
        waiting = [p for p in points if p.num not in outcomes]
        seen = launcher.jobs([str(job_ids[p.num]) for p in waiting])
        for point in waiting:
            job_id = str(job_ids[point.num])
            state, restarts = seen[job_id].state, seen[job_id].restarts
            ended[point.num] = ended.get(point.num, 0) + 1 if state in launcher.terminal_states or state == GONE else 0
            outcome = _settled(launcher, point.num, RunDir(sweep_dir / str(point.num)), objective, job_id, state, ended[point.num])
            label = f"{trial_name(point.num, point.trial)} ({_label(point)})"
            if outcome is not None:
                outcomes[point.num] = outcome
                emit(f"{label}: {_describe(outcome, objective)}")
            elif shown.get(point.num) != (now := f"{state} (restarts: {restarts})" if restarts else state):
                emit(f"{label}: job {job_id} {now}")
                shown[point.num] = now
        if len(outcomes) < len(points):
            time.sleep(poll_s)  # Slurm has no push notification for a job's state
    return outcomes


def _settled(launcher: QueuedLauncher, num: int, run_dir: RunDir, objective: str, job_id: str, state: str, ended_polls: int) -> Outcome | None:
    """The trial's outcome once it has one: its run completed (result.json is written before
    the job's last breath), or its job ended (or vanished) for good without that."""
    outcome = trial_outcome(num, run_dir, objective)
    if outcome is not None and state not in launcher.running_states | launcher.waiting_states:
        return outcome
    if ended_polls < (GONE_POLLS if state == GONE else ENDED_POLLS):
        return None
    reason = f"is no longer known to {launcher.traits.scheduler}" if state == GONE else f"ended {state}"
    return Outcome(num, None, f"job {job_id} {reason} without a result (see {run_dir.rank_log(0)})")


def trial_outcome(num: int, run_dir: RunDir, objective: str) -> Outcome | None:
    """The trial's outcome from its result.json: None while it has none or only a stopped run's."""
    try:
        result = json.loads(run_dir.result.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(result, dict) or result.get("status") != "completed":
        return None
    value = objective_value(result, objective)
    if value is None:
        return Outcome(num, None, f"its run reported no sweep.objective={objective} (it has: {', '.join(reported_objectives(result)) or 'nothing'})")
    return Outcome(num, value)


def _label(point: SweepPoint) -> str:
    """The trial's searched values: the overrides it does not share with the whole command."""
    own = [o for o in point.overrides if o not in COMMAND_LINE] or list(point.overrides)
    return " ".join(shown_override(o) for o in own) or "no overrides"


def _describe(outcome: Outcome, objective: str) -> str:
    return f"{objective}={outcome.value:.6g}" if outcome.value is not None else f"failed: {outcome.error}"
