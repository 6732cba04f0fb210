"""Drive the simulated Slurm cluster (scripts/slurm-sim.sh) from Python: parse what launch.py
printed, poll Slurm, release a requeued job, lose a node and bring it back, end a process.

Shared by the benchmarks and the tests (tests import this module; it never imports tests)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hpc.slurmctl import hostnames, job_fields, job_state, node_states, start_now
from trainers.layout import committed_steps

SIM = str(Path(__file__).resolve().parents[1] / "scripts" / "slurm-sim.sh")
# slurmctld declares a silent node DOWN once it has not answered for SlurmdTimeout (60 s); it
# pings every 20 s, so this takes up to about 80 s.
DETECTION_S = 150


def parse_job_id(launch_stdout: str) -> str:
    """The job id in launch.py's `submitted job N ...` line (the first one of a sweep)."""
    found = re.search(r"submitted job (?:array )?(\d+)", launch_stdout)
    if found is None:
        raise ValueError(f"no 'submitted job N' line in: {launch_stdout[-300:]!r}")
    return found.group(1)


def poll(condition: Callable[[], bool], what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)  # Slurm and the step log give no event to wait on


def restarts(job_id: str) -> int:
    return int(job_fields(job_id).get("Restarts", -1))


def nodes_settled(except_node: str | None = None) -> bool:
    """Every node (but `except_node`, a lost one) is up and no step of an ended run is left."""
    states = [state for node, state in node_states("debug").items() if node != except_node]
    steps = subprocess.run(["pgrep", "-x", "slurmstepd"], capture_output=True, text=True).stdout.split()
    return bool(states) and all(state in ("idle", "mixed", "allocated") for state in states) and not steps


def release_when_requeued(job_id: str, restarts_before: int) -> None:
    """Slurm holds a requeued job back (BeginTime about 2 minutes on): start it now."""
    poll(lambda: restarts(job_id) > restarts_before, f"job {job_id} to be requeued")
    poll(lambda: job_state(job_id) == "PENDING", f"job {job_id} to pend again")
    # Starting it before every node finished cleaning up the killed run makes slurmd refuse the
    # launch ("already killed") and the job fails; Slurm's own hold exists to avoid exactly that.
    poll(nodes_settled, "nodes to finish the killed run")
    start_job_now(job_id)


def end_process(pid: int) -> None:
    """SIGCONT (it may be stopped) then SIGKILL; gone already is fine."""
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


@dataclass(frozen=True)
class NodeLoss:
    lost: str
    was_batch_host: bool
    second_nodes: list[str]
    requeued_s: float  # from the kill until Slurm counted a restart
    down_s: float  # from the kill until the node was DOWN


def start_job_now(job_id: str) -> None:
    error = start_now(job_id)
    if error:
        raise RuntimeError(f"scontrol update jobid={job_id} starttime=now: {error}")


def job_hosts(node_list: str) -> list[str]:
    """The nodes of a job's NodeList; an empty answer (scontrol failing) is an error here."""
    hosts = hostnames(node_list)
    if not hosts:
        raise RuntimeError(f"scontrol show hostnames {node_list} named no host")
    return hosts


def node_state(node: str) -> str:
    return node_states("debug", node).get(node, "")


def newest_committed_step(run_dir: Path) -> int:
    return max(committed_steps(run_dir / "checkpoints"), default=0)


def lose_a_node(job_id: str, batch_host: bool) -> NodeLoss:
    """SIGKILL everything on one node of the running job (its batch host or another), wait until
    Slurm has requeued the job and marked the node DOWN, start the job again at once (Slurm
    would hold it about 2 minutes), check where it runs, and bring the node back."""
    fields = job_fields(job_id)
    lost = fields["BatchHost"] if batch_host else next(n for n in job_hosts(fields["NodeList"]) if n != fields["BatchHost"])
    killed_at = time.monotonic()
    subprocess.run([SIM, "kill-node", lost], check=True, capture_output=True)
    try:
        poll(lambda: restarts(job_id) >= 1, "the job to be requeued", DETECTION_S)
        requeued_s = time.monotonic() - killed_at
        poll(lambda: node_state(lost).startswith("down"), f"{lost} to be DOWN", DETECTION_S)
        down_s = time.monotonic() - killed_at
        poll(lambda: job_state(job_id) == "PENDING", "the job to pend again")
        poll(lambda: nodes_settled(except_node=lost), "the other nodes to finish the ended run")
        start_job_now(job_id)
        poll(lambda: job_state(job_id) == "RUNNING", "the job to run again")
        second_nodes = job_hosts(job_fields(job_id)["NodeList"])
    finally:
        subprocess.run([SIM, "revive-node", lost], check=True, capture_output=True)
    return NodeLoss(lost, batch_host, second_nodes, requeued_s, down_s)
