"""Lose a node of a running 2-node job on the real Slurm: its slurmd, steps and ranks are SIGKILLed
at once (scripts/slurm-sim.sh kill-node), as when a node loses power. Slurm must notice, end and
requeue the job, which then resumes from its last committed checkpoint on the nodes that are left;
the lost node returns to service afterwards."""

from __future__ import annotations

import json

import pytest

from benchmarks.simcluster import lose_a_node, newest_committed_step, node_state, poll
from hpc.slurmctl import job_fields
from tests.conftest import wait_until_done
from tests.support.runs import logged_steps, submit_job

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("needs_slurm")]

JOB = (
    "cluster=simulated",
    "resources.nodes=2",
    "resources.tasks_per_node=2",
    "model.hidden_sizes=[1024,1024]",
    "trainer.epochs=8",  # 88 steps: the node lost after step 6 goes well before the end
    "checkpoint.every_steps=2",
    "checkpoint.every_minutes=null",
)


# The other node: the batch script and rank 0 survive it, so this is the case where the job's own
# failure requeue (the EXIT trap) and Slurm's node-failure requeue meet. The batch host: the
# script, its trap and rank 0 go with the node, and only Slurm can requeue the job.
@pytest.mark.parametrize("batch_host", [False, True], ids=["other-node", "batch-host"])
def test_a_lost_node_requeues_the_job_which_resumes_on_the_remaining_nodes(tmp_path, batch_host):
    job_id, run_dir = submit_job(*JOB, cwd=tmp_path)
    poll(lambda: logged_steps(run_dir) >= 8 and newest_committed_step(run_dir) >= 4, "step 8 and a committed checkpoint")
    committed_before = newest_committed_step(run_dir)
    first_batch_host = job_fields(job_id)["BatchHost"]

    loss = lose_a_node(job_id, batch_host=batch_host)
    assert loss.lost not in loss.second_nodes and len(loss.second_nodes) == 2, loss
    assert (loss.lost == first_batch_host) == batch_host
    assert node_state(loss.lost) in ("idle", "mixed", "allocated")  # returned to service

    assert wait_until_done(job_id) == "COMPLETED"
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "completed" and result["restarts"] >= 1
    # Nothing lost beyond the checkpoint interval: it resumed from the newest checkpoint
    # committed before the node went, or a later one had a save been under way.
    assert result["resumed_from"] >= committed_before, (result["resumed_from"], committed_before)
    rank0 = (run_dir / "logs" / "rank-00000.log").read_text()
    assert f"resumed from checkpoint step {result['resumed_from']}" in rank0
