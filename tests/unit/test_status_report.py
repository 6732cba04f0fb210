"""hpc.status and hpc.report on crafted run directories with known numbers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from hpc.report import scaling_figures
from hpc.rundir import RunDir, find_runs, last_record
from hpc.status import run_status, statuses
from tests.support.runs import ROOT


def _jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _run(root, name, ranks, rates, accuracy=0.9):
    run = RunDir(root / name)
    run.path.mkdir(parents=True)
    run.config.write_text("name: train\n")
    _jsonl(run.metrics, [{"epoch": i + 1, "samples_per_s": r, "world_size": ranks, "test_accuracy": accuracy, "loss": 0.5} for i, r in enumerate(rates)])
    _jsonl(run.steps, [{"step": s, "loss": 1.0 / s, "samples_per_s": rates[-1]} for s in range(1, 11)])
    return run


def test_speedup_and_efficiency_from_crafted_metrics(tmp_path):
    # The first epoch is left out (start-up): steady rates 100, 180 and 320 samples/s.
    runs = [_run(tmp_path, "0", 2, [50, 100, 100]), _run(tmp_path, "1", 4, [10, 170, 190]), _run(tmp_path, "2", 8, [1, 320])]
    figures = {f.run: f for f in scaling_figures(runs)}
    assert figures["0"].samples_per_s == pytest.approx(100) and figures["0"].efficiency == pytest.approx(1.0)
    assert figures["1"].speedup == pytest.approx(1.8) and figures["1"].efficiency == pytest.approx(0.9)
    assert figures["2"].speedup == pytest.approx(3.2) and figures["2"].efficiency == pytest.approx(0.8)


def test_report_command_writes_table_and_plots(tmp_path):
    sweep = tmp_path / "sweep"
    runs = [_run(sweep, "0", 1, [100, 100]), _run(sweep, "1", 2, [100, 150])]
    (sweep / "sweep.json").write_text(json.dumps({"points": [{"num": i, "run_dir": str(r.path)} for i, r in enumerate(runs)]}))
    done = subprocess.run([sys.executable, "-m", "hpc.report", str(sweep)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "| 1 | 2 | - | 150.0 | 1.50 | 0.75 | 0.9000 | 0.5000 |" in done.stdout
    for name in ("report.md", "report.json", "scaling.png", "loss.png"):
        assert (sweep / name).stat().st_size > 0
    assert json.loads((sweep / "report.json").read_text())[1]["efficiency"] == pytest.approx(0.75)


def test_status_of_a_local_run_reads_the_run_dir(tmp_path):
    run = _run(tmp_path, "r", 2, [100])
    for step, committed in ((10, True), (20, True), (30, False)):  # step 30: a save that never committed
        (run.checkpoints / f"step-{step:09d}").mkdir(parents=True)
        if committed:
            (run.checkpoints / f"step-{step:09d}" / "COMMITTED").write_text("{}")
    run.write_json(run.job, {"launcher": "local", "pid": os.getpid(), "host": socket.gethostname()})
    status = run_status(run, {}, {})
    assert (status.state, status.last_step, status.checkpoint_step, status.samples_per_s) == ("RUNNING", 10, 20, 100.0)
    run.write_json(run.result, {"status": "stopped", "restarts": 2})
    assert run_status(run, {}, {}).state == "STOPPED"
    run.write_json(run.job, {"job_id": "77_3"})
    slurm = {"77_3": {"JobState": "RUNNING", "Restarts": "1"}}
    assert (run_status(run, slurm, {}).state, run_status(run, slurm, {}).restarts) == ("RUNNING", 1)
    assert run_status(run, {}, {"77_3": "TIMEOUT"}).state == "TIMEOUT"
    requeued = run_status(run, {"77_3": {"JobState": "PENDING", "Restarts": "2", "Reason": "BeginTime"}}, {})
    assert (requeued.reason, requeued.line().split()[1:3]) == ("BeginTime", ["PENDING(BeginTime)", "2"])
    assert run_status(run, {"77_3": {"JobState": "PENDING", "Reason": "None"}}, {}).line().split()[1] == "PENDING"
    assert run_status(run, {}, {}).state == "STOPPED"  # Slurm forgot it: result.json tells


def test_dead_local_run_is_reported_as_died(tmp_path):
    run = _run(tmp_path, "r", 2, [100])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run.write_json(run.job, {"launcher": "local", "pid": dead.pid, "host": socket.gethostname()})
    assert run_status(run, {}, {}).state == "DIED"


def test_runs_are_found_below_a_root_but_not_in_hydra_or_code_dirs(tmp_path):
    for name in ("a", "b/c", "a/.hydra", "s/code/conf"):
        (tmp_path / name).mkdir(parents=True, exist_ok=True)
        (tmp_path / name / "config.yaml").write_text("x: 1\n")
    assert [r.path.relative_to(tmp_path).as_posix() for r in find_runs(tmp_path)] == ["a", "b/c"]
    assert [s.run_dir for s in statuses(tmp_path / "a")] == [tmp_path / "a"]


def test_runs_are_listed_in_numeric_order(tmp_path):
    for name in ("sweep/10", "sweep/2", "sweep/1", "other"):
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "config.yaml").write_text("x: 1\n")
    assert [r.path.relative_to(tmp_path).as_posix() for r in find_runs(tmp_path)] == ["other", "sweep/1", "sweep/2", "sweep/10"]


def test_last_record_skips_a_line_being_written(tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"ste')
    assert last_record(path) == {"step": 2}
    assert last_record(tmp_path / "missing.jsonl") is None


@pytest.mark.parametrize("module", ["hpc.status", "hpc.report"])
def test_a_directory_without_runs_is_one_line_and_exit_2(tmp_path, module):
    done = subprocess.run([sys.executable, "-m", module, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: {tmp_path} holds no runs (no sweep.json, and no config.yaml in it or below it)"


def test_array_task_ranges_of_pending_tasks_expand():
    from hpc.status import array_task_ids

    assert array_task_ids("0-3%2") == [0, 1, 2, 3]
    assert array_task_ids("3,5-7") == [3, 5, 6, 7]
    assert array_task_ids("4") == [4]
    assert array_task_ids("N/A") == []
