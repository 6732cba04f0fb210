"""`launch.py -m`: a sweep becomes job arrays, and launch.py returns at once.

    <sweep_dir>/sweep.json     the points (overrides, run dir, job id) and the arrays
    <sweep_dir>/code/          the sources every task runs, frozen once at submission
    <sweep_dir>/slurm/         submitit's folder for the arrays
    <sweep_dir>/<num>/         one ordinary run directory per point (see hpc.rundir)

Points whose sbatch scripts are identical (same resources, cluster, environment) share one
array; `-m resources.nodes=1,2,4` gives one array per shape. Every array task is requeued
and resumed like a single job. Points on cluster=local run one after another, here.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hpc.config.schema import JobConfig
from hpc.errors import UserError
from hpc.launching.launch import prepare, rank_environment, resolved_yaml
from hpc.launching.launchers import ForegroundLauncher, QueuedLauncher, launcher_for
from hpc.launching.snapshot import freeze_job_code
from hpc.launching.tidy import prune_empty
from hpc.rundir import RUN_MARKER, RunDir, mark_run_dir
from hpc.runroots import remember

SWEEP_FILE = "sweep.json"


@dataclass(frozen=True)
class SweepPoint:
    num: int
    overrides: tuple[str, ...]
    job: JobConfig
    trial: int | None = None  # a search's trial number (Optuna's), where the sweeper has one

    def entry(self, run_dir: Path, job_id: str | None) -> dict[str, Any]:
        """The point's line in sweep.json."""
        return {"num": self.num, "overrides": list(self.overrides), "run_dir": str(run_dir), "job_id": job_id, "trial": self.trial}


def sweep_groups(points: Sequence[SweepPoint], params_of: Callable[[JobConfig], dict[str, Any]]) -> list[tuple[dict[str, Any], list[SweepPoint]]]:
    """Points with identical sbatch parameters, in order of first appearance: one array each,
    with those parameters (computed once per point)."""
    groups: dict[str, tuple[dict[str, Any], list[SweepPoint]]] = {}
    for point in points:
        params = params_of(point.job)
        groups.setdefault(json.dumps(params, sort_keys=True, default=str), (params, []))[1].append(point)
    return list(groups.values())


def launch_sweep(points: Sequence[SweepPoint], sweep_dir: Path, emit: Callable[[str], None] = print) -> int:
    """Submit (or run locally) every point, each prepared already (hpc.launching.launch.prepare: hpc.app
    checks a sweep's points before its sweep dir is made; a study's trials: prepare_points)."""
    prepared = list(points)
    dry = {point.job.dry_run for point in prepared}
    if dry == {True}:
        return _print_dry_run(prepared, sweep_dir, emit)
    if len(dry) > 1:
        raise UserError("dry_run differs between sweep points; set it for the whole sweep, not as a sweep dimension")
    write_point_dirs(prepared, sweep_dir)
    record: dict[str, Any] = {"sweep_dir": str(sweep_dir), "points": [], "arrays": []}
    submit_arrays(prepared, sweep_dir, record, emit)
    on_local = run_here(prepared)
    # Every local point listed, with its overrides, before the first runs (as an array's are once
    # submitted): a Ctrl-C leaves the unrun ones in sweep.json, where hpc.status, hpc.report and
    # hpc.resubmit find them; listed only as each started, they were lost.
    record["points"] += [point.entry(sweep_dir / str(point.num), None) for point, _ in on_local]
    write_record(sweep_dir, record)
    worst = 0
    for index, (point, launcher) in enumerate(on_local):
        run_dir = RunDir(sweep_dir / str(point.num))
        emit(f"point #{point.num} ({' '.join(point.overrides)}): running locally")
        stops: list[int] = []
        worst = max(worst, launcher.run(point.job, rank_environment(point.job), run_dir, {"overrides": list(point.overrides)}, stops=stops))
        if stops and index + 1 < len(on_local):  # one Ctrl-C stops the sweep, not just the point it came in
            emit(f"interrupted: points {_nums([later for later, _ in on_local[index + 1 :]])} not run")
            worst = max(worst, 128 + stops[0])  # the shell's code for a command ended by that signal
            break
    emit(f"sweep directory: {sweep_dir}")
    return worst


def run_here(points: Sequence[SweepPoint]) -> list[tuple[SweepPoint, ForegroundLauncher]]:
    """The points whose launcher runs them here, in the foreground, each with it."""
    return [(point, launcher) for point in points if isinstance(launcher := launcher_for(point.job), ForegroundLauncher)]


def queued(points: Sequence[SweepPoint]) -> list[tuple[QueuedLauncher, list[SweepPoint]]]:
    """The points a scheduler runs, by launcher, in order of first appearance."""
    by_name: dict[str, tuple[QueuedLauncher, list[SweepPoint]]] = {}
    for point in points:
        launcher = launcher_for(point.job)
        if isinstance(launcher, QueuedLauncher):
            by_name.setdefault(point.job.cluster.launcher, (launcher, []))[1].append(point)
    return list(by_name.values())


def submit_arrays(points: Sequence[SweepPoint], sweep_dir: Path, record: dict[str, Any], emit: Callable[[str], None]) -> None:
    """The points a scheduler runs as one job array per distinct batch script, each recorded in
    sweep.json as it goes out (points run here are left out). The sources are frozen once per
    sweep: a search's later batches run the code its first one did."""
    code = sweep_dir / "code"
    for launcher, on_queue in queued(points):
        if not code.is_dir():
            freeze_job_code(code, *(p.job for p in on_queue))
        for params, group in arrays_of(launcher, on_queue, code, record["arrays"]):
            submit_array_group(launcher, params, group, sweep_dir, record, emit)


Array = tuple[dict[str, Any], list[SweepPoint]]  # one sbatch's parameters and its points


def arrays_of(launcher: QueuedLauncher, points: Sequence[SweepPoint], code: Path, submitted: list[dict[str, Any]]) -> Iterator[Array]:
    """The arrays `points` go out as: one per distinct batch script, each split to the
    scheduler's largest array (arrays_within; `submitted`: the arrays sent before, as sweep.json
    lists them)."""
    largest = launcher.max_array_size()
    for shared, whole in sweep_groups(points, lambda job: launcher.array_parameters(job, rank_environment(job), code)):
        yield from arrays_within(launcher, shared, whole, largest, submitted)


def arrays_within(
    launcher: QueuedLauncher, params: dict[str, Any], group: list[SweepPoint], largest: int | None, submitted: list[dict[str, Any]]
) -> Iterator[Array]:
    """One array's points as arrays of at most `largest` tasks (the cluster's MaxArraySize: task
    ids stay below it). With a throttle (sweep.max_parallel), each array after the first waits
    for the one before it to end (afterany): the throttle holds for the sweep, not per array."""
    size = largest if largest and largest < len(group) else len(group)
    for start in range(0, len(group), size):
        chunk = group[start : start + size]
        if start and _max_parallel(group) is not None:
            yield launcher.after_any(params, submitted[-1]["job_id"]), chunk  # after the array just submitted
        else:
            yield params, chunk


def submit_array_group(
    launcher: QueuedLauncher, params: dict[str, Any], group: list[SweepPoint], sweep_dir: Path, record: dict[str, Any], emit: Callable[[str], None]
) -> None:
    """One array out, recorded in sweep.json at once; an error after the first names what went out."""
    try:
        record["arrays"].append(submit_group(launcher, params, group, sweep_dir, record["points"]))
    except UserError as err:
        if not record["arrays"]:
            raise
        write_record(sweep_dir, record)  # what did go out stays visible to hpc.status
        submitted = ", ".join(a["job_id"] for a in record["arrays"])
        raise UserError(f"{err}; arrays already submitted: {submitted} (listed in {sweep_dir / SWEEP_FILE})") from None
    write_record(sweep_dir, record)
    array = record["arrays"][-1]
    limit = f", at most {array['max_parallel']} at once" if array["max_parallel"] else ""
    what = f"job array {array['job_id']}: {len(group)} tasks (points {_nums(group)})" if len(group) > 1 else f"job {array['job_id']} (point {_nums(group)})"
    emit(f"submitted {what}{limit}")


def prepare_points(points: Sequence[SweepPoint]) -> list[SweepPoint]:
    """Every point validated and its inputs pinned (hpc.launching.launch.prepare); UserError naming
    the first point that is refused."""
    prepared = []
    for point in points:
        try:
            prepared.append(replace(point, job=prepare(point.job)))
        except UserError as err:
            raise UserError(f"sweep point #{point.num} ({' '.join(point.overrides) or 'no overrides'}): {err}") from None
    return prepared


def write_point_dirs(points: Sequence[SweepPoint], sweep_dir: Path) -> None:
    """Each point's run dir with the config its ranks will read; the sweep dir and each point's
    marked as the toolkit's output (never frozen with a script's folder: hpc.config.freezing)."""
    mark_run_dir(sweep_dir)
    for root in sorted({Path(point.job.run_root) for point in points}):
        remember(root)  # hpc.status with no dir named finds the sweep
    for point in points:
        run_dir = RunDir(sweep_dir / str(point.num))
        mark_run_dir(run_dir.path)
        run_dir.config.write_text(resolved_yaml(point.job))


def submit_group(
    launcher: QueuedLauncher, params: dict[str, Any], group: list[SweepPoint], sweep_dir: Path, points_out: list[dict[str, Any]]
) -> dict[str, Any]:
    first = group[0].job
    max_parallel = _max_parallel(group)
    run_dirs = [RunDir(sweep_dir / str(p.num)) for p in group]
    array_id, job_ids, script = launcher.submit_array(params, run_dirs, sweep_dir / "slurm", max_parallel)
    for point, run_dir, job_id in zip(group, run_dirs, job_ids, strict=True):
        run_dir.sbatch.write_text(script)
        info = {
            "job_id": job_id,
            "array_job_id": array_id,
            "cluster": point.job.cluster.name,
            "launcher": point.job.cluster.launcher,
            "run_dir": str(run_dir.path),
            "overrides": list(point.overrides),
        }
        run_dir.write_json(run_dir.job, info)
        points_out.append(point.entry(run_dir.path, job_id))
    (sweep_dir / f"array-{array_id}.sbatch").write_text(script)
    return {
        "job_id": array_id,
        "tasks": len(group),
        "max_parallel": max_parallel,
        "nodes": first.resources.nodes,
        "tasks_per_node": first.resources.tasks_per_node,
        "points": [p.num for p in group],
    }


def _print_dry_run(points: Sequence[SweepPoint], sweep_dir: Path, emit: Callable[[str], None]) -> int:
    """What `-m ... dry_run=true` would submit: the arrays and each one's sbatch script."""
    code = sweep_dir / "code"
    earlier = [{"job_id": "<the array before>"}]
    for launcher, on_queue in queued(points):
        for params, group in arrays_of(launcher, on_queue, code, earlier):
            limit = _max_parallel(group) or len(group)
            emit(f"# job array of {len(group)} tasks (points {_nums(group)}), at most {limit} at once")
            for point in group:
                emit(f"#   point #{point.num}: {' '.join(point.overrides)}")
            emit(launcher.render_array(params, sweep_dir / "slurm", [RunDir(sweep_dir / str(p.num)) for p in group], limit))
    for point, _ in run_here(points):
        emit(f"# point #{point.num} ({' '.join(point.overrides)}) would run locally")
    emit(f"dry run: nothing submitted; the sweep directory would be {sweep_dir}")
    return 0


def discard_unsubmitted(sweep_dir: Path, nums: Iterable[int]) -> None:
    """A sweep that sent nothing out (refused, dry run, sbatch said no to its first array)
    leaves nothing: its point dirs, frozen code, submitit folder and Hydra's multirun.yaml go,
    then the sweep dir and the parents this command made. Once sweep.json exists, all stays."""
    if (sweep_dir / SWEEP_FILE).exists():
        return
    for name in [*map(str, nums), "code", "slurm"]:
        shutil.rmtree(sweep_dir / name, ignore_errors=True)
    (sweep_dir / "multirun.yaml").unlink(missing_ok=True)
    (sweep_dir / RUN_MARKER).unlink(missing_ok=True)
    prune_empty(sweep_dir)


def _nums(group: Sequence[SweepPoint]) -> str:
    return ", ".join(f"#{p.num}" for p in group)


def _max_parallel(group: Sequence[SweepPoint]) -> int | None:
    """The strictest sweep.max_parallel among an array's points; None: no limit."""
    return min((p.job.sweep.max_parallel for p in group if p.job.sweep.max_parallel is not None), default=None)


def read_record(sweep_dir: Path) -> dict[str, Any]:
    """sweep.json as the sweep's earlier batches left it; a new record where there is none."""
    path = sweep_dir / SWEEP_FILE
    record = RunDir(sweep_dir).read_json(path) if path.is_file() else {}
    return {"sweep_dir": str(sweep_dir), "points": [], "arrays": [], **record}


def write_record(sweep_dir: Path, record: dict[str, Any]) -> None:
    RunDir(sweep_dir).write_json(sweep_dir / SWEEP_FILE, record)  # atomic: hpc.status may read it meanwhile
