"""The one reader of the launcher environment: where am I in the job, which scheduler's job is it?

Every OMPI_*, PMIX_* and torchrun variable the toolkit reads is read here; a scheduler's own
variables (Slurm's SLURM_*) are read by its plugin's environment (hpc.schedulers; Slurm's:
hpc.slurm.environment), which this module asks. The names of the variables the toolkit itself
exports to its ranks are declared here. The standard library and the plugins' registry only:
the login node, the batch script and every rank import it.

Launchers describe a rank in different variables. In order of precedence (the innermost
launcher wins: mpirun inside an sbatch allocation is described by OMPI_*, not SLURM_PROCID):
torchrun (RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK), Open MPI's mpirun (OMPI_COMM_WORLD_*),
a task the scheduler's own launcher started (srun's), PMIx (PMIX_RANK), else a single process.
"""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from hpc.schedulers import built_in_first, loaded, plugins

# Exported by the toolkit to its ranks (hpc.launching), read on the rank (hpc.rank).
TTY_VARIABLE = "HPCTK_TTY"  # N > 0: launch.py runs in a terminal N columns wide (rank 0 draws a progress bar)
# Set by hpc.launching.ranks: after a clean stop the ranks exit 0 and it returns result.json's code.
RESULT_EXIT_VARIABLE = "HPCTK_RESULT_EXIT"
REQUEST_DIR_VARIABLE = "HPCTK_REQUEUE_DIR"  # where rank 0 asks the batch script's EXIT trap to requeue
# The batch script's step supervisor (hpc.slurm.supervise): how many restarts in one allocation,
# how many nodes a step needs (the rest are spares), and which attempt a step is (exported to the ranks).
ALLOCATION_RESTARTS_VARIABLE = "HPCTK_ALLOCATION_RESTARTS"
STEP_NODES_VARIABLE = "HPCTK_STEP_NODES"
STEP_ATTEMPT_VARIABLE = "HPCTK_STEP_ATTEMPT"
# 1 (the default): the ranks are forked from a warm process per node (hpc.rank.warm); 0: each starts its own interpreter.
WARM_RANKS_VARIABLE = "HPCTK_WARM_RANKS"
WARM_VARIABLE = "HPCTK_WARM"  # the job's token: a rank's task is handed to its node's warm process (hpc.rank.warm)
WARM_GPUS_VARIABLE = "HPCTK_WARM_GPUS"  # the GPUs each node's warm step asks (its forks open their task's, in its cgroup)
WARM_ADDRESS_VARIABLE = "HPCTK_WARM_ADDRESS"  # a local run's warm process (hpc.launching.ranks): its socket, named, since no job names it
WARM_DIR_VARIABLE = "HPCTK_WARM_DIR"  # where the batch script's warm steps say how they are (hpc.slurm.warmnodes)
# What the warm process imports for this job beyond a rank's own modules (launch.py's warm_imports:
# the real torch._dynamo where the ranks need it, the frameworks the job's script imports, found by
# hpc.config.scripts.frameworks_imported); hpc.rank.warm imports those in WARM_FRAMEWORKS alone.
WARM_IMPORTS_VARIABLE = "HPCTK_WARM_IMPORTS"
# What the warm process imports where a script's import names it or a module below it: installed
# frameworks that start no thread and touch no GPU when imported (a fork keeps what they built),
# never a user's own module. Lightning costs a rank 3.5 CPU-s to import, Hugging Face's Trainer 2.3.
WARM_FRAMEWORKS = (
    "torch._dynamo",  # the real one, for a job that compiles or syncs through torch.distributed (else a stand-in: hpc.rank.dynamo)
    "pytorch_lightning",
    "lightning",
    "lightning_fabric",
    "transformers",
    "transformers.trainer",  # also for `from transformers import Trainer` (the lazy module's heaviest part)
    "hpc.lightning",
    "hpc.hf",
)
BATCH_STARTED_VARIABLE = "HPCTK_BATCH_STARTED"  # the batch script's first line's clock: when this start of the job began
RUN_DIR_VARIABLE = "HPCTK_RUN_DIR"  # hpc.slurm.prepare -> the hand-typed sbatch script
# A node's directory for the newest checkpoint's copies in memory (hpc.rank.warm -> its forks;
# trainers.checkpoint.memory reads it by this name, which it cannot import from here).
MEMORY_VARIABLE = "HPCTK_MEMORY_CHECKPOINTS"
MEMORY_BASE = Path("/dev/shm")  # the node's tmpfs
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
    launcher: str  # torchrun | mpirun | the scheduler plugin's name for its own tasks (slurm) | pmix | single

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
        elif (task := scheduler_task(env)) is not None:
            info = task
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


class SchedulerEnvironment(Protocol):
    """How a scheduler's job describes itself to the processes in it: a scheduler plugin's
    `environment` (hpc.schedulers). Every method reads `env` only, and answers for this
    scheduler's jobs (a process outside one gets None, 0 or an empty answer)."""

    def job_id(self, env: Mapping[str, str]) -> str | None:
        """The scheduler's id of the job this process runs in (an array task's own); None
        outside one of its jobs."""
        ...

    def task(self, env: Mapping[str, str]) -> RankInfo | None:
        """The rank of a task the scheduler's own launcher started (srun's); None for any other
        process of the job (the batch script, mpirun's or torchrun's ranks inside it)."""
        ...

    def task_place(self, env: Mapping[str, str]) -> tuple[str, str] | None:
        """(rank, node) of such a task as its step supervisor names them, read before anything
        else of the rank (hpc.liveness); None outside one."""
        ...

    def hosts(self, env: Mapping[str, str]) -> tuple[str, ...]:
        """The nodes of the job's step (of the job outside a step), in order."""
        ...

    def restart_count(self, env: Mapping[str, str]) -> int:
        """How often the scheduler has restarted (requeued) this job."""
        ...

    def cpus_per_task(self, env: Mapping[str, str]) -> int | None:
        """The CPUs the scheduler gave each task; None where the job did not say."""
        ...

    def rendezvous(self, env: Mapping[str, str]) -> tuple[str, int] | None:
        """(address, port) of torch.distributed's store, derived from the job; None where it
        cannot be (ports: PORT_BASE up, PORT_SPAN wide)."""
        ...


def scheduler_environments() -> Iterator[tuple[str, SchedulerEnvironment]]:
    """(name, environment) of every scheduler plugin, the built-in ones first: the installed
    packages are looked up (a scan of site-packages) only where no built-in one answered."""
    yield from ((name, loaded(name, "environment")) for name in built_in_first())
    yield from ((name, loaded(name, "environment")) for name in plugins() if name not in built_in_first())


def scheduler_named(env: Mapping[str, str]) -> tuple[str, SchedulerEnvironment] | None:
    """(plugin name, environment) of the scheduler whose job `env` is in (the first plugin that
    claims it); None outside any scheduler's job."""
    return next(((name, found) for name, found in scheduler_environments() if found.job_id(env) is not None), None)


def scheduler_environment(env: Mapping[str, str]) -> SchedulerEnvironment | None:
    """The environment of the scheduler whose job `env` is in; None outside any scheduler's job."""
    named = scheduler_named(env)
    return named[1] if named is not None else None


def scheduler_task(env: Mapping[str, str]) -> RankInfo | None:
    """The rank of a task a scheduler's own launcher started (srun's), as its plugin reads it."""
    return next((task for _, found in scheduler_environments() if (task := found.task(env)) is not None), None)


def int_variable(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    value = env.get(key)
    if value is None:
        if default is None:
            raise RankEnvError(f"{key} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise RankEnvError(f"{key}={value!r} is not an integer") from None


def _from_ompi(env: Mapping[str, str], hostname: str) -> RankInfo:
    rank = int_variable(env, "OMPI_COMM_WORLD_RANK")
    local_world = int_variable(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1)
    world = int_variable(env, "OMPI_COMM_WORLD_SIZE")
    num_nodes = max(1, -(-world // local_world))
    # mpirun gives no node index; with the block mapping it uses by default it is rank // ppn.
    node_rank = min(rank // local_world, num_nodes - 1)
    return RankInfo(
        rank=rank,
        local_rank=int_variable(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0),
        world_size=world,
        local_world_size=local_world,
        node_rank=node_rank,
        num_nodes=num_nodes,
        hosts=(job_hosts(env) if num_nodes > 1 else ()) or (hostname,) * num_nodes,
        launcher="mpirun",
    )


def _from_torchrun(env: Mapping[str, str], hostname: str) -> RankInfo:
    world = int_variable(env, "WORLD_SIZE")
    local_world = int_variable(env, "LOCAL_WORLD_SIZE", world)
    num_nodes = max(1, -(-world // local_world))
    return RankInfo(
        rank=int_variable(env, "RANK"),
        local_rank=int_variable(env, "LOCAL_RANK"),
        world_size=world,
        local_world_size=local_world,
        node_rank=int_variable(env, "GROUP_RANK", int_variable(env, "RANK") // local_world),
        num_nodes=num_nodes,
        hosts=job_hosts(env) or (hostname,) * num_nodes,
        launcher="torchrun",
    )


def _from_pmix(env: Mapping[str, str], hostname: str) -> RankInfo:
    world = int_variable(env, "PMIX_SIZE")
    return RankInfo(
        rank=int_variable(env, "PMIX_RANK"),
        local_rank=int_variable(env, "PMIX_LOCAL_RANK", 0),
        world_size=world,
        local_world_size=int_variable(env, "PMIX_LOCAL_SIZE", world),
        node_rank=int_variable(env, "PMIX_NODE_RANK", 0),
        num_nodes=int_variable(env, "PMIX_NUM_NODES", 1),
        hosts=(hostname,),
        launcher="pmix",
    )


def batch_started(env: Mapping[str, str]) -> float | None:
    """When this start of the job's batch script began (bash's $EPOCHREALTIME, exported by its
    first line); None where no toolkit script set it. Finer than Slurm's StartTime (whole seconds)."""
    value = env.get(BATCH_STARTED_VARIABLE, "").replace(",", ".")  # the locale's decimal point
    try:
        return float(value) if value else None
    except ValueError:
        return None


def job_id(env: Mapping[str, str]) -> str | None:
    """The id its scheduler knows this job by (an array task's own); None outside a scheduler's job."""
    scheduler = scheduler_environment(env)
    return scheduler.job_id(env) if scheduler is not None else None


def job_hosts(env: Mapping[str, str]) -> tuple[str, ...]:
    """The nodes of the scheduler's job (its step's where in one); empty outside a scheduler's job."""
    scheduler = scheduler_environment(env)
    return scheduler.hosts(env) if scheduler is not None else ()


def restart_count(env: Mapping[str, str]) -> int:
    """How often the scheduler has restarted (requeued) this job; 0 outside a scheduler's job."""
    scheduler = scheduler_environment(env)
    return scheduler.restart_count(env) if scheduler is not None else 0


def cpus_per_task(env: Mapping[str, str]) -> int | None:
    """The CPUs the scheduler gave each task of this step; None where it was not said."""
    scheduler = scheduler_environment(env)
    return scheduler.cpus_per_task(env) if scheduler is not None else None


def task_place(env: Mapping[str, str]) -> tuple[str, str]:
    """(rank, node) of a task its scheduler's launcher started, as its step supervisor names them;
    ("?", this host's name) elsewhere. Read before anything else of the rank (hpc.liveness), so no RankInfo."""
    scheduler = scheduler_environment(env)
    place = scheduler.task_place(env) if scheduler is not None else None
    return place or ("?", socket.gethostname())


def checkpoint_memory(job: str, node: str | None = None, base: Path = MEMORY_BASE) -> Path:
    """The node-memory directory of a job's checkpoint copies, one per node under it (every
    node of a simulated cluster shares one machine's tmpfs): named for the user, the job, the node."""

    def safe(name: str) -> str:
        return "".join(c if c.isalnum() or c in "-_." else "_" for c in name).lstrip(".") or "_"

    job_dir = base / f"hpctk-{os.getuid()}" / safe(job)
    return job_dir / safe(node) if node is not None else job_dir


def private_dir(path: Path) -> bool:
    """A directory of this user's alone: not a link, owned by us, no access for others. A name in
    a tmpfs every user writes to (/dev/shm) is taken only when it is, never followed otherwise."""
    try:
        found = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(found.st_mode) and found.st_uid == os.getuid() and found.st_mode & 0o077 == 0


def rendezvous(env: Mapping[str, str]) -> tuple[str, int] | None:
    """(address, port) of torch.distributed's store: MASTER_ADDR/PORT where the launcher set
    them, else the scheduler's, derived from its job; None without either."""
    if "MASTER_ADDR" in env and "MASTER_PORT" in env:
        return env["MASTER_ADDR"], int_variable(env, "MASTER_PORT")
    scheduler = scheduler_environment(env)
    return scheduler.rendezvous(env) if scheduler is not None else None
