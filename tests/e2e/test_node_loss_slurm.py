"""Lose a node of a running 2-node job on the real Slurm: its slurmd, steps and ranks are SIGKILLed
at once (scripts/slurm-sim.sh kill-node), as when a node loses power. Slurm must notice, end and
requeue the job, which then resumes from its last committed checkpoint on the nodes that are left;
the lost node returns to service afterwards."""

from __future__ import annotations

import json

import pytest

from benchmarks.simcluster import lose_nodes, newest_committed_step, node_state, poll
from hpc.slurm.slurmctl import job_fields
from tests.conftest import wait_until_done
from tests.support.runs import logged_steps, submit_job

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("needs_slurm")]

JOB = (
    "cluster=simulated",
    "resources.nodes=2",
    # One rank per node: what these tests prove needs two nodes, not two ranks on each (each rank
    # start costs seconds of CPU on the 2-core test machine; tests/e2e/test_slurm.py runs 2 x 2).
    "resources.tasks_per_node=1",
    "model.hidden_sizes=[1024,1024]",
    "trainer.epochs=5",  # 110 steps: the nodes lost after step 8 go well before the end (both jobs start within seconds)
    "checkpoint.every_steps=2",
    "checkpoint.every_minutes=null",
)


# Two jobs fill the four nodes and lose a node each at the same moment, so Slurm's detection
# (SlurmdTimeout, most of the time) is waited for once. The other node: the batch script and
# rank 0 survive it, so this is the case where the job's own failure requeue (the EXIT trap) and
# Slurm's node-failure requeue meet. The batch host: the script, its trap and rank 0 go with the
# node, and only Slurm can requeue the job.
def test_a_lost_node_requeues_the_job_which_resumes_on_the_remaining_nodes(tmp_path):
    cases = {"other-node": False, "batch-host": True}
    jobs = {}
    for case in cases:
        (tmp_path / case).mkdir()
        jobs[case] = submit_job(*JOB, cwd=tmp_path / case)
    committed_before, first_batch_host = {}, {}
    for case, (_, run_dir) in jobs.items():
        poll(lambda run_dir=run_dir: logged_steps(run_dir) >= 8 and newest_committed_step(run_dir) >= 4, f"{case}: step 8 and a committed checkpoint", 180)
    for case, (job_id, run_dir) in jobs.items():
        committed_before[case] = newest_committed_step(run_dir)
        first_batch_host[case] = job_fields(job_id)["BatchHost"]

    losses = dict(zip(cases, lose_nodes([(jobs[case][0], batch_host) for case, batch_host in cases.items()]), strict=True))
    for case, loss in losses.items():
        assert loss.lost not in loss.second_nodes and len(loss.second_nodes) == 2, loss
        assert (loss.lost == first_batch_host[case]) == cases[case]
        assert node_state(loss.lost) in ("idle", "mixed", "allocated")  # returned to service

    for case, (job_id, run_dir) in jobs.items():
        assert wait_until_done(job_id) == "COMPLETED", case
        result = json.loads((run_dir / "result.json").read_text())
        assert result["status"] == "completed" and result["restarts"] >= 1, (case, result)
        # Nothing lost beyond the checkpoint interval: it resumed from the newest checkpoint
        # committed before the node went, or a later one had a save been under way.
        assert result["resumed_from"] >= committed_before[case], (case, result["resumed_from"], committed_before[case])
        rank0 = (run_dir / "logs" / "rank-00000.log").read_text()
        assert f"resumed from checkpoint step {result['resumed_from']}" in rank0, case
