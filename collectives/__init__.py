"""Communication for data-parallel training behind one small interface (`Collectives`).

`init_collectives(cfg, rank_info)` is the one place a process group starts; backends are
imported lazily so that importing this package has no side effects and needs no MPI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importing this package must not import torch (login nodes read its config)
    from collectives.base import Collectives
    from collectives.config import CommConfig
    from hpc.env import RankInfo

__all__ = ["init_collectives"]


def init_collectives(cfg: CommConfig, rank_info: RankInfo, node_position: int | None = None) -> Collectives:
    """`node_position`: this node's place in the switch-ordered ring (None: node order)."""
    from collectives.base import CollectivesError

    if cfg.backend == "mpi":
        from collectives.mpi import MpiCollectives

        node_rank, local_rank = node_layout(cfg, rank_info)
        comm: Collectives = MpiCollectives.from_world(cfg.algorithm, node_rank, local_rank, node_position)
    elif cfg.backend in ("gloo", "nccl"):
        from collectives.torchdist import TorchDistCollectives

        comm = TorchDistCollectives.from_env(cfg.backend, rank_info.rank, rank_info.world_size)
    elif cfg.backend == "horovod":
        from collectives.horovod import HorovodCollectives

        comm = HorovodCollectives.start(cfg.bucket_mb)
    else:
        raise CollectivesError(f"comm.backend={cfg.backend!r} is not one of mpi, gloo, nccl, horovod")
    if (comm.rank, comm.world_size) != (rank_info.rank, rank_info.world_size):
        comm.close()
        raise CollectivesError(
            f"{cfg.backend} sees rank {comm.rank} of {comm.world_size} but the launcher "
            f"({rank_info.launcher}) says rank {rank_info.rank} of {rank_info.world_size}: "
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
        from mpi4py import MPI

        return f"mpi4py {MPI.Get_library_version().split(',')[0].strip()} (the toolkit's engine)"
    return kind


def node_layout(cfg: CommConfig, rank_info: RankInfo) -> tuple[int, int]:
    """(node_rank, local_rank) for the hierarchical communicators; by hand with ranks_per_node."""
    if cfg.ranks_per_node:
        return rank_info.rank // cfg.ranks_per_node, rank_info.rank % cfg.ranks_per_node
    return rank_info.node_rank, rank_info.local_rank
