"""hydra/sweeper=optuna: a search on Optuna's own study API (ask, tell), with a study that
outlives its launcher.

The settings are hydra-optuna-sweeper's (sampler, direction, study_name, storage, n_trials,
n_jobs, max_failure_rate, params: hpc/conf/hydra/sweeper/optuna.yaml); the plugin itself is not
used. What this adds around an interruption:
- The study is stored in the sweep dir as Optuna's journal file (`optuna.journal`: appends and
  a lock by symlink, safe on NFS and Lustre, where SQLite's locks are not) unless `storage` names
  another (`sqlite:///...`, any database URL, or `journal:///path`); a sweep dir whose study began
  in `optuna.db` (before the journal was the default) goes on there.
- Run the same command again with the same `hydra.sweep.dir` and the study continues: trials
  whose jobs were submitted are waited for (local ones resume from their checkpoint), and only
  the trials still missing from `n_trials` are asked for. No trial is submitted twice.
- A failed trial is told to Optuna as failed, never as a number; more failures in a batch than
  `max_failure_rate` allows end the search with one line.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

from hpc.config.schema import JobConfig
from hpc.config.search import Search, search_arguments
from hpc.errors import UserError
from hpc.launching.sweep import SweepPoint, read_record
from hpc.launching.trials import Outcome, run_batch, wait_for
from hpc.shown import shown_value

Direction = Literal["minimize", "maximize"]
Compose = Callable[[list[list[str]]], list[JobConfig]]  # override lists -> their configs (hpc.config.compose.compose_jobs)


@dataclass(frozen=True)
class StudyRun:
    """One search as hpc-launch checked it."""

    search: Search
    command: list[str]  # the command line's arguments (flags and overrides)
    sweep_dir: Path
    compose: Compose
    program: list[str]  # how the user started hpc-launch: ["hpc-launch"] or ["python", "launch.py"]


def run_study(run: StudyRun) -> None:
    """Run the search to its n_trials; a Ctrl-C while waiting leaves submitted trials running
    and names the command that continues the study (exit 130)."""
    try:
        _run(run)
    except KeyboardInterrupt:
        print(f"interrupted: submitted trials go on; to continue the study: {resume_command(run)}", file=sys.stderr)
        sys.exit(130)


JOURNAL = "optuna.journal"


def study_storage(setting: str | None, sweep_dir: Path) -> tuple[Any, str]:
    """(the Optuna storage, its name in messages) for `search.storage`: by default a journal file
    in the sweep dir, safe on a shared file system; a database URL as given."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    if setting is None and (sweep_dir / "optuna.db").exists():  # a study begun before the journal default
        setting = f"sqlite:///{sweep_dir / 'optuna.db'}"
    if setting is not None and not setting.startswith("journal:"):
        return setting, setting
    path = Path(setting.removeprefix("journal://").removeprefix("journal:")) if setting else sweep_dir / JOURNAL
    return JournalStorage(JournalFileBackend(str(path))), f"journal file {path}"


def _run(run: StudyRun) -> None:
    import optuna

    settings, sampler = run.search.settings, run.search.sampler
    record = read_record(run.sweep_dir)
    earlier = record.get("search", {}).get("command")
    if earlier is not None and earlier != search_arguments(run.command):
        raise UserError(f"{run.sweep_dir} holds a study of another command ({shlex.join(earlier)}): run that one, or choose a new hydra.sweep.dir")
    run.sweep_dir.mkdir(parents=True, exist_ok=True)
    storage, named = study_storage(settings.storage, run.sweep_dir)
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # our own lines say what happens
    direction = cast(Direction, run.search.direction)
    study = optuna.create_study(study_name=settings.study_name, storage=storage, sampler=sampler, direction=direction, load_if_exists=True)
    if study.trials:  # continued: a sampler seeded as before would ask the first trials' values again
        study.sampler.reseed_rng()
    ran = {int(p["trial"]): p for p in record["points"] if p.get("trial") is not None}
    unrun = sum(1 for t in study.trials if t.number not in ran)  # asked for, never run: an interrupt closed them as failed
    closed = f" (and {unrun} that an interrupt closed before they ran, not counted)" if unrun else ""
    print(f"study {settings.study_name!r} in {named}: {len(study.trials) - unrun} trials so far{closed}")
    print(f"if this launcher is interrupted, continue the study with: {resume_command(run)}")

    finish_unfinished(run, study, ran)
    done = sum(1 for t in study.trials if t.number in ran and t.state.is_finished())
    next_num = max((int(p["num"]) for p in record["points"]), default=-1) + 1
    to_go = settings.n_trials - done
    while to_go > 0:
        trials = [study.ask(fixed_distributions=run.search.space) for _ in range(min(settings.n_jobs, to_go))]
        overrides = [[*run.search.fixed, *(f"{key}={value}" for key, value in trial.params.items())] for trial in trials]
        jobs = run.compose(overrides)
        points = [SweepPoint(next_num + i, tuple(o), job, trial.number) for i, (o, job, trial) in enumerate(zip(overrides, jobs, trials, strict=True))]
        outcomes = run_batch(points, run.sweep_dir, run.search.objective, search_record(run))
        next_num += len(points)
        for trial, outcome in zip(trials, outcomes, strict=True):
            tell(study, trial.number, outcome.value)
        errors = [f"trial #{o.num}: {o.error}" for o in outcomes if o.value is None]
        if errors and len(errors) / len(outcomes) > settings.max_failure_rate:
            rate = settings.max_failure_rate
            raise UserError(f"{len(errors)} of {len(outcomes)} trials of the last batch failed (hydra.sweeper.max_failure_rate={rate}); {errors[0]}")
        to_go -= len(trials)
    report(study, run.sweep_dir)


def finish_unfinished(run: StudyRun, study: Any, ran: dict[int, dict[str, Any]]) -> None:
    """Trials an interrupted launcher left RUNNING in the study: those it had submitted are
    waited for; one it asked for but never submitted is closed as failed (and not counted)."""
    import optuna

    unfinished = [t for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]
    for trial in unfinished:
        if trial.number not in ran:
            study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
    submitted = [t.number for t in unfinished if t.number in ran]
    if not submitted:
        return
    print(f"waiting for the {len(submitted)} trial(s) the previous launcher submitted")
    entries = [ran[number] for number in submitted]
    jobs = run.compose([list(entry["overrides"]) for entry in entries])
    points = [SweepPoint(int(entry["num"]), tuple(entry["overrides"]), job, int(entry["trial"])) for entry, job in zip(entries, jobs, strict=True)]
    outcomes: Sequence[Outcome] = wait_for(points, run.sweep_dir, run.search.objective)
    for number, outcome in zip(submitted, outcomes, strict=True):
        tell(study, number, outcome.value)


def search_record(run: StudyRun) -> dict[str, Any]:
    """What sweep.json says of the search: hpc.status ranks its trials with it, and a launcher
    started again tells the same study from another one by its command."""
    search = run.search
    return {"sweeper": search.sweeper, "objective": search.objective, "direction": search.direction, "command": search_arguments(run.command)}


def report(study: Any, sweep_dir: Path) -> None:
    from omegaconf import OmegaConf

    completed = [t for t in study.trials if t.value is not None]
    if not completed:
        raise UserError(f"no trial of the study completed; see python -m hpc.status {sweep_dir}")
    best = study.best_trial
    OmegaConf.save(OmegaConf.create({"name": "optuna", "best_params": best.params, "best_value": best.value}), sweep_dir / "optimization_results.yaml")
    params = " ".join(f"{key}={shown_value(str(value))}" for key, value in best.params.items())
    print(f"best of {len(completed)} completed trials: trial {best.number} ({params}): {best.value:.6g}; python -m hpc.report {sweep_dir}")


def tell(study: Any, number: int, value: float | None) -> None:
    import optuna

    if value is None:
        study.tell(number, state=optuna.trial.TrialState.FAIL)
    else:
        study.tell(number, float(value))


def resume_command(run: StudyRun) -> str:
    """This very command, with the sweep dir it writes (the default one names the time)."""
    args = [a for a in run.command if not a.startswith("hydra.sweep.dir=")]
    return shlex.join([*run.program, *args, f"hydra.sweep.dir={run.sweep_dir}"])
