"""A rank stopped dead (SIGSTOP) inside training: the other ranks' watchdogs end the job within
the timeout, naming the stopped rank; the run resumes from its last committed checkpoint."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from benchmarks.simcluster import end_process
from hpc.rank.lifecycle import EXIT_STALLED
from tests.support.runs import fixtures_env, logged_steps, resume_command, start_launch, wait_for_run
from trainers.checkpoint.checkpointer import Checkpointer
from trainers.checkpoint.layout import committed_steps
from trainers.watchdog import heartbeat_file

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]

WATCHDOG_S = 5
JOB = [
    "resources.tasks_per_node=3",
    "model.hidden_sizes=[1024,1024]",
    "trainer.max_steps=60",  # the stop lands after step 12; the resume trains the rest
    "trainer.epochs=100",
    f"trainer.watchdog_s={WATCHDOG_S}",
    "checkpoint.every_steps=5",
    "checkpoint.every_minutes=null",
]

# The same for a user's task from a package outside the toolkit (tests/fixtures/mytasks)
USER_JOB = [
    *JOB[:1],
    "task._target_=mytasks.regression.Regression",
    "+task.hidden=1024",
    "+task.samples=100000",
    "data.batch_size=128",
    "optim=adamw",
    *JOB[2:],
]


def step_10_committed(run_dir: Path) -> bool:
    """Step 10's async save commits once every rank has written it: under load, after step 12."""
    return logged_steps(run_dir) >= 12 and max(committed_steps(run_dir / "checkpoints"), default=0) >= 10


# A user's task only: the watchdog watches the loop's steps whatever the task (the built-in one's
# stalled rank is restarted and resumed on Slurm: tests/e2e/test_watchdog_slurm.py).
def test_a_stopped_rank_ends_the_job_naming_it_and_the_run_resumes(tmp_path):
    launched = start_launch(*USER_JOB, cwd=tmp_path, env=fixtures_env())
    run_dir = wait_for_run(launched, tmp_path, step_10_committed, "step 12, and step 10 committed", timeout_s=90)
    victim = json.loads(heartbeat_file(run_dir / "heartbeats", 2).read_text())["pid"]
    os.kill(victim, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        code = launched.wait(timeout=90)  # without the watchdog: hangs until the test times out
    finally:
        end_process(victim)
    ended_after = time.monotonic() - stopped_at
    assert code == EXIT_STALLED, launched.stderr.read()[-2000:]  # 70: the watchdog's code, passed on by mpirun
    # Whichever rank's watchdog fires first logs the verdict; the launcher may end the others first.
    log = "".join(path.read_text() for path in sorted((run_dir / "logs").glob("rank-*.log")))
    assert "watchdog: no step finished for" in log, log[-2000:]
    assert f"rank 2 on {socket.gethostname()} (pid {victim}) silent for" in log
    print(f"job ended {ended_after:.1f} s after rank 2 stopped (watchdog {WATCHDOG_S} s)")

    last_committed = Checkpointer(run_dir / "checkpoints", 0, 3, keep=2).committed()[-1].step
    command, env = resume_command(run_dir)
    resumed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "completed" and result["steps"] == 60 and result["resumed_from"] == last_committed >= 10
