"""Drive the simulated Slurm cluster (scripts/slurm-sim.sh) from Python: parse what launch.py
printed, poll Slurm, release a requeued job, lose a node and bring it back, end a process.

Shared by the benchmarks and the tests (tests import this module; it never imports tests)."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from hpc.slurm.slurmctl import hostnames, job_fields, job_state, node_states, start_now
from trainers.checkpoint.layout import committed_steps

SIM = str(Path(__file__).resolve().parents[1] / "scripts" / "slurm-sim.sh")
# slurmctld declares a silent node DOWN once it has not answered for SlurmdTimeout (30 s on the
# simulator, scripts/slurm-sim.sh); it pings every 10 s, so this takes up to about 40 s.
DETECTION_S = 120


def parse_job_id(launch_stdout: str) -> str:
    """The job id in launch.py's `submitted job N ...` line (the first one of a sweep)."""
    found = re.search(r"submitted job (?:array )?(\d+)", launch_stdout)
    if found is None:
        raise ValueError(f"no 'submitted job N' line in: {launch_stdout[-300:]!r}")
    return found.group(1)


def poll(condition: Callable[[], bool], what: str, timeout_s: float = 120, details: Callable[[], str] | None = None) -> None:
    """Wait until `condition` holds; `details` adds what was seen at the timeout to its message."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out waiting for {what}" + (f": {details()}" if details else ""))
        # Slurm and the step log give no event to wait on. Each look costs a process and an RPC
        # (scontrol, squeue, pgrep: 7-30 ms of CPU): every 0.25 s keeps that a few % of a core.
        time.sleep(0.25)


def restarts(job_id: str) -> int:
    return int(job_fields(job_id).get("Restarts", -1))


def nodes_settled(except_nodes: Iterable[str] = (), job_id: str | None = None) -> bool:
    """Every node (but `except_nodes`, lost ones) is up and no step of an ended run is left: of
    any job, or with `job_id` of that job only (other jobs may go on running beside it)."""
    lost = set(except_nodes)
    states = [state for node, state in node_states("debug").items() if node not in lost]
    steps = subprocess.run(["pgrep", "-a", "-x", "slurmstepd"], capture_output=True, text=True).stdout.splitlines()
    if job_id is not None:  # slurmstepd's title names its step: "slurmstepd: [JOBID.batch]", "[JOBID.0]"
        own = job_fields(job_id).get("JobId", job_id)
        steps = [line for line in steps if f"[{own}." in line]
    return bool(states) and all(state in ("idle", "mixed", "allocated") for state in states) and not steps


def release_when_requeued(job_id: str, restarts_before: int, except_nodes: Iterable[str] = ()) -> None:
    """Slurm holds a job requeued by scontrol back (BeginTime about 2 minutes on): start it now.
    A job Slurm requeued itself after a node failure has no such hold and may start on its own
    (its state goes COMPLETING, PENDING, RUNNING in moments): that is fine too. `except_nodes`:
    lost nodes, which are not waited for."""
    poll(lambda: restarts(job_id) > restarts_before, f"job {job_id} to be requeued", details=lambda: job_story(job_id))
    poll(lambda: job_state(job_id) in ("PENDING", "RUNNING"), f"job {job_id} to pend again", details=lambda: job_summary(job_id))
    # Starting it before its nodes finished cleaning up the killed run makes slurmd refuse the
    # launch ("already killed") and the job fails; Slurm's own hold exists to avoid exactly that.
    poll(
        lambda: job_state(job_id) != "PENDING" or nodes_settled(except_nodes, job_id=job_id),
        f"job {job_id}'s nodes to finish the killed run",
        details=lambda: job_summary(job_id),
    )
    if job_state(job_id) != "PENDING":
        return  # Slurm started it
    # slurmd also revoked the job's credential when the run was killed, and refuses a credential
    # issued in the same second ("Job credential revoked": Slurm compares whole seconds): start
    # it once the clock is past that second.
    after = math.floor(time.time()) + 2
    poll(lambda: time.time() >= after, "the second of the killed run's revocation to pass")
    start_job_now(job_id)


def job_summary(job_id: str) -> str:
    """The fields that say why a job is not running: for a timeout's message."""
    fields = job_fields(job_id)
    return " ".join(f"{key}={fields.get(key, '?')}" for key in ("JobState", "Reason", "Restarts", "BeginTime", "ExitCode", "NodeList"))


def job_story(job_id: str, lines: int = 25) -> str:
    """job_summary and the last `lines` lines of the job's own output and error files (the batch
    script's, the step supervisor's and srun's words, rank 0's console): what a timeout shows
    of a run that went wrong where the test cannot look any more (CI keeps no run dir)."""
    fields = job_fields(job_id)
    told = [job_summary(job_id)]
    for key in ("StdErr", "StdOut"):
        try:
            tail = Path(fields[key]).read_text(errors="replace").splitlines()[-lines:]
        except (KeyError, OSError):
            continue
        told.append(f"{key} {fields[key]}:\n" + "\n".join(tail))
    return "\n".join(told)


def wait_for_resume(job_id: str, resumed: Callable[[], bool], released_at: int, timeout_s: float = 120) -> None:
    """Wait until a released job's run has `resumed`. A signal can requeue the job again before
    that (a kill Slurm still had queued for the ended run reaching the new one): each such
    requeue is released too rather than left to Slurm's 2-minute hold."""
    deadline = time.monotonic() + timeout_s
    while not resumed():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out waiting for job {job_id} to resume: {job_summary(job_id)}")
        now = restarts(job_id)
        if now > released_at and job_state(job_id) == "PENDING":
            release_when_requeued(job_id, released_at)
            released_at = now
        time.sleep(0.25)  # as in poll: no event to wait on


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
    """Lift a pending job's hold; one Slurm started meanwhile ("no longer pending") is fine."""
    error = start_now(job_id)
    if error and job_state(job_id) == "PENDING":
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
    Slurm has requeued the job and marked the node DOWN, start the job again at once (unless
    Slurm already has), check where it runs, and bring the node back."""
    (loss,) = lose_nodes([(job_id, batch_host)])
    return loss


def lose_nodes(jobs: list[tuple[str, bool]]) -> list[NodeLoss]:
    """lose_a_node for several running jobs at once, one node each: the nodes die together, so
    Slurm's detection (the slow part) is waited for once. The jobs start again as the nodes left
    allow; the lost nodes come back once every job runs again."""
    lost_nodes = []
    for job_id, batch_host in jobs:
        fields = job_fields(job_id)
        lost_nodes.append(fields["BatchHost"] if batch_host else next(n for n in job_hosts(fields["NodeList"]) if n != fields["BatchHost"]))
    killed_at = time.monotonic()
    try:
        for lost in lost_nodes:
            subprocess.run([SIM, "kill-node", lost], check=True, capture_output=True)
        requeued_s, down_s = [], []
        for (job_id, _), lost in zip(jobs, lost_nodes, strict=True):
            poll(lambda job_id=job_id: restarts(job_id) >= 1, f"job {job_id} to be requeued", DETECTION_S)
            requeued_s.append(time.monotonic() - killed_at)
            poll(lambda lost=lost: node_state(lost).startswith("down"), f"{lost} to be DOWN", DETECTION_S)
            down_s.append(time.monotonic() - killed_at)
        second_nodes = []
        for job_id, _ in jobs:  # each as soon as the nodes left have room
            release_when_requeued(job_id, 0, except_nodes=lost_nodes)
            poll(lambda job_id=job_id: job_state(job_id) != "PENDING", f"job {job_id} to run again", 300, details=lambda job_id=job_id: job_summary(job_id))
            second_nodes.append(job_hosts(job_fields(job_id)["NodeList"]))
    finally:
        for lost in lost_nodes:
            subprocess.run([SIM, "revive-node", lost], check=True, capture_output=True)
    return [
        NodeLoss(lost, batch_host, nodes, requeued, down)
        for (_, batch_host), lost, nodes, requeued, down in zip(jobs, lost_nodes, second_nodes, requeued_s, down_s, strict=True)
    ]
