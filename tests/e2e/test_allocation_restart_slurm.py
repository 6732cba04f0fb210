"""Restarts inside the allocation on the real Slurm (hpc.slurm.supervise): a lost node with one
spare costs a new job step in the same allocation, not a requeue, the live node's rank keeps its
process (an in-process restart over Gloo), the spare's is a warm fork, and the checkpoint comes
back from the nodes' memory. The run completes with the same per-step losses and the same final
weights as an uninterrupted one. Killed ranks restarted in the
allocation: the resume verifier's Slurm test (tests/e2e/test_verify_slurm.py) kills them and
compares every tensor."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from benchmarks.simcluster import SIM, job_hosts, job_story, newest_committed_step, poll, restarts
from hpc.interruptions import TIMELINE, costs
from hpc.rundir import read_jsonl
from hpc.slurm.slurmctl import job_fields
from tests.conftest import wait_until_done
from tests.support.runs import fixtures_env, logged_steps, state_hash, step_losses, submit_job

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("needs_slurm")]

JOB = (
    "cluster=simulated",
    "resources.nodes=2",
    # One rank per node: what these tests prove needs two nodes, not two ranks on each (each rank
    # start costs seconds of CPU on the 2-core test machine; tests/e2e/test_slurm.py runs 2 x 2).
    "resources.tasks_per_node=1",
    "model.hidden_sizes=[1024,1024]",
    "trainer.epochs=3",  # 66 steps: the node or rank killed after step 6 dies well before the end
    "checkpoint.every_steps=2",
    "checkpoint.every_minutes=null",
    "cluster.failure_requeues=0",  # a requeue would end the job FAILED: only a restart in the allocation can save it
    # DDP over Gloo: a group the live node's rank forms again in its own process (hpc.rank.parking); the engine's
    # restarts in the allocation: the second test below, and tests/e2e/test_verify_slurm.py
    "comm=gloo",
)

REFERENCE_NODES = "node1,node2"  # sbatch --nodelist


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """The uninterrupted run, submitted, not waited for: it trains beside the test's job, on
    nodes the test never takes down (REFERENCE_NODES)."""
    return submit_job(*JOB, f"+cluster.sbatch.nodelist='{REFERENCE_NODES}'", cwd=tmp_path_factory.mktemp("reference"))


def step_records(run_dir: Path) -> list[dict[str, object]]:
    """The supervisor's record of each job step it launched (hpc.slurm.supervise)."""
    logs = list((run_dir / "slurm" / "requeue-requests").glob("*.steps.jsonl"))
    return [json.loads(line) for log in logs for line in log.read_text().splitlines()]


def assert_same_training(run_dir: Path, reference: tuple[str, Path]) -> None:
    reference_id, reference_dir = reference
    assert wait_until_done(reference_id) == "COMPLETED"
    assert step_losses(run_dir) == step_losses(reference_dir)
    assert state_hash(run_dir) == state_hash(reference_dir)


def assert_one_cost_logged(run_dir: Path, cause: str, because: str = "") -> dict[str, object]:
    """Rank 0 logged what the interruption cost, and the timeline keeps it (hpc.interruptions)."""
    rank0 = (run_dir / "logs" / "rank-00000.log").read_text()
    said = [line for line in rank0.splitlines() if "interruption cost: " in line]
    assert len(said) == 1 and f"interruption cost: failure ({cause}" in said[0] and because in said[0], said or rank0[-3000:]
    (cost,) = costs(read_jsonl(run_dir / TIMELINE))
    assert cost["how"] == "restart in the allocation" and cost["held_s"] is None
    # checkpoint.every_steps=2, saved asynchronously: one interval, and the save still in flight
    assert 0 < float(cost["total_s"]) < 300 and int(cost["redone_steps"]) <= 2 * 2
    return cost


def test_a_lost_node_is_replaced_by_the_spare_inside_the_allocation(tmp_path, reference):
    # node1 (the batch script's, never the lost one) and two the reference does not run on
    job_id, run_dir = submit_job(*JOB, "resources.spare_nodes=1", "+cluster.sbatch.nodelist='node1,node3,node4'", cwd=tmp_path)
    poll(lambda: logged_steps(run_dir) >= 6 and newest_committed_step(run_dir) >= 4, "step 6 and a committed checkpoint", 180)
    fields = job_fields(job_id)
    allocated = job_hosts(fields["NodeList"])
    assert len(allocated) == 3
    rank_hosts = {line.split(" on ")[1].split()[0] for line in (run_dir / "logs" / "rank-00001.log").read_text().splitlines() if "local_rank" in line}
    (lost,) = rank_hosts - {fields["BatchHost"]}  # a node of the step that is not the batch script's
    assert lost not in REFERENCE_NODES, (lost, fields["BatchHost"])
    subprocess.run([SIM, "kill-node", lost], check=True, capture_output=True)
    try:
        rank0 = run_dir / "logs" / "rank-00000.log"
        poll(lambda: "interruption cost: " in rank0.read_text(), "the ranks started again without the lost node to train a step", 180)
    finally:
        # Back once the job trains without it: until then (or until Slurm declares it DOWN, a
        # minute on) the job could not finish, as Slurm waits for every node of it to end it. Not
        # sooner: a node coming back while the new step's ranks wire up stalled them once
        # (the supervisor then restarted them again, which this test does not expect).
        subprocess.run([SIM, "revive-node", lost], check=True, capture_output=True)
    assert wait_until_done(job_id, timeout_s=300) == "COMPLETED"
    assert restarts(job_id) == 0  # never requeued: the spare took the lost node's place
    records = step_records(run_dir)
    assert len(records) == 2, f"{records}\n{job_story(job_id, lines=60)}"  # one restart, not two: CI keeps no run dir
    first, second = records
    assert first["hung"] and lost in first["lost_nodes"] and second["nodes_excluded"] == [lost]
    rank1 = (run_dir / "logs" / "rank-00001.log").read_text()
    restarted = [line for line in rank1.splitlines() if "restart 1 in this allocation" in line]
    assert restarted and f" on {lost} " not in restarted[0]  # the restarted ranks run on the other two nodes
    # both starts forked from their node's warm process (hpc.rank.warm): the spare's was ready before it was needed
    assert rank1.count("a fork of this node's warm process") == 2, rank1
    # the checkpoint read back from node memory (trainers.checkpoint.memory): rank 0's node kept
    # its pieces; the spare holds none, so rank 1's shared file comes from the store (a directory:
    # read, not sent), and its own file from rank 0's node where the commit's peer copy was made
    # before the kill, else from the store (the kill may land between a commit and its peer copy:
    # the peer path itself is tests/unit/test_memory_checkpoint.py's)
    said = re.search(r"read back from node memory where held: own file from (rank 0|store), shared file from store", rank1)
    assert said, rank1[-3000:]
    rank0 = (run_dir / "logs" / "rank-00000.log").read_text()
    assert "own file from memory, shared file from memory" in rank0
    # the live node's rank trained on in its own process (hpc.rank.parking): its collectives failed
    # with the lost peer, it waited for the step's end, and the next step's task took it, no fork
    assert "a collective failed, a peer is gone" in rank0 and rank0.count("a fork of this node's warm process") == 1, rank0[-3000:]
    assert "an in-process restart: this process trained the last step too" in rank0
    assert_same_training(run_dir, reference)
    # seen by its ranks' closed connections (or srun's word of their tasks killed) and its slurmd's
    # silence (hpc.liveness), not a heartbeat's
    assert_one_cost_logged(run_dir, f"node {lost} lost (", because="its slurmd does not answer)")


def test_a_python_error_that_need_not_repeat_restarts_inside_the_allocation(tmp_path):
    """An I/O error (EIO) on one rank is a failure like a killed rank (hpc.rank.failures): a new
    step in the allocation, not the end of the job (a missing data file does end it:
    test_kill_on_slurm.test_a_python_error_is_not_requeued)."""
    marker = tmp_path / "failed-once"
    job_id, run_dir = submit_job(
        "cluster=simulated",
        "resources.tasks_per_node=2",
        "task._target_=mytasks.flaky.Flaky",
        f"+task.marker={marker}",
        "trainer.epochs=2",
        "checkpoint.every_steps=2",
        "checkpoint.every_minutes=null",
        "cluster.failure_requeues=0",
        cwd=tmp_path,
        env=fixtures_env(),
    )
    assert wait_until_done(job_id) == "COMPLETED"
    assert marker.exists() and restarts(job_id) == 0  # it failed once, and was never requeued
    first, second = step_records(run_dir)
    assert first["decision"] == "restart" and second["attempt"] == 1
    log = (run_dir / "logs" / "rank-00001.log").read_text()
    assert "OSError need not repeat: counted as a failure, like a lost rank" in log and "will not be requeued" not in log
    assert json.loads((run_dir / "result.json").read_text())["finished"] is True
