"""hpc.status and hpc.report on a hyperparameter search's sweep dir (sweep.json's "search"),
crafted with known objective values: the trials' order, the summary line, the trials table,
objective.png; and a plain sweep's output left as it was."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from unittest.mock import MagicMock

import pytest

from hpc.rundir import RunDir
from hpc.tools.report import TrialFigures, best_so_far, write_objective_plot
from hpc.tools.status import SearchRecord, header, main, read_search, search_summary, statuses
from hpc.tools.sweep_plots import best_point, parameter_axes, validation_curves
from tests.support.runs import ROOT

LRS = ["0.01", "0.05", "0.1", "0.5", "1.0", "2.0"]
# Point -> its test metrics: 2 never wrote result.json (no pid: UNKNOWN, still to report), 4 stopped
# before its evaluation (STOPPED, failed), 5 died (its pid is gone: DIED, failed).
TESTED = {0: {"accuracy": 0.80, "loss": 0.1}, 1: {"accuracy": 0.93, "loss": 0.2}, 3: {"accuracy": 0.88, "loss": 0.3}}


def _dead_pid() -> int:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return dead.pid


def _search_sweep(sweep: Path, objective: str = "val_accuracy", direction: str | None = "maximize", search: bool = True) -> list[RunDir]:
    """Six local points sweeping optim.lr, as launch.py -m with the Optuna sweeper writes them
    (trial numbers 10 + point: the table must show the trial's, not the point's)."""
    runs, points = [], []
    for num, lr in enumerate(LRS):
        run = RunDir(sweep / str(num))
        run.path.mkdir(parents=True)
        run.config.write_text("name: train\n")
        overrides = [f"optim.lr={lr}", "model=mlp"]
        job = {"job_id": None, "launcher": "local", "overrides": overrides}
        if num == 5:
            job.update(pid=_dead_pid(), host=socket.gethostname())
        run.write_json(run.job, job)
        run.metrics.write_text(json.dumps({"epoch": 1, "samples_per_s": 100.0 + num, "world_size": 1, "loss": 0.5}) + "\n")
        if num in TESTED:
            run.write_json(run.result, {"status": "completed", "loss": 0.5, "samples_per_s": 200.0 + num, "val_metrics": TESTED[num]})
        elif num == 4:
            run.write_json(run.result, {"status": "stopped", "loss": 0.7, "samples_per_s": 204.0})
        runs.append(run)
        points.append({"num": num, "overrides": overrides, "run_dir": str(run.path), "job_id": None, **({"trial": 10 + num} if search else {})})
    record: dict = {"sweep_dir": str(sweep), "points": points, "arrays": []}
    if search:
        record["search"] = {"sweeper": "optuna", "objective": objective, "direction": direction, "n_trials": 6}
    (sweep / "sweep.json").write_text(json.dumps(record))
    return runs


@pytest.mark.parametrize(
    ("objective", "direction", "order"),
    [
        ("val_accuracy", "maximize", ["1", "3", "0"]),
        ("val_accuracy", "minimize", ["0", "3", "1"]),
        ("val_loss", "minimize", ["0", "1", "3"]),
        ("val_loss", None, ["0", "1", "3"]),  # null: a loss is minimised
        ("val_accuracy", None, ["1", "3", "0"]),  # null: an accuracy is maximised
    ],
)
def test_trials_are_listed_best_first_then_those_without_a_value_in_point_order(tmp_path, objective, direction, order):
    _search_sweep(tmp_path / "sweep", objective, direction)
    found = statuses(tmp_path / "sweep")
    assert [s.run_dir.name for s in found] == [*order, "2", "4", "5"]
    assert [s.state for s in found][3:] == ["UNKNOWN", "STOPPED", "DIED"]
    name = objective.removeprefix("val_")
    assert [s.objective for s in found] == [f"{objective}={TESTED[int(n)][name]:.4g}" for n in order] + ["-"] * 3


def test_the_direction_of_a_figure_of_no_known_side_is_minimize(tmp_path):
    _search_sweep(tmp_path / "sweep", "val_within_3_sigma", None)
    assert read_search(tmp_path / "sweep") == SearchRecord(tmp_path / "sweep", "val_within_3_sigma", "minimize", {str(n): (n, 10 + n) for n in range(6)})


def test_the_summary_counts_the_trials_by_outcome_and_names_the_best(tmp_path):
    sweep = tmp_path / "sweep"
    _search_sweep(sweep)
    assert search_summary(statuses(sweep)) == (
        f"search {sweep}: 6 trials (3 completed, 2 failed, 1 running or waiting), objective val_accuracy (maximize);"
        " best #1 (Optuna's 11) optim.lr=0.05: val_accuracy=0.93"
    )
    _search_sweep(tmp_path / "min", "val_loss", "minimize")
    assert search_summary(statuses(tmp_path / "min")).endswith("objective val_loss (minimize); best #0 (Optuna's 10) optim.lr=0.01: val_loss=0.1")


def test_a_search_none_of_whose_trials_reported_says_so(tmp_path):
    sweep = tmp_path / "sweep"
    for run in _search_sweep(sweep):
        run.result.unlink(missing_ok=True)
    assert search_summary(statuses(sweep)) == (
        f"search {sweep}: 6 trials (0 completed, 1 failed, 5 running or waiting), objective val_accuracy (maximize); no trial has reported val_accuracy"
    )


def test_status_command_prints_the_summary_then_an_aligned_objective_column(tmp_path):
    sweep = tmp_path / "sweep"
    _search_sweep(sweep)
    listing = subprocess.run([sys.executable, "-m", "hpc.status", str(sweep)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert listing.returncode == 0, listing.stderr
    summary, head, *rows = listing.stdout.splitlines()
    assert summary.startswith(f"search {sweep}: 6 trials (3 completed, 2 failed, 1 running or waiting)")
    assert head.split()[:5] == ["job", "run", "swept", "objective", "state"]
    assert [row.split()[:5] for row in rows] == [
        ["local", "1", "optim.lr=0.05", "val_accuracy=0.93", "COMPLETED"],
        ["local", "3", "optim.lr=0.5", "val_accuracy=0.88", "COMPLETED"],
        ["local", "0", "optim.lr=0.01", "val_accuracy=0.8", "COMPLETED"],
        ["local", "2", "optim.lr=0.1", "-", "UNKNOWN"],
        ["local", "4", "optim.lr=1.0", "-", "STOPPED"],
        ["local", "5", "optim.lr=2.0", "-", "DIED"],
    ]
    column = head.index("state")
    assert all(row[column:].split()[0] in ("COMPLETED", "UNKNOWN", "STOPPED", "DIED") and row[column - 1] == " " for row in rows)


def test_a_plain_sweep_beside_a_search_keeps_its_order_and_has_a_blank_objective(tmp_path, monkeypatch, capsys):
    _search_sweep(tmp_path / "runs" / "b")
    _search_sweep(tmp_path / "runs" / "a", search=False)
    monkeypatch.chdir(tmp_path)  # relative run dirs, where sweep.json holds absolute ones
    found = statuses(Path("runs"))
    assert [s.run_dir.as_posix() for s in found] == [*(f"runs/a/{n}" for n in range(6)), *(f"runs/b/{n}" for n in ("1", "3", "0", "2", "4", "5"))]
    assert [s.objective for s in found[:6]] == [""] * 6
    assert main(["runs"]) == 0
    summary, head, *rows = capsys.readouterr().out.splitlines()
    assert summary.startswith("search runs/b: 6 trials") and "objective" in head
    assert rows[0].split()[:4] == ["local", "a/0", "optim.lr=0.01", "COMPLETED"]  # the blank objective column


def test_a_plain_sweeps_status_has_no_summary_and_no_objective_column(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    _search_sweep(sweep, search=False)
    assert [s.run_dir.name for s in statuses(sweep)] == [str(n) for n in range(6)]
    assert main([str(sweep)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 7 and lines[0] == header(len("optim.lr=0.01"), 0, 0, len("run"))


def test_report_of_a_search_writes_the_trials_table_best_first_and_objective_png(tmp_path):
    sweep = tmp_path / "sweep"
    _search_sweep(sweep)
    done = subprocess.run([sys.executable, "-m", "hpc.report", str(sweep)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"Trials of the search {sweep}, best first:" in done.stdout
    table = [line for line in done.stdout.splitlines() if line.startswith("| point")]
    assert table == ["| point | trial | optim.lr | val_accuracy (maximize) | val accuracy | val loss | samples/s |"]
    trials = done.stdout.split("Runs:")[0].splitlines()
    rows = [line for line in trials if line.startswith("| ") and not line.startswith(("| point", "| ---"))]
    assert rows == [
        "| 1 | 11 | 0.05 | 0.9300 | 0.9300 | 0.2000 | 201.0 |",
        "| 3 | 13 | 0.5 | 0.8800 | 0.8800 | 0.3000 | 203.0 |",
        "| 0 | 10 | 0.01 | 0.8000 | 0.8000 | 0.1000 | 200.0 |",
        "| 2 | 12 | 0.1 | - | - | - | - |",
        "| 4 | 14 | 1.0 | failed | - | - | 204.0 |",
        "| 5 | 15 | 2.0 | failed | - | - | - |",
    ]
    # The scaling table is still there, after the trials.
    assert "| run | ranks | nodes | optim.lr | samples/s | loss |" in done.stdout.split("Runs:")[1]
    assert rows[0] in (sweep / "report.md").read_text()
    written = json.loads((sweep / "report.json").read_text())
    assert [f["run"] for f in written["runs"]] == [str(n) for n in range(6)]
    (search,) = written["searches"]
    assert (search["objective"], search["direction"]) == ("val_accuracy", "maximize")
    assert [(t["point"], t["trial"], t["value"], t["outcome"]) for t in search["trials"]] == [
        (1, 11, 0.93, "completed"),
        (3, 13, 0.88, "completed"),
        (0, 10, 0.8, "completed"),
        (2, 12, None, "running or waiting"),
        (4, 14, None, "failed"),
        (5, 15, None, "failed"),
    ]
    assert search["trials"][0]["label"] == "optim.lr=0.05"
    assert (sweep / "objective.png").stat().st_size > 0 and (sweep / "loss.png").stat().st_size > 0
    assert f"{sweep / 'objective.png'}" in done.stdout


def test_report_of_a_plain_sweep_ranks_its_points_by_the_objective_and_has_no_trials(tmp_path):
    """A grid's winner is read at a glance (issue 45): its points best first by the validation
    accuracy they report (by default), the best marked, the objective's column beside the swept
    values; `sweep.objective` set for the grid ranks by that instead."""
    sweep = tmp_path / "sweep"
    _search_sweep(sweep, search=False)
    done = subprocess.run([sys.executable, "-m", "hpc.report", str(sweep)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    table = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert table[0] == "| run | ranks | nodes | optim.lr | val_accuracy (maximize) | samples/s | loss |"
    assert [row.split(" | ")[0].removeprefix("| ") for row in table[2:]] == ["1 (best)", "3", "0", "2", "4", "5"]  # 0.93, 0.88, 0.8, then none
    assert "Trials" not in done.stdout and "Runs:" not in done.stdout
    assert f"{sweep / 'parameters.png'}" in done.stdout and (sweep / "parameters.png").stat().st_size > 0  # the objective by swept value
    for point in sweep.iterdir():
        if (point / "config.yaml").exists():
            (point / "config.yaml").write_text("sweep:\n  objective: samples_per_s\n")
            result = json.loads((point / "result.json").read_text()) if (point / "result.json").exists() else {}
            (point / "result.json").write_text(json.dumps({**result, "samples_per_s": 200.0 - int(point.name)}))
    chosen = subprocess.run([sys.executable, "-m", "hpc.report", str(sweep)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    rows = [line for line in chosen.stdout.splitlines() if line.startswith("| ")]
    assert "samples_per_s (maximize)" in rows[0] and rows[2].startswith("| 0 (best) |"), chosen.stdout
    assert isinstance(json.loads((sweep / "report.json").read_text()), list)
    assert not (sweep / "objective.png").exists()


def test_the_objective_by_swept_value_puts_numbers_on_a_number_axis_and_marks_the_best():
    """parameters.png's data: a number axis per numeric key (log where it spans 10x, as learning
    rates do), categories as shown otherwise, a key only where a point set it; the best point's
    place on each axis."""
    points = [
        ({"optim.lr": "0.001", "model": "mlp"}, 0.7),
        ({"optim.lr": "0.01", "model": "cnn"}, 0.9),
        ({"optim.lr": "0.30000000000000004", "model": "cnn", "data.batch_size": "64"}, 0.8),
    ]
    lr, model, batch = parameter_axes(points)
    assert (lr.key, lr.values, lr.objective, lr.log) == ("optim.lr", [0.001, 0.01, 0.30000000000000004], [0.7, 0.9, 0.8], True)
    assert (model.values, model.log) == (["mlp", "cnn", "cnn"], False) and (batch.values, batch.objective, batch.log) == ([64.0], [0.8], False)
    best = best_point(points, "maximize")
    assert best is points[1][0] and (lr.best_at(best), model.best_at(best), batch.best_at(best)) == (0.01, "cnn", None)
    assert best_point(points, "minimize") is points[0][0]


def test_validation_curves_come_from_every_evaluation_a_run_logged(tmp_path):
    run = RunDir(tmp_path / "0")
    run.path.mkdir()
    records = [{"step": 5, "val_loss": 0.9}, {"epoch": 1, "step": 10, "loss": 1.0, "val_loss": 0.7}, {"step": 10, "val_loss": 0.6}, {"step": 15, "loss": 0.5}]
    run.metrics.write_text("".join(json.dumps(r) + "\n" for r in records))  # step 10 again: evaluated again after a resume
    silent = RunDir(tmp_path / "1")
    silent.path.mkdir()
    assert validation_curves([run, silent], "val_loss") == {"0": [(5, 0.9), (10, 0.6)]}


def _trial(point: int, value: float | None, outcome: str = "completed") -> TrialFigures:
    return TrialFigures(str(point), point, point, {}, value, outcome, {}, None)


@pytest.mark.parametrize(("direction", "best"), [("maximize", [0.5, 0.7, 0.7, 0.9]), ("minimize", [0.5, 0.5, 0.2, 0.2])])
def test_the_objective_plot_leaves_out_trials_without_a_value_and_steps_the_best_so_far(tmp_path, direction, best):
    # Given best first as the table has them; plotted in point order.
    rows = [_trial(3, 0.9), _trial(1, 0.7), _trial(0, 0.5), _trial(2, 0.2), _trial(4, None, "failed"), _trial(5, None, "running or waiting")]
    rows = sorted(rows, key=lambda r: -(r.value or 0) if direction == "maximize" else (r.value is None, r.value or 0))
    plt, ax = MagicMock(), MagicMock()
    plt.subplots.return_value = (MagicMock(), ax)
    search = SearchRecord(tmp_path, "val_accuracy", direction, {})
    assert write_objective_plot(search, rows, tmp_path / "objective.png", plt) == tmp_path / "objective.png"
    assert ax.plot.call_args.args == ([0, 1, 2, 3], [0.5, 0.7, 0.2, 0.9], "o")
    assert ax.step.call_args.args == ([0, 1, 2, 3], best)
    assert best_so_far([0.5, 0.7, 0.2, 0.9], direction) == best


def test_no_objective_plot_without_a_reported_trial_and_an_old_one_is_removed(tmp_path):
    (tmp_path / "objective.png").write_text("from an earlier report")
    search = SearchRecord(tmp_path, "loss", "minimize", {})
    assert write_objective_plot(search, [_trial(0, None, "failed")], tmp_path / "objective.png", MagicMock()) is None
    assert not (tmp_path / "objective.png").exists()
