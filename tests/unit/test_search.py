"""Searching sweepers (hydra/sweeper=optuna): the objective, the checks before anything is
submitted, and how the launcher waits for a batch of trials. The real studies run in
tests/mpi/test_search_local.py and tests/e2e/test_search_slurm.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc.config.compose import fixed_overrides, sweeper_config
from hpc.config.search import check_search, edge_points, search_arguments, search_space, sweeper_name
from hpc.errors import UserError
from hpc.launching import trials
from hpc.launching.launchers import launchers
from hpc.launching.study import tell
from hpc.launching.sweep import SweepPoint
from hpc.objective import check_objective, objective_direction, objective_value, reported_objectives
from hpc.rundir import RunDir
from hpc.slurm import slurmctl
from tests.support.runs import ROOT

OPTUNA = ["hydra/sweeper=optuna"]
RESULT = {"status": "completed", "loss": 0.4, "samples_per_s": 900.0, "val_metrics": {"accuracy": 0.91, "loss": 0.3}}


def test_objective_values_come_from_result_json():
    assert objective_value(RESULT, "val_accuracy") == 0.91
    assert objective_value(RESULT, "val_loss") == 0.3
    assert objective_value(RESULT, "loss") == 0.4
    assert objective_value(RESULT, "val_perplexity") is None
    assert objective_value({**RESULT, "loss": float("nan")}, "loss") is None  # never a NaN handed to a sweeper
    assert objective_value({**RESULT, "loss": True}, "loss") is None
    assert reported_objectives(RESULT) == ["loss", "samples_per_s", "val_accuracy", "val_loss"]
    # The held-out test split's figures are not what val_ reads; a run written before validation
    # was named kept its validation figures as test_metrics, and val_ reads those.
    tested = {**RESULT, "test_metrics": {"accuracy": 0.5}}
    assert (objective_value(tested, "val_accuracy"), objective_value(tested, "test_accuracy")) == (0.91, 0.5)
    old = {"status": "completed", "loss": 0.4, "test_accuracy": 0.9, "test_metrics": {"accuracy": 0.9, "loss": 0.3}}
    assert (objective_value(old, "val_accuracy"), objective_value(old, "test_accuracy")) == (0.9, 0.9)
    assert reported_objectives(old) == ["loss", "val_accuracy", "val_loss"]


def test_objective_names_are_checked_against_what_the_task_reports():
    assert check_objective("val_accuracy", "classify") is None
    assert check_objective("val_perplexity", "lm") is None
    assert "task=classify runs report loss, samples_per_s, val_accuracy, val_loss" in str(check_objective("val_perplexity", "classify"))
    assert check_objective("val_close", None) is None  # a user task's metric: known once it ran
    assert check_objective("accuracy", None) is not None
    for task in ("classify", None):  # a search tuned on the held-out split would make it a validation split
        assert "must not tune on the held-out test split; use val_accuracy" in str(check_objective("test_accuracy", task))
    assert objective_direction("val_accuracy") == "maximize" and objective_direction("val_loss") == "minimize"
    assert objective_direction("val_close") is None


def test_edges_of_the_search_space_are_composed_not_only_its_first_point():
    points = edge_points(["optim.lr=interval(0.01,0.3)", "model=mlp,cnn", "trainer.epochs=1"], {})
    assert points == [
        ["trainer.epochs=1", "optim.lr=0.01", "model=mlp"],
        ["trainer.epochs=1", "optim.lr=0.3", "model=mlp"],
        ["trainer.epochs=1", "optim.lr=0.01", "model=cnn"],
    ]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["optim.lr=interval(0.01,0.3)"], "set sweep.objective"),
        (["optim.lr=interval(0.01,0.3)", "sweep.objective=val_perplexity"], "task=classify runs report"),
        (["optim.lr=interval(0.01,0.3)", "sweep.objective=val_accuracy", "hydra.sweeper.direction=minimize"], "set hydra.sweeper.direction=maximize"),
        (["optim.lr=interval(0.01,0.3)", "sweep.objective=loss", "hydra.sweeper.direction=up"], "choose maximize or minimize"),
        (["optim.lr=interval(0.01,0.3)", "sweep.objective=loss", "hydra.sweeper.n_trials=0"], "n_trials=0 must be a whole number >= 1"),
        (["optim.lr=interval(0.01,0.3)", "sweep.objective=loss", "hydra.sweeper.max_failure_rate=2"], "max_failure_rate=2 must be a fraction"),
        (["optim.lr=interval(0.01,0.3)", "sweep.objective=loss", "+hydra.sweeper.sampler.bogus=1"], "unexpected keyword argument 'bogus'"),
        (["optim.lr=tag(log,interval(0,0.3))", "sweep.objective=loss"], r"optim.lr=tag\(log,interval\(0,0.3\)\): `low > 0`"),
        (["optim.lr=interval(0.01,0.3)", "sweep.objective=test_accuracy"], "must not tune on the held-out test split"),
        (["cluster=local,simulated", "sweep.objective=loss"], "cluster cannot be searched"),
        (["sweep.max_parallel=1,2", "sweep.objective=loss"], "sweep.max_parallel cannot be searched"),
        (["hydra.job.chdir=true,false", "sweep.objective=loss"], "hydra.job.chdir cannot be searched"),
        (["optim.lr=interval(0.01,0.3)", "sweep.objective=loss", "hydra/sweeper/sampler=grid"], "sampler=grid"),
        (["optim.lr=interval(0.01,0.3)", "sweep.objective=loss", "hydra.sweeper.direction=[minimize,maximize]"], "lists 2 directions"),
    ],
)
def test_a_search_the_launcher_cannot_run_is_refused_in_one_line(arguments, message):
    sweeper = sweeper_config(fixed_overrides([*OPTUNA, *arguments]))
    with pytest.raises(UserError, match=message):
        check_search(arguments, sweeper)


def test_a_search_space_edge_that_no_trial_could_run_with_leaves_nothing(tmp_path):
    command = [sys.executable, str(ROOT / "launch.py"), "-m", *OPTUNA, "optim.lr=interval(-0.1,0.3)", "sweep.objective=loss", f"run_root={tmp_path}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.strip() == "error: the search space at optim.lr=-0.1: optim.lr=-0.1 must be a finite number > 0", done.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_sweeper_other_than_the_grid_and_optuna_is_refused_in_one_line(tmp_path):
    command = [sys.executable, str(ROOT / "launch.py"), "-m", "hydra/sweeper=nevergrad", "optim.lr=0.1,0.2", f"run_root={tmp_path}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert "hydra/sweeper=nevergrad: hpc-launch runs grids (the default sweeper) and Optuna searches" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_command_of_a_study_ignores_what_may_change_when_it_is_continued():
    argv = ["-m", "hydra/sweeper=optuna", "optim.lr=interval(0.01,0.3)", "hydra.sweeper.n_trials=8", "hydra.sweep.dir=/x"]
    assert search_arguments(argv) == ["hydra/sweeper=optuna", "optim.lr=interval(0.01,0.3)"]
    assert sweeper_name("hydra_plugins.hydra_nevergrad_sweeper.nevergrad_sweeper.NevergradSweeper") == "nevergrad"


def test_the_search_space_becomes_optunas_distributions_as_hydras_override_grammar_reads():
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    arguments = [
        "optim.lr=tag(log,interval(0.001,0.1))",
        "model=mlp,cnn",
        "trainer.epochs=range(1,7,2)",  # 1, 3, 5: Hydra's range leaves its stop out
        "optim.momentum=interval(0.5,0.9)",
        "data.batch_size=choice(16,32)",
        "seed=3",
        "hydra.sweeper.n_trials=4",
    ]
    params = {"params": {"optim.momentum": "0.9", "optim.weight_decay": "interval(0,0.1)", "seed": "range(1,3)"}}
    space, fixed = search_space(arguments, params)
    assert space == {
        "optim.weight_decay": FloatDistribution(0.0, 0.1),
        "optim.lr": FloatDistribution(0.001, 0.1, log=True),
        "model": CategoricalDistribution(["mlp", "cnn"]),
        "trainer.epochs": IntDistribution(1, 5, step=2),
        "optim.momentum": FloatDistribution(0.5, 0.9),  # the command line's wins over params
        "data.batch_size": CategoricalDistribution([16, 32]),
    }
    assert fixed == ["seed=3"]  # the command line's fixed value wins over params' range; Hydra's own keys are not the job's
    with pytest.raises(UserError, match=r"optim.lr=tag\(log,interval\(0,0.1\)\): "):
        search_space(["optim.lr=tag(log,interval(0,0.1))"], {})


def test_without_a_direction_the_objective_says_which_way_is_better():
    for objective, direction in (("val_accuracy", "maximize"), ("loss", "minimize")):
        arguments = ["optim.lr=interval(0.01,0.3)", f"sweep.objective={objective}"]
        search = check_search(arguments, sweeper_config(fixed_overrides([*OPTUNA, *arguments])))
        assert search.direction == direction and search.space and search.sampler is not None


def test_a_trial_without_an_objective_is_told_to_optuna_as_failed_never_as_a_number():
    import optuna

    study = optuna.create_study(direction="maximize")
    failed, completed = study.ask(), study.ask()
    tell(study, failed.number, None)
    tell(study, completed.number, 0.5)
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.FAIL, optuna.trial.TrialState.COMPLETE]
    assert study.best_value == 0.5


def _point(num: int, job_config) -> SweepPoint:
    return SweepPoint(num, (f"optim.lr=0.{num + 1}",), job_config)


class FakeSlurm:
    """Job states by poll, per job id; the run's result.json appears when a poll says so."""

    def __init__(self, sweep_dir: Path, timelines: dict[str, list[str]], results: dict[str, tuple[int, dict]]):
        self.sweep_dir, self.timelines, self.results, self.polls = sweep_dir, timelines, results, 0

    def job_records(self, ids):
        for job_id, (at_poll, result) in self.results.items():
            if self.polls == at_poll:
                num = int(job_id.split("_")[1])
                RunDir(self.sweep_dir / str(num)).write_json(RunDir(self.sweep_dir / str(num)).result, result)
        records = {}
        for job_id in ids:
            timeline = self.timelines[job_id]
            state = timeline[min(self.polls, len(timeline) - 1)]
            if state != "GONE":
                records[job_id] = {"JobState": state, "Restarts": "1" if "requeued" in timeline[: self.polls + 1] else "0"}
        self.polls += 1
        return {k: {**v, "JobState": v["JobState"].replace("requeued", "PENDING")} for k, v in records.items()}


def test_waiting_follows_a_requeue_and_fails_only_jobs_that_ended_for_good(tmp_path, monkeypatch):
    from hpc.config.compose import compose_job

    job = compose_job([])
    for num in range(3):
        (tmp_path / str(num)).mkdir()
    fake = FakeSlurm(
        tmp_path,
        {
            "7_0": ["PENDING", "RUNNING", "NODE_FAIL", "requeued", "RUNNING", "RUNNING", "COMPLETED"],  # a moment of NODE_FAIL, then requeued
            "7_1": ["RUNNING", "FAILED"],
            "7_2": ["RUNNING", "RUNNING", "COMPLETED"],
        },
        {"7_0": (6, RESULT), "7_2": (2, {**RESULT, "val_metrics": {"loss": 0.2}})},
    )
    monkeypatch.setattr(slurmctl, "job_records", fake.job_records)
    monkeypatch.setattr(slurmctl, "accounting_states", lambda ids: {})
    lines: list[str] = []
    points = [_point(num, job) for num in range(3)]
    outcomes = trials.wait_for_jobs(launchers()["slurm"], points, {0: "7_0", 1: "7_1", 2: "7_2"}, tmp_path, "val_accuracy", lines.append, poll_s=0)
    assert outcomes[0] == trials.Outcome(0, 0.91)
    assert outcomes[1].value is None and "job 7_1 ended FAILED without a result" in str(outcomes[1].error)
    assert outcomes[2].value is None and "reported no sweep.objective=val_accuracy (it has: loss, samples_per_s, val_loss)" in str(outcomes[2].error)
    assert "trial #0 (optim.lr=0.1): job 7_0 PENDING (restarts: 1)" in lines  # one line per change
    assert len([line for line in lines if line.startswith("trial #0")]) == len(["PENDING", "RUNNING", "NODE_FAIL", "requeued", "RUNNING", "done"])
    assert json.loads((tmp_path / "0" / "result.json").read_text())["status"] == "completed"


def test_a_signal_that_comes_as_a_local_trial_completes_stops_the_study_after_it(tmp_path, monkeypatch):
    """Ctrl-C in the last moments of a trial: its ranks complete rather than stop, and the study
    must stop all the same (it went on to the next trials: seen in CI)."""
    import signal

    from hpc.config.compose import compose_job
    from hpc.launching import local

    def completes_as_signalled(job, env, run_dir, info=None, code=None, stops=None):
        run_dir.path.mkdir(parents=True, exist_ok=True)
        run_dir.write_json(run_dir.result, RESULT)
        stops.append(signal.SIGINT)
        return 0

    monkeypatch.setattr(local, "run_local", completes_as_signalled)
    lines: list[str] = []
    point = _point(0, compose_job([]))
    with pytest.raises(trials.SearchInterrupted, match="interrupted as trial #0 ended; run the same command again") as raised:
        trials.run_local_trial(point, launchers()["local"], tmp_path, "val_accuracy", lines.append)
    assert raised.value.exit_code == 75
    assert lines == ["trial #0 (optim.lr=0.1): running locally", "trial #0 (optim.lr=0.1): val_accuracy=0.91"]
    monkeypatch.setattr(local, "run_local", lambda *args, **kwargs: pytest.fail("a completed trial ran again"))
    assert trials.run_local_trial(point, launchers()["local"], tmp_path, "val_accuracy", lines.append) == trials.Outcome(0, 0.91)  # the same command again


def test_a_trial_is_named_by_its_point_with_optunas_number_where_it_differs():
    """The launcher's lines and hpc.status name a trial alike (issue 45: `trial #4` beside
    Optuna's `trial 6` for the same trial, two failed placeholders between them)."""
    assert trials.trial_name(4, 6) == "trial #4 (Optuna's 6)"
    assert trials.trial_name(4, 4) == trials.trial_name(4, None) == "trial #4"


def test_a_study_is_kept_in_a_journal_file_by_default_and_in_a_database_when_asked_for(tmp_path):
    """The journal (appends under a symlink lock) is safe on NFS, where SQLite's locks are not; a
    sweep dir whose study began in optuna.db goes on there."""
    import optuna

    from hpc.launching.study import study_storage

    storage, named = study_storage(None, tmp_path)
    optuna.create_study(study_name="s", storage=storage).optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=2)
    assert named == f"journal file {tmp_path / 'optuna.journal'}" and (tmp_path / "optuna.journal").stat().st_size > 0
    assert len(optuna.load_study(study_name="s", storage=study_storage(None, tmp_path)[0]).trials) == 2  # read back: a later launcher's view
    assert study_storage(f"sqlite:///{tmp_path / 'x.db'}", tmp_path) == (f"sqlite:///{tmp_path / 'x.db'}", f"sqlite:///{tmp_path / 'x.db'}")
    assert study_storage(f"journal://{tmp_path / 'elsewhere.journal'}", tmp_path)[1] == f"journal file {tmp_path / 'elsewhere.journal'}"
    older = tmp_path / "older"
    older.mkdir()
    (older / "optuna.db").touch()
    assert study_storage(None, older)[0] == f"sqlite:///{older / 'optuna.db'}"
