"""What jobs are doing: one line per run (a job, an array task, or a local run).

    python -m hpc.status                 every run under runs/
    python -m hpc.status RUN_OR_SWEEP_DIR

State comes from the job's scheduler, asked through the launcher its job.json names (Slurm:
scontrol, then sacct where accounting runs), and from the run directory once it has forgotten
the job; restarts, the last step, the newest committed checkpoint and
the current samples/s, the last step's loss and the task's metrics (by the task's names) come from
the run directory. A run that was interrupted ends its line with what the interruptions cost in
all (`python -m hpc.report RUN_DIR` has the table).

A hyperparameter search's sweep (sweep.json's "search") gets a summary line before the table
(its trials by outcome and the best), an objective column (`val_accuracy=0.9312`, `-` until a
value is reported), and its trials listed best first. Login-node code: no torch.

    python -m hpc.status --watch [SECONDS] DIR   list again every SECONDS (10) in place, until
                                                 no run is running or waiting; Ctrl-C stops
                                                 (`--watch DIR`: a value that is no number is the dir)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from hpc.errors import UserError
from hpc.interruptions import TIMELINE, restarts_in, total_line
from hpc.launching.launchers import GONE, QueuedJob, job_launcher, queued_launchers
from hpc.objective import objective_direction, objective_value
from hpc.rundir import RunDir, failure_line, find_runs, last_records, read_jsonl
from hpc.runlock import ranks_running
from hpc.runroots import remembered
from hpc.shown import shown_value
from trainers.checkpoint.storage import newest_committed
from trainers.reporting.reporter import task_metrics

T = TypeVar("T")

# States after which a run writes nothing more: a search trial without its objective by then has
# failed. STOPPED here is result.json's "stopped" (a local run, or a job Slurm forgot), which nothing
# restarts; a Slurm job that is to be requeued reads PENDING or REQUEUED meanwhile.
LOCAL_ENDED = frozenset({"DIED", "STOPPED"})
WATCH_S = 10.0  # --watch's interval when it names no SECONDS


@dataclass(frozen=True)
class SearchRecord:
    """A hyperparameter search (sweep.json's "search"): the figure its trials are ranked by."""

    sweep_dir: Path
    objective: str  # a result.json figure as hpc.objective names it: val_accuracy, loss, ...
    direction: str  # "maximize" or "minimize"
    # Point dir name -> (point number, Optuna's trial number or None). By name, not path: the
    # sweep.json paths may be absolute where the listed ones are relative.
    points: dict[str, tuple[int, int | None]] = field(hash=False)

    def point(self, run_dir: Path) -> int:
        known = self.points.get(run_dir.name)
        return known[0] if known else int(run_dir.name) if run_dir.name.isdigit() else -1

    def trial(self, run_dir: Path) -> int | None:
        known = self.points.get(run_dir.name)
        return known[1] if known else None


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
    search: SearchRecord | None = None  # the search this run is a trial of; None: no search's
    value: float | None = None  # the search's objective from result.json; None until reported
    peak_memory: str = ""  # "peak memory 812 MiB (rank 1)": the newest peaks the ranks reported
    tokens_per_s: float | None = None  # a token task's, or a script's that reports tokens= to end_step()
    steps_per_s: float | None = None  # from the newest steps' times: the rate of any run, a script's too
    run: str = ""  # the run dir, as found under the listed dir ("2026-11-27/10-02-41", a sweep point's "3")
    error: str = ""  # a failed run's: "rank 1: ValueError: bad input" (result.json, written by the rank that failed)

    @property
    def rate(self) -> str:
        """`250samples/s`, `1.2e+05tokens/s` or `4.1steps/s`, the first known; `-` for a job
        waiting to run (again): its last rate would read as progress."""
        if self.job_id is not None and self.state in waiting_states():
            return "-"
        for value, unit in ((self.samples_per_s, "samples/s"), (self.tokens_per_s, "tokens/s"), (self.steps_per_s, "steps/s")):
            if value is not None:
                return f"{value:.4g}{unit}" if value < 1e4 else f"{value:.0f}{unit}"
        return "-"

    @property
    def objective(self) -> str:
        """`val_accuracy=0.9312`, `-` for a trial without a value, "" outside a search."""
        if self.search is None:
            return ""
        return "-" if self.value is None else f"{self.search.objective}={figure(self.value)}"

    def line(self, swept_width: int = 0, metrics_width: int = 0, objective_width: int = 0, run_width: int = 0) -> str:
        step = "-" if self.last_step is None else str(self.last_step)
        ckpt = "-" if self.checkpoint_step is None else str(self.checkpoint_step)
        state = f"{self.state}({self.reason})" if self.reason else self.state
        swept = f"{self.swept or '-':<{swept_width}} " if swept_width else ""
        # A run outside a search, listed beside one, leaves the column blank: `-` means "no value yet".
        objective = f"{self.objective:<{objective_width}} " if objective_width else ""
        metrics = f"{self.metrics or '-':<{metrics_width}}  " if metrics_width else ""
        interrupted = f"  ({self.interrupted})" if self.interrupted else ""
        interrupted += f"  ({self.peak_memory})" if self.peak_memory else ""
        interrupted += f"  (failed on {self.error})" if self.error else ""
        run = f"{self.run or '-':<{run_width}} " if run_width else ""
        head = f"{self.job_id or 'local':<12} {run}{swept}{objective}{state:<24}"
        return f"{head} {self.restarts:>8} {step:>8} {ckpt:>8} {self.rate:>16}  {metrics}{self.log}{interrupted}"


def header(swept_width: int = 0, metrics_width: int = 0, objective_width: int = 0, run_width: int = 0) -> str:
    run = f"{'run':<{run_width}} " if run_width else ""
    swept = f"{'swept':<{swept_width}} " if swept_width else ""
    objective = f"{'objective':<{objective_width}} " if objective_width else ""
    metrics = f"{'metrics':<{metrics_width}}  " if metrics_width else ""
    return f"{'job':<12} {run}{swept}{objective}{'state':<24} {'restarts':>8} {'step':>8} {'ckpt':>8} {'rate':>16}  {metrics}log"


def figure(value: float) -> str:
    """An objective's value in four significant digits; a throughput in whole samples/s."""
    return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"


def peak_memory_line(records: list[dict[str, Any]]) -> str:
    """The newest per-rank peaks in metrics.jsonl (an epoch's end, or a script's finish), as their maximum."""
    peaks = next((r["peak_memory_mib"] for r in reversed(records) if isinstance(r.get("peak_memory_mib"), list) and r["peak_memory_mib"]), None)
    if not peaks or not all(isinstance(p, int | float) for p in peaks):
        return ""
    return f"peak memory {max(peaks):.0f} MiB (rank {peaks.index(max(peaks))})"


def step_metrics(record: dict[str, Any] | None, validation: dict[str, float] | None = None) -> str:
    """A step record's loss and task metrics as `name=value`, under the names the task chose, then
    the newest validation figures (`val_loss=...`) the step record does not hold itself."""
    shown = {"loss": float(record["loss"])} if record and isinstance(record.get("loss"), int | float) else {}
    if shown and record:
        shown.update(task_metrics(record))
    shown.update({name: value for name, value in (validation or {}).items() if name not in shown})
    return " ".join(f"{name}={value:.4g}" for name, value in shown.items())


def newest_epoch_end(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """metrics.jsonl's newest record with the training's throughput (an epoch's end), not a later
    moment's (a validation, the held-out test, a script's log()); None: there is none."""
    return next((record for record in reversed(records) if "samples_per_s" in record), None)


def newest_validation(records: list[dict[str, Any]]) -> dict[str, float]:
    """The newest value of each val_* figure in metrics.jsonl (an epoch's, or what a script logged)."""
    found: dict[str, float] = {}
    for record in records:
        found.update({k: float(v) for k, v in record.items() if k.startswith("val_") and isinstance(v, int | float) and not isinstance(v, bool)})
    return found


def steps_per_second(records: list[dict[str, Any]]) -> float | None:
    """From the median step time of the newest step records (one step alone is noisy)."""
    times = sorted(float(r["step_ms"]) for r in records if isinstance(r.get("step_ms"), int | float) and r["step_ms"] > 0)
    return 1000.0 / times[len(times) // 2] if times else None


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
    return " ".join(f"{key}={shown_value(value)}" for key, value in values.items())


def read_search(sweep_dir: Path) -> SearchRecord | None:
    """The search a sweep dir's sweep.json describes; None for a plain sweep (or no sweep)."""
    record = _read_json(sweep_dir / "sweep.json")
    search = record.get("search")
    if not isinstance(search, dict) or not isinstance(search.get("objective"), str):
        return None
    objective = search["objective"]
    direction = search.get("direction")
    if direction not in ("maximize", "minimize"):  # null: left to the figure's known better side
        direction = objective_direction(objective) or "minimize"
    points: dict[str, tuple[int, int | None]] = {}
    for point in record.get("points", []):
        if isinstance(point, dict) and isinstance(point.get("num"), int) and point.get("run_dir"):
            trial = point.get("trial")
            points[Path(str(point["run_dir"])).name] = (point["num"], trial if isinstance(trial, int) and not isinstance(trial, bool) else None)
    return SearchRecord(sweep_dir, objective, direction, points)


def searches(runs: Sequence[RunDir]) -> dict[Path, SearchRecord]:
    """The searches among the sweeps of `runs`, by sweep dir (a point's parent, as swept_values reads it)."""
    found = {parent: read_search(parent) for parent in dict.fromkeys(run.path.parent for run in runs)}
    return {parent: search for parent, search in found.items() if search is not None}


def best_first(trials: Sequence[T], value: Callable[[T], float | None], point: Callable[[T], int], direction: str) -> list[T]:
    """Trials ranked by their objective, the better side first (ties by point number), then those
    without a value in point order."""
    sign = -1.0 if direction == "maximize" else 1.0

    def key(trial: T) -> tuple[bool, float, int]:
        reported = value(trial)
        return (reported is None, 0.0 if reported is None else sign * reported, point(trial))

    return sorted(trials, key=key)


def trial_outcome(value: float | None, state: str) -> str:
    """The trial's outcome: completed (the objective reported), failed (ended without it), or running or waiting."""
    if value is not None:
        return "completed"
    return "failed" if state in ended_states() else "running or waiting"


def ranked(trials: Sequence[RunStatus]) -> list[RunStatus]:
    """The trials of one search, best first."""
    search = trials[0].search
    assert search is not None, "ranked() takes a search's trials"
    return best_first(trials, lambda s: s.value, lambda s: search.point(s.run_dir), search.direction)


def by_search(found: Sequence[RunStatus]) -> dict[Path, list[RunStatus]]:
    """The search trials among `found`, by sweep dir, in their order; other runs are left out."""
    trials: dict[Path, list[RunStatus]] = {}
    for status in found:
        if status.search is not None:
            trials.setdefault(status.search.sweep_dir, []).append(status)
    return trials


def rank_trials(found: Sequence[RunStatus]) -> list[RunStatus]:
    """`found` with each search's trials ranked best first in the places they held; other runs keep theirs."""
    places: dict[Path, list[int]] = {}
    for i, status in enumerate(found):
        if status.search is not None:
            places.setdefault(status.search.sweep_dir, []).append(i)
    order = list(found)
    for indices in places.values():
        for place, status in zip(indices, ranked([found[i] for i in indices]), strict=True):
            order[place] = status
    return order


def search_summary(trials: Sequence[RunStatus]) -> str:
    """One line on a search's trials: how many ended how, the objective, and the best trial."""
    best = ranked(trials)[0]
    search = best.search
    assert search is not None, "search_summary() takes a search's trials"
    counts = Counter(trial_outcome(s.value, s.state) for s in trials)
    outcomes = f"{counts['completed']} completed, {counts['failed']} failed, {counts['running or waiting']} running or waiting"
    head = f"search {search.sweep_dir}: {len(trials)} trial{'' if len(trials) == 1 else 's'} ({outcomes}), objective {search.objective} ({search.direction})"
    if best.value is None:
        return f"{head}; no trial has reported {search.objective}"
    trial = search.trial(best.run_dir)
    point = search.point(best.run_dir)
    name = " ".join([f"#{point}", *([f"(Optuna's {trial})"] if trial is not None and trial != point else []), *([best.swept] if best.swept else [])])
    return f"{head}; best {name}: {best.objective}"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def newest_checkpoint(run_dir: RunDir) -> int | None:
    """Its newest committed step, in the run dir or the object store checkpoint.uri named."""
    return newest_committed(run_dir.checkpoints)


def result_state(result: dict[str, Any]) -> str:
    """A run's state from its result.json: COMPLETED, FAILED, or STOPPED (resumable)."""
    return {"completed": "COMPLETED", "failed": "FAILED"}.get(str(result.get("status")), "STOPPED")


def _local_state(job: dict[str, Any], result: dict[str, Any]) -> str:
    if result:
        return result_state(result)
    if job.get("host") == socket.gethostname() and isinstance(job.get("pid"), int):
        try:
            os.kill(job["pid"], 0)
            return "RUNNING"
        except ProcessLookupError:
            return "DIED"
        except PermissionError:
            return "RUNNING"
    return "UNKNOWN"


def run_status(run_dir: RunDir, queued: Mapping[str, QueuedJob], swept: str = "", search: SearchRecord | None = None) -> RunStatus:
    """A run's status; `queued`: what its scheduler says of the jobs (QueuedLauncher.jobs)."""
    job = _read_json(run_dir.job)
    result = run_dir.read_result()  # result.json, or the end recorded where a full or read-only disk left it
    job_id = job.get("job_id")
    seen = queued.get(job_id, QueuedJob(GONE)) if isinstance(job_id, str) else QueuedJob(GONE)
    if job_id is None:
        # Ranks of a start hold the run dir's lock while they live: running, though its launcher
        # was killed, or its result.json is an earlier start's (a resume from command.txt)
        state = "RUNNING" if ranks_running(run_dir.path) else _local_state(job, result)
    elif seen.state != GONE:
        state = seen.state
    elif result:  # the scheduler forgot the job (Slurm's MinJobAge, no accounting): the run dir knows
        state = result_state(result)
    else:
        state = "UNKNOWN"
    timeline = read_jsonl(run_dir.path / TIMELINE)
    restarts = max(seen.restarts, int(result.get("restarts", 0)), restarts_in(timeline))
    newest = last_records(run_dir.steps, 20)
    step = newest[-1] if newest else None
    metrics = read_jsonl(run_dir.metrics)
    epoch = newest_epoch_end(metrics) or {}
    rate = step.get("samples_per_s") if step else None
    if rate is None:
        rate = epoch.get("samples_per_s")
    tokens = (step or {}).get("tokens_per_s", epoch.get("tokens_per_s"))
    reason = seen.reason if state == seen.state else ""
    return RunStatus(
        run_dir.path,
        job_id,
        state,
        restarts,
        step.get("step") if step else None,
        newest_checkpoint(run_dir),
        float(rate) if isinstance(rate, int | float) else None,
        run_dir.rank_log(0),
        reason,
        swept,
        step_metrics(step, newest_validation(metrics)),
        total_line(timeline) or "",
        search,
        objective_value(result, search.objective) if search else None,
        peak_memory_line(metrics),
        float(tokens) if isinstance(tokens, int | float) else None,
        steps_per_second(newest),
        error=failure_line(result),
    )


def statuses(path: Path | None) -> list[RunStatus]:
    """The status of each run under `path`, named by its place there (a run dir itself: its name);
    no path: runs/ here, else every run under the run roots used on this machine."""
    if path is None:
        return statuses_of(default_runs())
    return statuses_of(find_runs(path), root=path)


def default_runs() -> list[RunDir]:
    """runs/ in this dir (launch.py's default run_root), else the runs under every run root
    launch.py or a hand-started run handle used on this machine (hpc.runroots), newest root first."""
    if Path("runs").is_dir():
        return find_runs(Path("runs"))
    found: list[RunDir] = []
    for root in remembered():
        try:
            found += [run for run in find_runs(root) if run not in found]
        except UserError:
            continue
    if not found:
        raise UserError("no runs/ here, and no run root used on this machine holds runs: name a run dir, a sweep dir or a run root")
    return found


def run_name(run: Path, root: Path) -> str:
    """A run dir's place under the listed dir; the listed run dir itself (or one elsewhere): its name."""
    run, root = run.resolve(), root.resolve()
    return str(run.relative_to(root)) if run != root and run.is_relative_to(root) else run.name


def queued_jobs(records: Sequence[dict[str, Any]]) -> dict[str, QueuedJob]:
    """What each job's scheduler says of it (job.json's launcher, asked once per launcher for
    all its jobs); a job.json naming a launcher this toolkit does not know: left out (UNKNOWN)."""
    by_launcher: dict[str, list[str]] = {}
    for record in records:
        job_id = record.get("job_id")
        if isinstance(job_id, str):
            by_launcher.setdefault(str(record.get("launcher") or "slurm"), []).append(job_id)
    seen: dict[str, QueuedJob] = {}
    for name, ids in by_launcher.items():
        with contextlib.suppress(UserError):
            seen.update(job_launcher({"launcher": name}).jobs(ids))
    return seen


def ended_states() -> frozenset[str]:
    """States after which a run writes nothing more (a search trial without its objective by
    then has failed): every scheduler's terminal ones, and a local run's (result.json's "stopped",
    which nothing restarts; a queued job to be requeued reads as waiting meanwhile)."""
    return LOCAL_ENDED.union(*(launcher.terminal_states for launcher in queued_launchers()))


def waiting_states() -> frozenset[str]:
    return frozenset().union(*(launcher.waiting_states for launcher in queued_launchers()))


def statuses_of(runs: Sequence[RunDir], root: Path | None = None) -> list[RunStatus]:
    """Each run's status, a search's trials best first (in the places its runs held); `root`: the
    listed dir, which names the runs (their `run` column)."""
    queued = queued_jobs([_read_json(run.job) for run in runs])
    swept = swept_values(runs)
    found = searches(runs)
    listed = [run_status(run, queued, swept_label(swept.get(run.path, {})), found.get(run.path.parent)) for run in runs]
    if root is not None:
        listed = [dataclasses.replace(status, run=run_name(status.run_dir, root)) for status in listed]
    return rank_trials(listed)


def main(argv: list[str]) -> int:
    from hpc.cli import Parser

    parser = Parser("python -m hpc.status", __doc__ or "")
    parser.add_argument("path", nargs="?", metavar="RUN_OR_SWEEP_DIR", help="a run dir, a sweep dir or any dir holding them (default: runs)")
    parser.add_argument(
        "--watch",
        nargs="?",
        const=str(WATCH_S),
        metavar="SECONDS",
        help=f"list again every SECONDS ({WATCH_S:g}) until no run is running or waiting; Ctrl-C stops",
    )
    parser.add_argument("--json", action="store_true", help="one JSON list of the runs (run_dir, job_id, state, last_step, checkpoint_step, ...) for scripts")
    args = parser.parse_args(argv)
    try:
        watch, path = watch_and_path(args.watch, args.path)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    if args.json and watch is not None:
        print("error: --json lists once: drop --watch (or call it again)", file=sys.stderr)
        return 2
    in_place = watch is not None and sys.stdout.isatty()
    try:
        while True:
            found = statuses(Path(path) if path else None)
            if args.json:
                print(json.dumps([as_record(status) for status in found], indent=1))
                return 0
            listing = render(found)
            if in_place:
                listing = ["\033[H\033[2J" + f"every {watch:g} s: python -m hpc.status {path or ''}  ({time.strftime('%H:%M:%S')})", *listing]
            print("\n".join(listing), flush=True)
            if watch is None or not any(still_going(status) for status in found):
                return 0
            time.sleep(watch)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:  # the way out of --watch
        return 0


def watch_and_path(watch: str | None, path: str | None) -> tuple[float | None, str]:
    """--watch's interval (None: list once) and the dir to list (runs/ when none is named). An
    empty dir (an unset shell variable) is refused: as a Path it is the current dir, which would
    be listed instead."""
    seconds = None
    if watch is not None:
        seconds, path = watch_interval(watch, path)
    if path == "":
        raise UserError("RUN_OR_SWEEP_DIR is empty (an unset shell variable?): name a run or sweep dir, or none for runs/")
    return seconds, path or ""


def watch_interval(watch: str, path: str | None) -> tuple[float, str | None]:
    """--watch's seconds, and the dir. --watch takes an optional SECONDS, so argparse hands it the
    dir in `--watch DIR` (the README's form): a value that is no number is that dir."""
    try:
        seconds = float(watch)
    except ValueError:
        if path is not None:
            raise UserError(f"--watch {watch}: give a number of seconds (or none: every {WATCH_S:g} s)") from None
        return WATCH_S, watch
    if not (seconds > 0 and math.isfinite(seconds)):  # nan compares false; inf would end in time.sleep
        raise UserError(f"--watch {watch}: give a number of seconds above 0")
    return seconds, path


def as_record(status: RunStatus) -> dict[str, Any]:
    """A run's status as plain JSON values (--json): the fields of the listing, the search by its
    sweep dir and objective, rates as numbers (null: not known)."""
    record = {field.name: getattr(status, field.name) for field in dataclasses.fields(status) if field.name != "search"}
    record = {key: str(value) if isinstance(value, Path) else value for key, value in record.items()}
    search = status.search
    record["search"] = {"sweep_dir": str(search.sweep_dir), "objective": search.objective, "direction": search.direction} if search else None
    return record


def still_going(status: RunStatus) -> bool:
    """Running, or a Slurm job waiting to run (again): what --watch waits for."""
    return status.state in ("RUNNING", "COMPLETING") or (status.job_id is not None and status.state in waiting_states())


def render(found: list[RunStatus]) -> list[str]:
    """The listing's lines: each search's summary, the header, a line per run."""
    width = max((len(status.swept) for status in found), default=0)
    run_width = max((len(status.run) for status in found), default=0)
    run_width = max(run_width, len("run")) if run_width else 0
    metrics_width = max((len(status.metrics) for status in found), default=0)
    objective_width = max((len(status.objective) for status in found), default=0)
    if objective_width:
        objective_width = max(objective_width, len("objective"))
    lines = [search_summary(trials) for trials in by_search(found).values()]
    lines.append(header(width, metrics_width, objective_width, run_width))
    lines += [status.line(width, metrics_width, objective_width, run_width) for status in found]
    return lines


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the listing quietly (hpc/status.py says why here)
    sys.exit(main(sys.argv[1:]))
