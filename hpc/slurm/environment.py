"""Slurm's environment, as the processes of a Slurm job see it: the Slurm plugin's rank side
(hpc.schedulers; asked through hpc.env). Every SLURM_* variable the toolkit reads is read here.
The standard library, python-hostlist and hpc.env only: the batch script and every rank import it.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping

import hostlist

from hpc.env import PORT_BASE, PORT_SPAN, RankEnvError, RankInfo, int_variable


def slurm_job_id(env: Mapping[str, str]) -> str | None:
    """The id `scontrol` knows this job by: <array job id>_<task id> for array tasks."""
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID")


def slurm_hosts(env: Mapping[str, str]) -> tuple[str, ...]:
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    return tuple(hostlist.expand_hostlist(nodelist)) if nodelist else ()


def restart_count(env: Mapping[str, str]) -> int:
    """How often Slurm has restarted (requeued) this job; 0 outside Slurm (or set empty)."""
    return int_variable(env, "SLURM_RESTART_COUNT", 0) if env.get("SLURM_RESTART_COUNT") else 0


def _tasks_per_node(text: str) -> list[int]:
    """SLURM_TASKS_PER_NODE looks like '2(x3),1': the count of every node, in node order."""
    expanded: list[int] = []
    try:
        for part in text.split(","):
            count, _, repeat = part.partition("(x")
            expanded += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    except ValueError:
        raise RankEnvError(f"tasks per node {text!r} is not Slurm's N(xM),... form") from None
    return expanded


def allocation_shape(env: Mapping[str, str]) -> tuple[int, int] | None:
    """(nodes, tasks per node) of the batch job, from sbatch's environment; None outside an
    allocation. Raises RankEnvError when the nodes hold different numbers of tasks."""
    if "SLURM_JOB_NUM_NODES" not in env:
        return None
    nodes = int_variable(env, "SLURM_JOB_NUM_NODES")
    per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not per_node:
        raise RankEnvError("SLURM_TASKS_PER_NODE is not set")
    counts = set(_tasks_per_node(per_node))
    if len(counts) != 1:
        raise RankEnvError(f"sbatch granted different task counts per node ({per_node}); ask for --ntasks-per-node")
    return nodes, counts.pop()


def job_cpus_per_node(env: Mapping[str, str]) -> int | None:
    """The fewest CPUs the job holds on any of its nodes (SLURM_JOB_CPUS_PER_NODE, '4(x2),2');
    None outside an allocation or where Slurm's value cannot be read."""
    try:
        counts = _tasks_per_node(env.get("SLURM_JOB_CPUS_PER_NODE", "")) if env.get("SLURM_JOB_CPUS_PER_NODE") else []
    except RankEnvError:
        return None
    return min(counts) if counts else None


def job_node_list(env: Mapping[str, str]) -> str:
    """The Slurm job's (allocation's) nodes as a hostlist ("node[1-3]"); empty outside Slurm."""
    return env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""


class SlurmEnvironment:
    """hpc.env.SchedulerEnvironment for Slurm: sbatch's and srun's variables."""

    def job_id(self, env: Mapping[str, str]) -> str | None:
        return slurm_job_id(env)

    def task(self, env: Mapping[str, str]) -> RankInfo | None:
        if "SLURM_STEP_ID" not in env or "SLURM_PROCID" not in env:
            return None  # the batch script, or a rank mpirun or torchrun started inside the job
        node_rank = int_variable(env, "SLURM_NODEID")
        hosts = slurm_hosts(env)
        num_nodes = int_variable(env, "SLURM_STEP_NUM_NODES", int_variable(env, "SLURM_NNODES", max(len(hosts), 1)))
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        local_world = _tasks_per_node(per_node)[node_rank] if per_node else 1
        world = int_variable(env, "SLURM_STEP_NUM_TASKS", int_variable(env, "SLURM_NTASKS", 1))
        return RankInfo(
            rank=int_variable(env, "SLURM_PROCID"),
            local_rank=int_variable(env, "SLURM_LOCALID"),
            world_size=world,
            local_world_size=local_world,
            node_rank=node_rank,
            num_nodes=num_nodes,
            hosts=hosts or (env.get("SLURMD_NODENAME", "localhost"),),
            launcher="slurm",
        )

    def task_place(self, env: Mapping[str, str]) -> tuple[str, str] | None:
        return env.get("SLURM_PROCID", "?"), env.get("SLURMD_NODENAME") or socket.gethostname()

    def hosts(self, env: Mapping[str, str]) -> tuple[str, ...]:
        return slurm_hosts(env)

    def restart_count(self, env: Mapping[str, str]) -> int:
        return restart_count(env)

    def cpus_per_task(self, env: Mapping[str, str]) -> int | None:
        """Slurm's --cpus-per-task for this step's tasks; None where it was not given."""
        value = env.get("SLURM_CPUS_PER_TASK", "")
        return int(value) if value.isdigit() and int(value) > 0 else None

    def rendezvous(self, env: Mapping[str, str]) -> tuple[str, int] | None:
        """The first node of the Slurm step (of the job outside a step: a spare node or a lost one
        is in the job's list, not the step's) and a port derived from the job id, its restart count
        and the step (two jobs on one node, two starts of one job, or a restart inside the
        allocation while the old step's ports linger, do not collide)."""
        nodes = env.get("SLURM_STEP_NODELIST") or job_node_list(env)
        job_id = env.get("SLURM_JOB_ID")
        if not nodes or not job_id or not job_id.isdigit():
            return None
        first = hostlist.expand_hostlist(nodes)[0]
        step = int_variable(env, "SLURM_STEP_ID", 0) if env.get("SLURM_STEP_ID", "").isdigit() else 0
        return first, PORT_BASE + (int(job_id) * 7 + restart_count(env) + step * 3) % PORT_SPAN


SLURM = SlurmEnvironment()
