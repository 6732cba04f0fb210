"""A real Optuna study on local MPI ranks (cluster=local): trials one after another, Ctrl-C in the
middle of one, the same command again continues the study to its number of trials."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hpc.rank.signals import STOP_SIGNALS
from tests.support.runs import ROOT, logged_steps, pending, rank_pids
from tests.support.search import check_study, launch_command, run_search, sweep_points

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]

# Wide enough that a trial trains for about half a second: the Ctrl-C below must land while it
# trains (with [256,256] it trained 0.1 s and the signal sometimes came as it completed).
# One rank per trial: the study's logic is the same on any number (and each rank start costs
# seconds of CPU on the 2-core test machine).
TRIAL = ("trainer.epochs=3", "model.hidden_sizes=[1024,1024]", "resources.tasks_per_node=1")


def test_an_interrupted_local_study_continues_to_its_number_of_trials(tmp_path):
    sweep_dir = tmp_path / "study"
    first = subprocess.Popen(launch_command(*TRIAL, sweep_dir=sweep_dir), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    # Ctrl-C once the second trial trains: its ranks stop at a checkpoint, the first is done.
    while not (len(sweep_points(sweep_dir)) == 2 and logged_steps(sweep_dir / "1") > 0):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.05)  # polling the run dir: there is no event to wait on
    # Its rank frozen mid-training while the Ctrl-C travels: under load, the signal used to
    # reach it only as the trial completed, and the resume below went untested in that run.
    ranks = rank_pids(sweep_dir / "1")
    for pid in ranks:
        os.kill(pid, signal.SIGSTOP)
    total = sum(1 for _ in (sweep_dir / "0" / "steps.jsonl").open())  # every trial trains as many steps
    assert ranks and logged_steps(sweep_dir / "1") < total, f"trial 1 ended before its rank was frozen: {ranks}"
    first.send_signal(signal.SIGINT)
    while not all(pending(pid, *STOP_SIGNALS) for pid in ranks):  # passed on by the launchers; the frozen rank keeps it pending
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.01)  # polling /proc: there is no event to wait on
    for pid in ranks:
        os.kill(pid, signal.SIGCONT)
    out, err = first.communicate(timeout=120)
    assert first.returncode == 75 and "run the same command again to continue the study" in err, out[-2000:] + err[-2000:]
    assert json.loads((sweep_dir / "1" / "result.json").read_text())["status"] == "stopped"

    again = run_search(*TRIAL, sweep_dir=sweep_dir)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "waiting for the 2 trial(s) the previous launcher submitted" in again.stdout
    assert again.stdout.count("running locally") == 3  # trial 1 resumed, 2 and 3 new; trial 0 was done
    assert json.loads((sweep_dir / "1" / "result.json").read_text())["resumed_from"] is not None  # from its checkpoint, not from scratch
    check_study(sweep_dir, trials=4)  # that the study beats the default lr: tests/e2e/test_search_slurm.py (the same sweeper and trials)

    status = subprocess.run([sys.executable, "-m", "hpc.status", str(sweep_dir)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert "4 trials (4 completed, 0 failed" in status.stdout, status.stdout
    report = subprocess.run([sys.executable, "-m", "hpc.report", str(sweep_dir)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert report.returncode == 0 and (sweep_dir / "objective.png").stat().st_size > 0, report.stderr


def test_a_ctrl_c_stops_a_local_grid_sweep_at_the_point_it_came_in(tmp_path):
    """One Ctrl-C: the running point stops at a checkpoint and the points after it never start
    (the sweep used to go on to each next point, one Ctrl-C per point)."""
    sweep_dir = tmp_path / "grid"
    # Trials 10x as long: the Ctrl-C must land while point 0 trains, and it ends the sweep there.
    long_trial = ("trainer.epochs=30", *TRIAL[1:])
    command = [sys.executable, str(ROOT / "launch.py"), "-m", "optim.lr=0.05,0.1,0.2", *long_trial, f"run_root={tmp_path}", f"hydra.sweep.dir={sweep_dir}"]
    sweep = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (sweep_dir / "0" / "steps.jsonl").exists():
        assert sweep.poll() is None and time.monotonic() < deadline, sweep.communicate()
        time.sleep(0.05)  # polling the run dir: there is no event to wait on
    sweep.send_signal(signal.SIGINT)
    out, err = sweep.communicate(timeout=120)
    assert sweep.returncode == 128 + signal.SIGINT and "interrupted: points #1, #2 not run" in out, out[-2000:] + err[-2000:]
    assert json.loads((sweep_dir / "0" / "result.json").read_text())["status"] == "stopped"
    assert not any((sweep_dir / str(num) / "result.json").exists() for num in (1, 2))
    assert out.count("running locally") == 1
