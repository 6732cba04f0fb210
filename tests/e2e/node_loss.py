"""Lose a simulated node under a running job and see it through: Slurm notices, ends and requeues
the job, the job runs again on other nodes, the node returns. Shared by the node-loss test and
`benchmarks/reliability.py --only node-loss`, which reports the timings."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from hpc.requeue import job_fields
from hpc.rundir import RunDir
from hpc.slurm import job_state
from hpc.status import newest_checkpoint
from tests.e2e.test_preemption import nodes_settled, poll, restarts

SIM = str(Path(__file__).resolve().parents[2] / "scripts" / "slurm-sim.sh")
# slurmctld declares a silent node DOWN once it has not answered for SlurmdTimeout (60 s); it
# pings every 20 s, so this takes up to about 80 s.
DETECTION_S = 150


@dataclass(frozen=True)
class NodeLoss:
    lost: str
    was_batch_host: bool
    second_nodes: list[str]
    requeued_s: float  # from the kill until Slurm counted a restart
    down_s: float  # from the kill until the node was DOWN


def hostnames(node_list: str) -> list[str]:
    return subprocess.run(["scontrol", "show", "hostnames", node_list], capture_output=True, text=True, check=True).stdout.split()


def node_state(node: str) -> str:
    return subprocess.run(["sinfo", "-h", "-N", "-n", node, "-p", "debug", "-o", "%T"], capture_output=True, text=True).stdout.strip()


def newest_committed_step(run_dir: Path) -> int:
    return newest_checkpoint(RunDir(run_dir)) or 0


def lose_a_node(job_id: str, batch_host: bool) -> NodeLoss:
    """SIGKILL everything on one node of the running job (its batch host or another), wait until
    Slurm has requeued the job and marked the node DOWN, start the job again at once (Slurm
    would hold it about 2 minutes), check where it runs, and bring the node back."""
    fields = job_fields(job_id)
    lost = fields["BatchHost"] if batch_host else next(n for n in hostnames(fields["NodeList"]) if n != fields["BatchHost"])
    killed_at = time.monotonic()
    subprocess.run([SIM, "kill-node", lost], check=True, capture_output=True)
    try:
        poll(lambda: restarts(job_id) >= 1, "the job to be requeued", DETECTION_S)
        requeued_s = time.monotonic() - killed_at
        poll(lambda: node_state(lost).startswith("down"), f"{lost} to be DOWN", DETECTION_S)
        down_s = time.monotonic() - killed_at
        poll(lambda: job_state(job_id) == "PENDING", "the job to pend again")
        poll(lambda: nodes_settled(except_node=lost), "the other nodes to finish the ended run")
        subprocess.run(["scontrol", "update", f"jobid={job_id}", "starttime=now"], check=True, capture_output=True)
        poll(lambda: job_state(job_id) == "RUNNING", "the job to run again")
        second_nodes = hostnames(job_fields(job_id)["NodeList"])
    finally:
        subprocess.run([SIM, "revive-node", lost], check=True, capture_output=True)
    return NodeLoss(lost, batch_host, second_nodes, requeued_s, down_s)
