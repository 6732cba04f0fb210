"""A rank stalled inside a collective on the real Slurm (SIGSTOP): the watchdog on the other
ranks names it and ends the step; the batch script's step supervisor starts the ranks again in
the allocation, they resume from the last committed checkpoint and complete, instead of hanging
until the time limit."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from benchmarks.simcluster import poll, restarts
from tests.conftest import wait_until_done
from tests.support.runs import logged_steps, submit_job
from trainers.checkpoint.layout import committed_steps
from trainers.watchdog import heartbeat_file

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("needs_slurm")]

JOB = (
    "cluster=simulated",
    "resources.nodes=2",
    "resources.tasks_per_node=1",  # a rank on each node: the stalled one is not on the batch host
    "model.hidden_sizes=[1024,1024]",
    "trainer.epochs=3",
    "trainer.watchdog_s=8",
    "checkpoint.every_steps=5",
    "checkpoint.every_minutes=null",
)


def restarted_in_allocation(run_dir) -> bool:
    return any('"decision": "restart"' in log.read_text() for log in (run_dir / "slurm" / "requeue-requests").glob("*.steps.jsonl"))


def test_a_stalled_rank_restarts_the_ranks_in_the_allocation_which_resume_and_complete(tmp_path):
    job_id, run_dir = submit_job(*JOB, cwd=tmp_path)
    # Stop a rank once step 10's save has committed (an async save commits only when every rank
    # has written it, which a loaded machine can push past the next steps).
    poll(lambda: logged_steps(run_dir) >= 12 and max(committed_steps(run_dir / "checkpoints"), default=0) >= 10, "step 12, and step 10 committed")
    committed = max(committed_steps(run_dir / "checkpoints"))
    victim = json.loads(heartbeat_file(run_dir / "heartbeats", 1).read_text())
    os.kill(victim["pid"], signal.SIGSTOP)  # rank 1 on the second node stops dead
    try:
        poll(lambda: restarted_in_allocation(run_dir), "the watchdog to end the step and the ranks to start again", timeout_s=90)
    finally:
        try:
            os.kill(victim["pid"], signal.SIGCONT)  # Slurm kills it; do not leave it stopped if not
        except ProcessLookupError:
            pass
    assert wait_until_done(job_id) == "COMPLETED"
    assert restarts(job_id) == 0  # never requeued
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "completed" and result["resumed_from"] >= committed
    # Whichever rank's watchdog fires first logs the verdict; srun may end the others first.
    log = "".join(path.read_text() for path in sorted((run_dir / "logs").glob("rank-*.log")))
    assert f"rank 1 on {victim['host']} (pid {victim['pid']}) silent for" in log, log[-3000:]
    assert "resumed from checkpoint step" in log
    # The rank whose watchdog fired exits with 70 (EX_SOFTWARE), and srun says so in the batch
    # script's stderr.
    batch_err = "".join(path.read_text() for path in (run_dir / "slurm").glob("*/*_0_log.err"))
    assert re.search(r"srun: error: \S+: tasks? [0-9,-]+: Exited with exit code 70$", batch_err, re.M), batch_err[-3000:]
