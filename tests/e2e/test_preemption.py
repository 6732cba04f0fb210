"""Preempt a 2-node job on the real (simulated) Slurm at different steps and in different ways,
and compare it with an uninterrupted run: same per-step losses, same model."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess

import pytest

from benchmarks.simcluster import job_story, nodes_settled, poll, release_when_requeued, restarts
from hpc.interruptions import TIMELINE, costs
from hpc.rundir import read_jsonl
from hpc.slurm.slurmctl import job_state
from hpc.tools.status import statuses
from tests.conftest import wait_until_done
from tests.support.runs import catches, fixtures_env, logged_steps, pending, rank_pids, state_hash, step_losses, submit_job
from tests.support.trackers import one_tracker_run_each
from trainers.checkpoint.checkpointer import Checkpointer

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("needs_slurm")]

JOB = (
    "cluster=simulated",
    "resources.nodes=2",
    # One rank per node: what these tests prove needs two nodes, not two ranks on each (each rank
    # start costs seconds of CPU on the 2-core test machine; tests/e2e/test_slurm.py runs 2 x 2).
    "resources.tasks_per_node=1",
    "model.hidden_sizes=[512,512]",
    "trainer.epochs=8",  # 176 steps: four stops, each landing up to tens of steps after its signal, come before the end
    "checkpoint.every_steps=5",
    "checkpoint.every_minutes=null",
    # Fewer failure requeues than preemptions, and none inside the allocation: the rank killed
    # after the preemptions must still be requeued (preemptions use none of the failure budget).
    "cluster.failure_requeues=2",
    "cluster.allocation_restarts=0",
)

# The same for a user's task from a package outside the toolkit (tests/fixtures/mytasks, found on
# PYTHONPATH at submission and frozen into the run dir; the ranks import that copy), with the
# optimizer state and gradients sharded over the ranks.
USER_JOB = (
    *JOB[:3],
    "task._target_=mytasks.regression.Regression",
    "+task.hidden=512",
    "+task.samples=8192",
    "data.batch_size=128",
    "optim=adamw",
    "comm.sharding=gradients",  # ZeRO-2: each rank saves its part of the optimizer state, resumed from its own file
    "trainer.epochs=5",  # 160 steps: the rank death after two preemptions comes before the end
    *JOB[5:7],
    "cluster.failure_requeues=1",  # fewer than the preemptions, as above
    JOB[8],
)


def steps_in_this_start(run_dir, steps: int, job_id: str) -> None:
    """Wait until the ranks started last (the ones running now) have logged `steps` steps; a
    timeout tells the job's story (a rank that died in Open MPI's start-up: docs/reliability.md)."""
    before = logged_steps(run_dir)
    poll(lambda: logged_steps(run_dir) >= before + steps, f"{steps} more steps", details=lambda: job_story(job_id))


# A user's task only: the built-in one takes the same stop, save, requeue and resume path (its
# signal stops run under mpirun in tests/mpi/test_resume.py, a real preemption of it below),
# and a second 130 s run here proved nothing the first does not.
def test_two_preemptions_and_a_rank_death_end_bit_identical_to_an_uninterrupted_run(tmp_path):
    job, env = USER_JOB, fixtures_env()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    # The uninterrupted run beside the interrupted one: the four nodes hold both
    reference_id, ref_dir = submit_job(*job, cwd=tmp_path / "a", env=env)
    # The interrupted run reports to MLflow and W&B (offline): one tracker run each, at the end
    tracked = {**env, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db", "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)}
    job_id, run_dir = submit_job(*job, "trackers=[mlflow,wandb]", cwd=tmp_path / "b", env=tracked)

    # (steps into the current start, then what interrupts it): counted from the lines logged when
    # the start began, as the stop before may land several steps after its signal was sent.
    interruptions = [
        (9, ["scancel", "--signal=USR1", job_id]),  # what preempt_send_user_signal delivers
        (8, ["scontrol", "requeue", job_id]),  # Slurm requeues: SIGTERM to every rank
    ]
    for count, (steps_in, command) in enumerate(interruptions):
        steps_in_this_start(run_dir, steps_in, job_id)
        subprocess.run(command, check=True, capture_output=True)
        release_when_requeued(job_id, count)
    steps_in_this_start(run_dir, 7, job_id)
    os.kill(rank_pids(run_dir)[-1], signal.SIGKILL)  # after 2 preemptions, with failure_requeues=1
    release_when_requeued(job_id, 2)

    assert wait_until_done(job_id) == "COMPLETED" and wait_until_done(reference_id) == "COMPLETED"
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "completed" and result["restarts"] == 3 and result["resumed_from"] > 0
    (failures,) = (run_dir / "slurm" / "requeue-requests").glob("*.failures")
    assert failures.read_text().strip() == "1"  # the kill; the preemptions counted none
    assert step_losses(run_dir) == step_losses(ref_dir)
    assert state_hash(run_dir) == state_hash(ref_dir)
    assert (run_dir / "code" / "mytasks" / "regression.py").is_file()  # the ranks' copy
    rank0 = (run_dir / "logs" / "rank-00000.log").read_text()
    assert rank0.count("resumed from checkpoint step") == 3  # one run dir, logs appended
    assert "external signal: requeueing job" in rank0 and "requeue in progress: Slurm requeues job" in rank0
    assert all(f"restart {n}" in rank0 for n in (1, 2, 3))
    # What each interruption cost, end to end (hpc.interruptions): rank 0 logs it, status totals it.
    found = costs(read_jsonl(run_dir / TIMELINE))
    assert rank0.count("interruption cost: ") == len(found) == 3, rank0[-3000:]
    assert [c["cause"].split()[0] for c in found] == ["SIGUSR1", "SIGTERM", "failure"]
    assert all(c["how"] == "requeue" for c in found)
    # Slurm's hold and queue wait, apart, where the EXIT trap requeued (not after `scontrol requeue` from outside)
    assert [c["held_s"] is not None and c["queued_s"] is not None for c in found] == [True, False, True]
    assert all(c["to_commit_s"] is not None and c["redone_steps"] == 0 for c in found[:2])  # a stop saves where it stops
    # checkpoint.every_steps=5, plus up to 5 more when the kill lands while the newest async save
    # is still being written (seen in CI: killed at step 51 with step 50 uncommitted, 6 redone)
    assert found[2]["redone_steps"] <= 10
    (status,) = statuses(run_dir)
    assert status.interrupted.startswith("3 interruptions: ") and status.interrupted in status.line()
    with pytest.MonkeyPatch.context() as env_of_the_test:
        env_of_the_test.setenv("MLFLOW_TRACKING_URI", tracked["MLFLOW_TRACKING_URI"])
        one_tracker_run_each(tmp_path, run_dir, steps=result["steps"], starts=4)


def test_real_preemption_by_a_higher_priority_partition_checkpoints_and_requeues(tmp_path):
    """A job in 'high' needing every node preempts ours: USR1 reaches every rank
    (preempt_send_user_signal), they checkpoint, the job requeues, and later resumes."""
    # 25 epochs (550 steps, 8-15 s): with 88 steps the job once finished in the second Slurm took
    # to preempt it.
    job_id, run_dir = submit_job(*JOB[:4], "trainer.epochs=25", *JOB[5:], cwd=tmp_path)
    poll(lambda: logged_steps(run_dir) >= 8, "step 8")
    preemptor = subprocess.run(
        ["sbatch", "--parsable", "-p", "high", "-N", "4", "--exclusive", "-o", "/dev/null", "--wrap", "true"], capture_output=True, text=True, check=True
    ).stdout.strip()

    def completed() -> bool:  # result.json is also written by a stop, with status "stopped"
        return (run_dir / "result.json").exists() and json.loads((run_dir / "result.json").read_text())["status"] == "completed"

    poll(lambda: restarts(job_id) >= 1 or completed(), f"job {job_id} to be requeued by its ranks")
    assert restarts(job_id) >= 1, f"the job completed at step {logged_steps(run_dir)} before Slurm preempted it"
    assert wait_until_done(preemptor) == "COMPLETED"  # the preemptor got the nodes
    release_when_requeued(job_id, 0)
    assert wait_until_done(job_id) == "COMPLETED"
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "completed" and result["restarts"] == 1 and result["resumed_from"] >= 8, f"{result}\n{job_story(job_id, lines=60)}"
    assert "preemption: requeueing job" in (run_dir / "logs" / "rank-00000.log").read_text()


def test_an_approaching_time_limit_is_told_apart_from_preemption_and_requeues(tmp_path):
    """A 2-minute job with --signal=USR1@110: Slurm signals it 10-40 s in (its time-limit check
    runs periodically); the ranks save, and from the job's EndTime the log says 'time limit'.
    (With 1 minute and @50, a loaded machine left the stop too little time before the limit.)"""
    job_id, run_dir = submit_job(
        "cluster=simulated",
        "resources.nodes=1",
        "resources.time_min=2",
        "cluster.signal_seconds=110",
        "trainer.epochs=1000",
        "checkpoint.every_steps=0",
        cwd=tmp_path,
    )
    try:
        poll(lambda: restarts(job_id) >= 1 or job_state(job_id) == "RUNNING", f"job {job_id} to start", timeout_s=300)  # the queue may be busy
        poll(lambda: restarts(job_id) >= 1, f"job {job_id} to requeue itself before its time limit", timeout_s=150)
        log = (run_dir / "logs" / "rank-00000.log").read_text()
        assert "time limit: requeueing job" in log, log[-2000:]
        # Slurm's time-limit check runs periodically: the signal may even come during start-up,
        # and then the ranks stop before their first step with nothing to save.
        newest = Checkpointer(run_dir / "checkpoints", 0, 2, keep=3).load_latest()
        if "nothing trained yet, nothing to save" in log:  # either way the checkpoints say what the log says
            assert newest is None and "checkpoint committed" not in log
        else:
            assert "checkpoint committed" in log and newest is not None
    finally:
        subprocess.run(["scancel", job_id], check=False)
        poll(nodes_settled, "nodes to settle after the test")


def test_a_preemption_during_start_up_stops_before_the_first_step_requeues_and_completes(tmp_path):
    """USR1 while the ranks still import Python and torch: before hpc.rank.main's first statement they would die
    of it (its default action), and the batch script would count a failure. Now each rank
    catches it from its first instruction, they agree to stop before the first step, save
    nothing, and the job requeues as a preemption and completes."""
    job_id, run_dir = submit_job(*JOB[:3], "trainer.epochs=2", cwd=tmp_path)

    def ranks_ready() -> bool:
        pids = rank_pids(run_dir)
        return len(pids) == 2 and all(catches(pid, signal.SIGUSR1) for pid in pids)

    poll(ranks_ready, "every rank to catch the stop signals")
    ranks = rank_pids(run_dir)
    assert len(ranks) == 2, ranks
    # Held still while Slurm's signal travels (slurmctld, slurmd, slurmstepd: seconds on a loaded
    # machine), so that it lands in the imports however slow the way: a stopped rank keeps it
    # pending until SIGCONT. Sent again if it has not reached every rank in 10 s: scancel's exit
    # status says only that slurmctld took the request, not that the ranks got it.
    try:
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
        assert logged_steps(run_dir) == 0  # still starting up: no step yet
        for _ in range(6):
            subprocess.run(["scancel", "--signal=USR1", job_id], check=True, capture_output=True)
            with contextlib.suppress(TimeoutError):
                poll(lambda: all(pending(pid, signal.SIGUSR1) for pid in ranks), "USR1 to reach every rank", timeout_s=10)
                break
        assert all(pending(pid, signal.SIGUSR1) for pid in ranks), "Slurm delivered no USR1 to the ranks in 60 s"
    finally:
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    release_when_requeued(job_id, 0)
    assert wait_until_done(job_id) == "COMPLETED"
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "completed" and result["restarts"] == 1 and result["resumed_from"] is None  # nothing was saved before
    rank0 = (run_dir / "logs" / "rank-00000.log").read_text()
    assert "stopped by SIGUSR1 (received during start-up" in rank0 and "at step 0, nothing trained yet, nothing to save" in rank0, rank0[-3000:]
    assert not list((run_dir / "slurm" / "requeue-requests").glob("*.failures"))  # a preemption, not a failure
