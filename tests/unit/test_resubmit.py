"""Which points `python -m hpc.resubmit` sends again (the Slurm path runs in
tests/e2e/test_sweep_slurm.py): those that ended without completing, a local sweep's unrun ones
too; never a search's trials; a dir without points is one line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from hpc.rundir import RunDir
from tests.support.runs import ROOT


def dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    return int(done.stdout)


def local_point(sweep, num: int, state: str) -> dict:
    run = RunDir(sweep / str(num))
    run.path.mkdir(parents=True)
    run.config.write_text("name: train\n")
    if state == "completed":
        run.write_json(run.result, {"status": "completed"})
    elif state == "stopped":
        run.write_json(run.result, {"status": "stopped"})
    elif state in ("running", "died"):
        pid = os.getpid() if state == "running" else dead_pid()
        run.write_json(run.job, {"launcher": "local", "pid": pid, "host": socket.gethostname(), "overrides": [f"optim.lr=0.{num}"]})
    return {"num": num, "run_dir": str(run.path), "overrides": [f"optim.lr=0.{num}"], "job_id": None}


def resubmit(sweep, *flags):
    return subprocess.run([sys.executable, "-m", "hpc.resubmit", str(sweep), *flags], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_the_points_that_ended_without_completing_and_those_never_run_are_listed(tmp_path):
    sweep = tmp_path / "sweep"
    entries = [local_point(sweep, n, state) for n, state in enumerate(("completed", "died", "running", "stopped"))]
    local_point(sweep, 4, "never run")  # an interrupt came first: a run dir, no entry in sweep.json
    (sweep / "sweep.json").write_text(json.dumps({"sweep_dir": str(sweep), "points": entries, "arrays": []}))
    dry = resubmit(sweep, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines() == [
        "point #1 (optim.lr=0.1): DIED",
        "point #3 (optim.lr=0.3): STOPPED",
        "point #4 (no overrides): UNKNOWN",
        "dry run: 3 points would be submitted again",
    ]


def test_a_search_and_a_dir_without_points_are_refused_in_one_line(tmp_path):
    search = tmp_path / "search"
    search.mkdir()
    (search / "sweep.json").write_text(json.dumps({"points": [{"num": 0, "run_dir": str(search / "0")}], "search": {"objective": "val_loss"}}))
    refused = resubmit(search)
    assert (refused.returncode, refused.stdout) == (2, "") and refused.stderr.strip().startswith(f"error: {search} holds a search: run its command again")
    empty = resubmit(tmp_path)
    assert empty.returncode == 2 and empty.stderr.strip() == f"error: {tmp_path} is not a sweep dir (no points in its sweep.json)"


def test_a_single_run_dir_goes_again_unless_it_completed_or_still_runs(tmp_path):
    """The command a fault's line names on Slurm; a completed or running run is left alone."""
    runs = {state: RunDir(local_point(tmp_path, n, state)["run_dir"]) for n, state in enumerate(("completed", "running", "stopped"))}
    done = resubmit(runs["completed"].path)
    assert (done.returncode, done.stdout.strip()) == (0, f"nothing to resubmit: {runs['completed'].path} completed (COMPLETED)"), done.stderr
    going = resubmit(runs["running"].path)
    assert going.returncode == 0 and going.stdout.startswith(f"nothing to resubmit: {runs['running'].path} runs or waits"), going.stderr
    dry = resubmit(runs["stopped"].path, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    again = "dry run: it would be submitted again, to resume from its newest committed checkpoint"
    assert dry.stdout.splitlines() == [f"{runs['stopped'].path}: STOPPED", again]
