"""Typed configs owned by hpc/, and the root config that ties every group together.

Registered in Hydra's ConfigStore by hpc.config.compose.register_schemas (called once by
launch.py), so an override of a key that no dataclass declares fails at compose time. This
module needs no Hydra: ranks read their config.yaml through `to_job_config` (OmegaConf only).
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collectives.backends import resolve_backend
from collectives.config import CommConfig
from hpc.config.launchers import launcher_names
from hpc.errors import UserError
from hpc.fabric.topology import TopologyConfig, parse_topology_conf
from trainers.config import (
    CLASSIFY_TASK,
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    TrainerConfig,
)

CONTAINER_RUNTIMES = ("pyxis", "apptainer")  # cluster.container_runtime (hpc.slurm.batch.container_launch)
ACCESS_UMASKS = {"private": 0o077, "group": 0o027}  # run_access -> umask; "umask": unchanged
RUN_ACCESS = (*ACCESS_UMASKS, "umask")
STOP_SIGNALS = ("USR1", "USR2", "TERM", "INT")  # cluster.signal: the ones the ranks handle


@dataclass
class ClusterConfig:
    name: str = "local"
    launcher: str = "local"  # local: mpirun on this machine; slurm: sbatch through submitit
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    cpus_per_node: int | None = None  # None: no limit checked (local: oversubscribe)
    gpus_per_node: int = 0
    max_nodes: int | None = None
    time_min: int = 60  # default wall-clock limit of a job
    mem_gb: float | None = None
    # --kill-on-bad-exit: a rank that dies ends the step, instead of the others waiting forever.
    srun_args: list[str] = field(default_factory=lambda: ["--mpi=pmix", "--kill-on-bad-exit=1"])
    mpirun_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # exported on every rank
    requeue: bool = True  # sbatch --requeue: a preempted or stopped job goes back to the queue
    # A job whose rank died (killed, OOM, a lost node) requeues itself at most this many times.
    failure_requeues: int = 3
    # A rank that dies or stalls first restarts the ranks inside the allocation (no queue wait),
    # at most this many times per start of the job (hpc.slurm.supervise); 0: requeue at once.
    allocation_restarts: int = 3
    # The ranks forked from one warm process per node that has torch and the toolkit imported (hpc.rank.warm):
    # a restart in the allocation costs a fork, not an interpreter's start; a local run imports torch once, not
    # once per rank. false: every rank starts its own.
    warm_ranks: bool = True
    # With warm ranks and comm=gloo/nccl, a rank whose step ends after a peer's death keeps its process (its
    # imports, its CUDA context) for the next step of the allocation (hpc.rank.parking). false: a fork each time.
    in_process_restart: bool = True
    signal: str = "USR1"  # sbatch --signal=<signal>@<signal_seconds>, sent to every rank
    signal_seconds: int = 120  # before the time limit; enough to finish a step and save
    setup: list[str] = field(default_factory=list)  # shell lines run in sbatch before srun
    # Any other sbatch option: long name -> value (true: a flag), e.g. +cluster.sbatch.mail-type=END,
    # cluster.sbatch.exclusive=true; those the toolkit sets are refused naming their setting (hpc.slurm.options, through the plugin's launcher).
    sbatch: dict[str, Any] = field(default_factory=dict)
    # The ranks in a container image (docs/running-jobs.md): through pyxis (srun --container-image,
    # an image such as nvcr.io#nvidia/pytorch:24.05-py3) or apptainer (`apptainer exec IMAGE`, a
    # .sif file or docker://...). Only the ranks: the batch script, its requeue and EXIT trap, and
    # the step supervisor stay on the host. container_mounts: more host paths the ranks read
    # (data), as SRC[:DST]; the run dir is always mounted at its own path.
    container: str | None = None
    container_runtime: str = "pyxis"  # pyxis | apptainer
    container_mounts: list[str] = field(default_factory=list)
    # sbatch --switches=<switches>@<switches_wait_min>: wait up to that long for an allocation
    # on at most this many leaf switches (`python -m hpc.topology place` suggests the count).
    switches: int | None = None
    switches_wait_min: int = 10
    # Slurm's topology.conf as seen on the compute nodes: rings follow the switch tree (ring
    # neighbours share a leaf switch). None: rings follow the allocation's node order.
    topology_conf: str | None = None

    def check(self) -> None:
        """The cluster section's own settings, each alone; against the job's resources: hpc.config.validate."""
        if self.launcher not in launcher_names():
            raise UserError(f"cluster.launcher={self.launcher!r} is not one of {', '.join(launcher_names())}")
        if self.failure_requeues < 0:
            raise UserError(f"cluster.failure_requeues={self.failure_requeues} must be >= 0 (0: a failed job is not requeued)")
        if self.allocation_restarts < 0:
            raise UserError(f"cluster.allocation_restarts={self.allocation_restarts} must be >= 0 (0: a failed step requeues the job at once)")
        if self.signal not in STOP_SIGNALS:
            raise UserError(f"cluster.signal={self.signal!r}: use USR1, USR2, TERM or INT (the ranks handle those)")
        if self.signal_seconds < 1:
            raise UserError(f"cluster.signal_seconds={self.signal_seconds} must be >= 1")
        if self.switches_wait_min < 0:
            raise UserError(f"cluster.switches_wait_min={self.switches_wait_min} must be >= 0")
        if self.topology_conf is not None:
            try:
                parse_topology_conf(Path(self.topology_conf).read_text())
            except OSError as err:
                raise UserError(f"cluster.topology_conf={self.topology_conf}: {err.strerror}") from None


@dataclass
class ResourcesConfig:
    nodes: int = 1
    tasks_per_node: int = 2
    cpus_per_task: int = 1
    gpus_per_task: int = 0
    time_min: int | None = None  # None: the cluster's default
    # Extra nodes allocated beside `nodes` (sbatch --no-kill): a lost or failing node is replaced
    # by a spare inside the allocation, in seconds, instead of a requeue and a queue wait.
    spare_nodes: int = 0

    def check(self) -> None:
        """The resources asked, each alone; against the cluster's nodes: hpc.config.validate."""
        for key in ("nodes", "tasks_per_node", "cpus_per_task"):
            if getattr(self, key) < 1:
                raise UserError(f"resources.{key}={getattr(self, key)} must be >= 1")
        for key in ("spare_nodes", "gpus_per_task"):
            if getattr(self, key) < 0:
                raise UserError(f"resources.{key}={getattr(self, key)} must be >= 0")


@dataclass
class SweepConfig:
    """How `launch.py -m` submits: one Slurm job array per distinct sbatch script."""

    max_parallel: int | None = None  # at most this many array tasks run at once (--array=0-N%max_parallel)
    # What each trial of a search (hydra/sweeper=optuna ...) returns: loss, samples_per_s, val_accuracy,
    # val_<metric> (hpc/objective.py). The basic sweeper's grid needs none.
    objective: str | None = None

    def check(self) -> None:
        if self.max_parallel is not None and self.max_parallel < 1:
            raise UserError(f"sweep.max_parallel={self.max_parallel} must be >= 1 (or null: no limit)")


VERIFY_MODES = ("resume",)


@dataclass
class VerifyConfig:
    """`verify=resume`: instead of one run, the resume verifier (hpc/verify): the job run
    uninterrupted, then stopped at `stops` random steps and killed after a periodic save, each
    time resumed, and compared bit for bit."""

    mode: str | None = None  # resume (set by verify=resume); null: run the job
    steps: int | None = 120  # the built-in loop's length (trainer.max_steps); null: the job's own. A script's arguments decide its own
    stops: int = 2  # stops by a real signal, at random steps
    kill: bool = True  # and once SIGKILL after a periodic save
    every_steps: int | None = None  # the periodic save (checkpoint.every_steps); null: the job's, else about steps / 6 (10 for a script)
    seed: int | None = None  # where the stops land; null: drawn, and printed

    def check(self) -> None:
        if self.mode is not None and self.mode not in VERIFY_MODES:
            raise UserError(f"verify.mode={self.mode!r} is not one of {', '.join(VERIFY_MODES)} (verify=resume)")
        if self.steps is not None and self.steps < 4:
            raise UserError(f"verify.steps={self.steps} must be >= 4 (or null: the job's own length)")
        if self.stops < 0:
            raise UserError(f"verify.stops={self.stops} must be >= 0")
        if self.every_steps is not None and self.every_steps < 1:
            raise UserError(f"verify.every_steps={self.every_steps} must be >= 1 (or null)")


@dataclass
class JobConfig:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # The task trained (trainers/task.py): `_target_` names its class, the other keys are its
    # constructor's arguments (any keys: the user's class declares them, checked on the rank).
    task: dict[str, Any] = field(default_factory=lambda: {"_target_": CLASSIFY_TASK})
    # Your own training script instead of a task (hpc/config/scripts.py): a file (train.py), a
    # module run as `python -m` would (pkg.train) or a function (pkg.train:main), started on
    # every rank with torchrun's environment. script_args: its own arguments, as typed after
    # `--` on launch.py's command line; workdir: the ranks' working directory (None: where
    # launch.py ran, pinned at launch).
    script: str | None = None
    script_args: list[str] = field(default_factory=list)
    workdir: str | None = None
    name: str = "train"
    # Where rank 0's figures go beyond steps.jsonl and the terminal (trainers/reporting/trackers.py):
    # tensorboard, prometheus, mlflow, wandb; each configured by its library's own variables.
    trackers: list[str] = field(default_factory=list)
    run_root: str = "runs"  # run directories go under here (relative: to the launch dir)
    dry_run: bool = False  # print the resolved config and the sbatch script, submit nothing
    wait: bool = False  # slurm: block until the job ends, streaming rank 0's log
    hold: bool = False  # slurm: submit held (sbatch --hold); `scontrol release JOB` starts it
    # slurm: start only once these jobs ended COMPLETED (after: sbatch --dependency=afterok) or
    # ended at all (after_any: afterany); a job id, or several: after=[123,124] or after="123,124".
    after: Any = None
    after_any: Any = None
    # Who may read run dirs and checkpoints: private (0700/0600), group (0750/0640), or umask
    # (leave the caller's umask alone).
    run_access: str = "private"
    sweep: SweepConfig = field(default_factory=lambda: SweepConfig())
    verify: VerifyConfig = field(default_factory=lambda: VerifyConfig())


def task_target(job: JobConfig) -> str:
    """The task's class as `package.module.Class` ("" when the config names none)."""
    return str(job.task.get("_target_", ""))


def code_targets(job: JobConfig) -> list[str]:
    """Every class the config names by `_target_`: the task, a custom optimizer and scheduler
    (their packages are frozen with the job when they are the user's own)."""
    custom = [str(spec["_target_"]) for spec in (job.optim.optimizer, job.optim.scheduler) if spec.get("_target_")]
    return [task_target(job), *custom]


def apply_run_access(run_access: str) -> None:
    """Set this process's umask for run_access; everything it and its children create (run
    dirs, configs, logs, checkpoints) gets no more access than that."""
    if run_access in ACCESS_UMASKS:
        os.umask(ACCESS_UMASKS[run_access])


def unknown_key(cfg: Any, schema: type = JobConfig, prefix: str = "") -> tuple[str, str, list[str]] | None:
    """The first key of `cfg` (a mapping) that `schema` does not declare, as (dotted key, dotted
    parent, the parent's valid keys); None when all are declared. Hydra lets `+key=value` and
    `++key=value` add keys to a typed node, and OmegaConf.to_object then drops them silently."""
    if not dataclasses.is_dataclass(schema) or not isinstance(cfg, Mapping):
        return None
    names = [f.name for f in dataclasses.fields(schema)]
    hints = typing.get_type_hints(schema)
    for key in cfg.keys():
        dotted = f"{prefix}{key}"
        if key not in names:
            return dotted, prefix.rstrip("."), names
        found = unknown_key(cfg[key], hints[str(key)], f"{dotted}.")
        if found is not None:
            return found
    return None


def unknown_key_message(key: str, parent: str, names: list[str]) -> str:
    where = f"'{parent}'" if parent else "the root config"
    return f"unknown key '{key}'; valid keys in {where}: {', '.join(names)}"


def to_job_config(cfg: Any) -> JobConfig:
    """Resolved DictConfig (or plain mapping) -> typed JobConfig, validated by OmegaConf, its
    backend made concrete. Raises UserError naming a key no schema declares."""
    return with_backend(typed_job(cfg))


def typed_job(cfg: Any) -> JobConfig:
    """to_job_config with comm=auto left as it is (the login path decides the resources first)."""
    from omegaconf import DictConfig, OmegaConf

    found = unknown_key(cfg)
    if found is not None:
        raise UserError(unknown_key_message(*found))
    typed = isinstance(cfg, DictConfig) and OmegaConf.get_type(cfg) is JobConfig  # composed with the schema: validated already
    job = OmegaConf.to_object(cfg if typed else OmegaConf.merge(OmegaConf.structured(JobConfig), cfg))
    assert isinstance(job, JobConfig)
    return job


def with_backend(job: JobConfig) -> JobConfig:
    """comm=auto made concrete from the job's resources: config.yaml names the backend the ranks run."""
    return dataclasses.replace(job, comm=resolve_backend(job.comm, job.resources.gpus_per_task))
