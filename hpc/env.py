"""The one reader of the launcher environment: where am I in the job, which Slurm job is it?

Every SLURM_*, OMPI_*, PMIX_* and torchrun variable the toolkit reads is read here, and the
names of the variables the toolkit itself exports to its ranks are declared here. Standard
library and python-hostlist only: the login node, the batch script and every rank import it.

Launchers describe a rank in different variables. In order of precedence (the innermost
launcher wins: mpirun inside an sbatch allocation is described by OMPI_*, not SLURM_PROCID):
torchrun (RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK), Open MPI's mpirun (OMPI_COMM_WORLD_*),
a Slurm job step (SLURM_PROCID inside srun), PMIx (PMIX_RANK), else a single process.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass

import hostlist

# Exported by the toolkit to its ranks (hpc.launching), read on the rank (hpc.rank).
TTY_VARIABLE = "HPCTK_TTY"  # N > 0: launch.py runs in a terminal N columns wide (rank 0 draws a progress bar)
# Set by hpc.launching.ranks: after a clean stop the ranks exit 0 and it returns result.json's code.
RESULT_EXIT_VARIABLE = "HPCTK_RESULT_EXIT"
REQUEST_DIR_VARIABLE = "HPCTK_REQUEUE_DIR"  # where rank 0 asks the batch script's EXIT trap to requeue
# The batch script's step supervisor (hpc.launching.supervise): how many restarts in one allocation,
# how many nodes a step needs (the rest are spares), and which attempt a step is (exported to the ranks).
ALLOCATION_RESTARTS_VARIABLE = "HPCTK_ALLOCATION_RESTARTS"
STEP_NODES_VARIABLE = "HPCTK_STEP_NODES"
STEP_ATTEMPT_VARIABLE = "HPCTK_STEP_ATTEMPT"
# 1 (the default): the ranks are forked from a warm process per node (hpc.rank.warm); 0: each starts its own interpreter.
WARM_RANKS_VARIABLE = "HPCTK_WARM_RANKS"
WARM_VARIABLE = "HPCTK_WARM"  # the job's token: a rank's task is handed to its node's warm process (hpc.rank.warm)
WARM_GPUS_VARIABLE = "HPCTK_WARM_GPUS"  # the GPUs each node's warm step asks (its forks open their task's, in its cgroup)
WARM_ADDRESS_VARIABLE = "HPCTK_WARM_ADDRESS"  # a local run's warm process (hpc.launching.ranks): its socket, named, since no job names it
WARM_DIR_VARIABLE = "HPCTK_WARM_DIR"  # where the batch script's warm steps say how they are (hpc.launching.warmnodes)
BATCH_STARTED_VARIABLE = "HPCTK_BATCH_STARTED"  # the batch script's first line's clock: when this start of the job began
RUN_DIR_VARIABLE = "HPCTK_RUN_DIR"  # hpc.launching.prepare -> the hand-typed sbatch script
# torch.distributed store ports derived from a Slurm job id (and a local run's, drawn): below Linux's
# ephemeral range (32768 up), which a listener bound to 0 (mpirun's own, Open MPI's) or any outgoing
# connection may hold
PORT_BASE, PORT_SPAN = 20000, 12000


class RankEnvError(ValueError):
    """The environment describes an impossible rank layout."""


@dataclass(frozen=True)
class RankInfo:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    hosts: tuple[str, ...]
    launcher: str  # torchrun | mpirun | slurm | pmix | single

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, env: Mapping[str, str], hostname: str | None = None) -> RankInfo:
        hostname = hostname or socket.gethostname()
        if "TORCHELASTIC_RUN_ID" in env or {"RANK", "LOCAL_RANK", "WORLD_SIZE"} <= env.keys():
            info = _from_torchrun(env, hostname)
        elif "OMPI_COMM_WORLD_RANK" in env:
            info = _from_ompi(env, hostname)
        elif "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
            info = _from_slurm(env)
        elif "PMIX_RANK" in env and "PMIX_SIZE" in env:
            info = _from_pmix(env, hostname)
        else:
            info = cls(0, 0, 1, 1, 0, 1, (hostname,), "single")
        info.check()
        return info

    def check(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise RankEnvError(f"rank {self.rank} outside world of size {self.world_size}")
        if not 0 <= self.local_rank < self.local_world_size:
            raise RankEnvError(f"local_rank {self.local_rank} outside {self.local_world_size} local ranks")
        if not 0 <= self.node_rank < self.num_nodes:
            raise RankEnvError(f"node_rank {self.node_rank} outside {self.num_nodes} nodes")

    @property
    def host(self) -> str:
        return self.hosts[self.node_rank] if self.node_rank < len(self.hosts) else self.hosts[0]


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    value = env.get(key)
    if value is None:
        if default is None:
            raise RankEnvError(f"{key} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise RankEnvError(f"{key}={value!r} is not an integer") from None


def slurm_hosts(env: Mapping[str, str]) -> tuple[str, ...]:
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    return tuple(hostlist.expand_hostlist(nodelist)) if nodelist else ()


def slurm_task(env: Mapping[str, str]) -> tuple[str, str]:
    """(rank, node) of a task srun started, as its step supervisor names them; read before
    anything else of the rank (hpc.liveness), so no RankInfo."""
    return env.get("SLURM_PROCID", "?"), env.get("SLURMD_NODENAME") or socket.gethostname()


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


def _from_slurm(env: Mapping[str, str]) -> RankInfo:
    node_rank = _int(env, "SLURM_NODEID")
    hosts = slurm_hosts(env)
    num_nodes = _int(env, "SLURM_STEP_NUM_NODES", _int(env, "SLURM_NNODES", max(len(hosts), 1)))
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    local_world = _tasks_per_node(per_node)[node_rank] if per_node else 1
    world = _int(env, "SLURM_STEP_NUM_TASKS", _int(env, "SLURM_NTASKS", 1))
    hosts = hosts or (env.get("SLURMD_NODENAME", "localhost"),)
    return RankInfo(
        rank=_int(env, "SLURM_PROCID"),
        local_rank=_int(env, "SLURM_LOCALID"),
        world_size=world,
        local_world_size=local_world,
        node_rank=node_rank,
        num_nodes=num_nodes,
        hosts=hosts,
        launcher="slurm",
    )


def _from_ompi(env: Mapping[str, str], hostname: str) -> RankInfo:
    rank = _int(env, "OMPI_COMM_WORLD_RANK")
    local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1)
    world = _int(env, "OMPI_COMM_WORLD_SIZE")
    num_nodes = max(1, -(-world // local_world))
    # mpirun gives no node index; with the block mapping it uses by default it is rank // ppn.
    node_rank = min(rank // local_world, num_nodes - 1)
    return RankInfo(
        rank=rank,
        local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0),
        world_size=world,
        local_world_size=local_world,
        node_rank=node_rank,
        num_nodes=num_nodes,
        hosts=(slurm_hosts(env) if num_nodes > 1 else ()) or (hostname,) * num_nodes,
        launcher="mpirun",
    )


def _from_torchrun(env: Mapping[str, str], hostname: str) -> RankInfo:
    world = _int(env, "WORLD_SIZE")
    local_world = _int(env, "LOCAL_WORLD_SIZE", world)
    num_nodes = max(1, -(-world // local_world))
    return RankInfo(
        rank=_int(env, "RANK"),
        local_rank=_int(env, "LOCAL_RANK"),
        world_size=world,
        local_world_size=local_world,
        node_rank=_int(env, "GROUP_RANK", _int(env, "RANK") // local_world),
        num_nodes=num_nodes,
        hosts=slurm_hosts(env) or (hostname,) * num_nodes,
        launcher="torchrun",
    )


def _from_pmix(env: Mapping[str, str], hostname: str) -> RankInfo:
    world = _int(env, "PMIX_SIZE")
    return RankInfo(
        rank=_int(env, "PMIX_RANK"),
        local_rank=_int(env, "PMIX_LOCAL_RANK", 0),
        world_size=world,
        local_world_size=_int(env, "PMIX_LOCAL_SIZE", world),
        node_rank=_int(env, "PMIX_NODE_RANK", 0),
        num_nodes=_int(env, "PMIX_NUM_NODES", 1),
        hosts=(hostname,),
        launcher="pmix",
    )


def slurm_job_id(env: Mapping[str, str]) -> str | None:
    """The id `scontrol` knows this job by: <array job id>_<task id> for array tasks."""
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID")


def cpus_per_task(env: Mapping[str, str]) -> int | None:
    """Slurm's --cpus-per-task for this step's tasks; None where it was not given."""
    value = env.get("SLURM_CPUS_PER_TASK", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def restart_count(env: Mapping[str, str]) -> int:
    """How often Slurm has restarted (requeued) this job; 0 outside Slurm (or set empty)."""
    return _int(env, "SLURM_RESTART_COUNT", 0) if env.get("SLURM_RESTART_COUNT") else 0


def allocation_shape(env: Mapping[str, str]) -> tuple[int, int] | None:
    """(nodes, tasks per node) of the batch job, from sbatch's environment; None outside an
    allocation. Raises RankEnvError when the nodes hold different numbers of tasks."""
    if "SLURM_JOB_NUM_NODES" not in env:
        return None
    nodes = _int(env, "SLURM_JOB_NUM_NODES")
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


def rendezvous(env: Mapping[str, str]) -> tuple[str, int] | None:
    """(address, port) of torch.distributed's store: MASTER_ADDR/PORT where the launcher set
    them, else the first node of the Slurm step (of the job outside a step: a spare node or a
    lost one is in the job's list, not the step's) and a port derived from the job id, its
    restart count and the step (two jobs on one node, two starts of one job, or a restart inside
    the allocation while the old step's ports linger, do not collide); None without either."""
    if "MASTER_ADDR" in env and "MASTER_PORT" in env:
        return env["MASTER_ADDR"], _int(env, "MASTER_PORT")
    nodes = env.get("SLURM_STEP_NODELIST") or job_node_list(env)
    job_id = env.get("SLURM_JOB_ID")
    if not nodes or not job_id or not job_id.isdigit():
        return None
    first = hostlist.expand_hostlist(nodes)[0]
    step = _int(env, "SLURM_STEP_ID", 0) if env.get("SLURM_STEP_ID", "").isdigit() else 0
    return first, PORT_BASE + (int(job_id) * 7 + restart_count(env) + step * 3) % PORT_SPAN


def batch_started(env: Mapping[str, str]) -> float | None:
    """When this start of the job's batch script began (bash's $EPOCHREALTIME, exported by its
    first line); None where no toolkit script set it. Finer than Slurm's StartTime (whole seconds)."""
    value = env.get(BATCH_STARTED_VARIABLE, "").replace(",", ".")  # the locale's decimal point
    try:
        return float(value) if value else None
    except ValueError:
        return None
