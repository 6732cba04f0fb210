"""checkpoint.every_minutes alone (every_steps off): checkpoints appear while training runs, by
time; a signal then stops the run with its own final save and the resumable exit code 75."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from benchmarks.simcluster import end_process
from hpc.rank.lifecycle import EXIT_RESUMABLE
from tests.support.runs import rank_pids, run_dirs, start_launch, wait_for_run

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]

JOB = ["trainer.epochs=1000", "trainer.watchdog_s=null", "checkpoint.every_steps=0", "checkpoint.every_minutes=0.01", "checkpoint.keep=10"]


def committed_steps(run_dir) -> list[int]:
    log = run_dir / "logs" / "rank-00000.log"
    return [int(s) for s in re.findall(r"checkpoint step (\d+) committed", log.read_text())] if log.exists() else []


def test_every_minutes_alone_saves_by_time_while_training(tmp_path):
    launched = start_launch(*JOB, cwd=tmp_path)
    try:
        run_dir = wait_for_run(launched, tmp_path, lambda run: len(committed_steps(run)) >= 2, "two checkpoints by time (every 0.6 s asked)")
        periodic = committed_steps(run_dir)
        for pid in rank_pids(run_dir):
            os.kill(pid, signal.SIGTERM)  # as Slurm signals every task
        code = launched.wait(timeout=120)
    finally:
        launched.kill()
        for pid in rank_pids(run_dirs(tmp_path)[0]) if run_dirs(tmp_path) else []:
            end_process(pid)  # only left when the test failed
    assert code == EXIT_RESUMABLE, launched.stderr.read()[-2000:]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "stopped" and result["exit_code"] == EXIT_RESUMABLE
    # Two saves while training, with no step-count trigger; the stop then saved its own step.
    assert len(periodic) >= 2 and all(0 < step < result["steps"] for step in periodic[:2])
    assert committed_steps(run_dir)[-1] == result["steps"]
