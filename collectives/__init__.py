"""Communication for data-parallel training behind one small interface (`Collectives`).

`init_collectives(cfg, place)` is the one place a process group starts; backends are
imported lazily so that importing this package has no side effects and needs no MPI.
This package imports neither hpc/ nor trainers/ and reads no launcher environment (but for the
allreduce benchmark's --np): the rank tells it where it sits (`RankPlace`, which hpc.env.RankInfo
satisfies) and where to meet.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # importing this package must not import torch (login nodes read its config)
    from collectives.base import Collectives
    from collectives.config import CommConfig

__all__ = ["RankPlace", "init_collectives"]


class RankPlace(Protocol):
    """Where this process sits in the job, as its launcher says."""

    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def node_rank(self) -> int: ...
    @property
    def local_rank(self) -> int: ...


def init_collectives(
    cfg: CommConfig, place: RankPlace, node_position: int | None = None, rendezvous: tuple[str, int] | None = None, pinned_table: Path | None = None
) -> Collectives:
    """`node_position`: this node's place in the switch-ordered ring (None: node order).
    `rendezvous`: (address, port) of torch.distributed's store, for comm=gloo and comm=nccl.
    `pinned_table`: the job's own copy of auto's tuning table (its run dir), read before the
    shared cache and written at the first start, so that a resumed job sums exactly as before."""
    from collectives.backends import entry
    from collectives.base import CollectivesError

    backend = entry(cfg.backend)
    if backend.family == "engine":
        from collectives.mpi import MpiCollectives

        node_rank, local_rank = node_layout(cfg, place)
        engine = MpiCollectives.from_world(cfg.algorithm, node_rank, local_rank, node_position)
        if cfg.autotune and cfg.algorithm in ("auto", "hierarchical"):
            from collectives.tuning import default_cache_dir

            engine.tune(default_cache_dir() if cfg.tuning_cache is None else cfg.tuning_cache or None, pinned_table)
        comm: Collectives = engine
    elif backend.family == "torch.distributed":
        from collectives.torchdist import TorchDistCollectives

        if rendezvous is None:
            raise CollectivesError("no rendezvous: not a Slurm job and MASTER_ADDR/MASTER_PORT are not set (launch with python launch.py)")
        comm = TorchDistCollectives.start(cfg.backend, place.rank, place.world_size, *rendezvous)
    else:  # horovod
        from collectives.horovod import HorovodCollectives

        comm = HorovodCollectives.start(cfg.bucket_mb)
    if (comm.rank, comm.world_size) != (place.rank, place.world_size):
        comm.close()
        raise CollectivesError(
            f"{cfg.backend} sees rank {comm.rank} of {comm.world_size} but the launcher "
            f"says rank {place.rank} of {place.world_size}: "
            "launch with srun --mpi=pmix or mpirun, not a plain python per task"
        )
    return comm


def describe(comm: Collectives) -> str:
    """What actually carries the collectives, asked of the library itself (not the config)."""
    kind = type(comm).__name__
    if kind == "TorchDistCollectives":
        import torch.distributed as dist

        return f"torch.distributed {dist.get_backend()} (DistributedDataParallel)"
    if kind == "HorovodCollectives":
        import horovod
        import horovod.torch as hvd

        return f"horovod {horovod.__version__} over {'MPI' if hvd.mpi_enabled() else 'Gloo'}"
    if kind == "MpiCollectives":
        from collectives.mpi import mpi_library

        return f"mpi4py {mpi_library()} (the toolkit's engine)"
    return kind


def node_layout(cfg: CommConfig, place: RankPlace) -> tuple[int, int]:
    """(node_rank, local_rank) for the hierarchical communicators; by hand with ranks_per_node."""
    if cfg.ranks_per_node:
        return place.rank // cfg.ranks_per_node, place.rank % cfg.ranks_per_node
    return place.node_rank, place.local_rank
