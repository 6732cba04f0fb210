"""Typed config owned by collectives/. Plain dataclass: no hydra, no torch. What each backend
allows and how `auto` resolves: collectives.backends."""

from __future__ import annotations

from dataclasses import dataclass

ENGINE_BUCKET_MB, DDP_BUCKET_MB = 4.0, 25.0
ALGORITHMS = ("auto", "ring", "rhd", "hierarchical", "mpi")
COMPRESSIONS = ("none", "fp16", "bf16", "topk")
SHARDINGS = ("none", "optimizer", "gradients", "full")


@dataclass
class CommConfig:
    backend: str = "mpi"  # auto (from the job: nccl with GPUs, else mpi) | mpi (ours) | gloo, nccl (torch.distributed + DDP) | horovod
    # auto: the fastest of the others at each size, timed on the job's ranks (autotune);
    # hierarchical: inside the node, then across nodes on each rail; mpi: MPI_Allreduce itself.
    algorithm: str = "auto"
    autotune: bool = True  # time the algorithms at start-up (once per host type and job shape)
    # where those timings are kept: null = $HPCTK_CACHE or ~/.cache/hpc-toolkit; "" = nowhere
    tuning_cache: str | None = None
    bucket_mb: float = 4.0  # gradient fusion bucket size; 0 = one allreduce per tensor
    overlap: bool = True  # start a bucket's allreduce while backward still runs
    compression: str = "none"  # none | fp16 | bf16 | topk (top-k with error feedback)
    topk_ratio: float = 0.01  # fraction of a bucket's gradients sent by topk
    ranks_per_node: int | None = None  # group ranks into nodes by hand (emulated nodes on one host)
    # A CPU-only backend (mpi, gloo, horovod) on a job that asks for GPUs is refused (it would hold
    # the GPUs and train on cores) unless this says that is meant.
    cpu_with_gpus: bool = False
    # none: every rank holds all the state (replicated data parallel); optimizer (ZeRO-1): each rank
    # keeps the optimizer state of its 1/world of the parameters; gradients (ZeRO-2): and receives
    # only its part of the averaged gradients. Both on comm=mpi (collectives/zero.py).
    sharding: str = "none"
