"""The backends, one entry each: what a backend is allowed and how it starts and syncs gradients.

Every rule about a backend lives in its entry (issue 47): the login node's checks
(hpc.config.validate), the rank's start (collectives.init_collectives) and its gradient sync
(collectives.gradsync.build_gradient_sync) read it. Adding a backend is one entry here plus its
module. `auto` is not an entry: resolve_backend (below) turns it into one, on the login node
and on the rank alike. No torch at import: the login node reads this table.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from collectives.config import ALGORITHMS, COMPRESSIONS, DDP_BUCKET_MB, ENGINE_BUCKET_MB, SHARDINGS, CommConfig


@dataclass(frozen=True)
class Backend:
    name: str
    trains_on: str  # "cpu" or "gpu": where its tensors live
    rendezvous: bool  # meets at MASTER_ADDR:MASTER_PORT (torch.distributed's store) instead of MPI/PMIx
    # How it starts and syncs gradients: "engine" (MPI, collectives.mpi, the toolkit's buckets),
    # "torch.distributed" (a process group of this name, DistributedDataParallel) or "horovod".
    family: str
    shardings: tuple[str, ...]  # comm.sharding values it runs ("optimizer", "gradients": ZeRO on the engine; "full": FSDP2)
    compressions: tuple[str, ...]  # comm.compression values it offers
    sync_batchnorm: bool  # torch's SyncBatchNorm (GPUs only)
    library: str  # what carries its collectives, as messages name it
    package: str | None = None  # a Python package it needs beyond torch, checked on the login node


BACKEND_TABLE: dict[str, Backend] = {
    "mpi": Backend("mpi", "cpu", False, "engine", ("none", "optimizer", "gradients"), ("none", "fp16", "bf16", "topk"), False, "the toolkit's engine"),
    "gloo": Backend("gloo", "cpu", True, "torch.distributed", ("none", "full"), ("none", "fp16", "bf16"), False, "Gloo"),
    "nccl": Backend("nccl", "gpu", True, "torch.distributed", ("none", "full"), ("none", "fp16", "bf16"), True, "NCCL"),
    "horovod": Backend("horovod", "cpu", False, "horovod", ("none",), ("none", "fp16"), False, "Horovod", package="horovod"),
}

BACKENDS = ("auto", *BACKEND_TABLE)  # what comm.backend accepts


class UnknownBackend(ValueError):
    """A backend name with no entry: comm=auto not resolved yet, or a name the login node never saw."""


def entry(name: str) -> Backend:
    """The entry of a concrete backend, or the one refusal that names the table's backends."""
    try:
        return BACKEND_TABLE[name]
    except KeyError:
        hint = " (resolve comm=auto first: collectives.backends.resolve_backend)" if name == "auto" else ""
        raise UnknownBackend(f"comm.backend={name!r} is not one of {', '.join(BACKEND_TABLE)}{hint}") from None


def check_comm(comm: CommConfig) -> None:
    """The comm section's own settings, each alone (ValueError: the one line the user sees): the
    names from the table and the lists, the bucket and top-k sizes. What a backend allows of the
    rest of the job is the login node's check (hpc.config.validate.check_backend)."""
    for key, value, allowed in (
        ("comm.backend", comm.backend, BACKENDS),
        ("comm.algorithm", comm.algorithm, ALGORITHMS),
        ("comm.compression", comm.compression, COMPRESSIONS),
        ("comm.sharding", comm.sharding, SHARDINGS),
    ):
        if value not in allowed:
            raise ValueError(f"{key}={value!r} is not one of {', '.join(allowed)}")
    if comm.bucket_mb < 0:
        raise ValueError(f"comm.bucket_mb={comm.bucket_mb} must be >= 0 (0: one allreduce per tensor)")
    if not 0 < comm.topk_ratio <= 1:
        raise ValueError(f"comm.topk_ratio={comm.topk_ratio} must be in (0, 1]")
    if comm.ranks_per_node is not None and comm.ranks_per_node < 1:
        raise ValueError(f"comm.ranks_per_node={comm.ranks_per_node} must be >= 1")


def resolve_backend(comm: CommConfig, gpus_per_task: int) -> CommConfig:
    """comm=auto made concrete from the job: NCCL (DistributedDataParallel) where the ranks have
    GPUs, the toolkit's MPI engine on CPUs. On GPUs the engine's default bucket becomes DDP's."""
    if comm.backend != "auto":
        return comm
    if gpus_per_task > 0:
        return replace(comm, backend="nccl", bucket_mb=DDP_BUCKET_MB if comm.bucket_mb == ENGINE_BUCKET_MB else comm.bucket_mb)
    return replace(comm, backend="mpi")


def backend_of(comm: CommConfig, gpus_per_task: int) -> Backend:
    """The entry a job's ranks run: comm=auto resolved from the job's resources first."""
    return BACKEND_TABLE[resolve_backend(comm, gpus_per_task).backend]


def offering(what: str, value: str) -> list[str]:
    """The backends whose `what` (shardings, compressions) include `value`, in table order."""
    return [name for name, backend in BACKEND_TABLE.items() if value in getattr(backend, what)]


def sharding_refused(sharding: str, backend: str) -> str:
    """Why comm.sharding=`sharding` does not run on comm=`backend`, naming the backends it runs on:
    the one line of the login node's check and of the rank's (collectives.gradsync)."""
    where = offering("shardings", sharding)
    if sharding == "full":
        sharded = " or ".join(f"comm={name} ({BACKEND_TABLE[name].trains_on.upper()}s)" for name in where)
        return f"comm.sharding=full runs FSDP2 on torch.distributed: use {sharded}, not comm={backend}"
    return (
        f"comm.sharding={sharding} runs on the toolkit's engine: use {' or '.join(f'comm={name}' for name in where)} "
        f"(comm={backend} trains replicated, comm.sharding=none; comm.sharding=full shards on {' and '.join(offering('shardings', 'full'))})"
    )
