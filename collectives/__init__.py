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


def init_collectives(cfg: CommConfig, rank_info: RankInfo) -> Collectives:
    from collectives.base import CollectivesError

    if cfg.backend == "mpi":
        from collectives.mpi import MpiCollectives

        node_rank, local_rank = node_layout(cfg, rank_info)
        comm: Collectives = MpiCollectives.from_world(cfg.algorithm, node_rank, local_rank)
    else:
        raise CollectivesError(f"comm.backend={cfg.backend!r} is not available; use comm=mpi")
    if (comm.rank, comm.world_size) != (rank_info.rank, rank_info.world_size):
        comm.close()
        raise CollectivesError(
            f"{cfg.backend} sees rank {comm.rank} of {comm.world_size} but the launcher "
            f"({rank_info.launcher}) says rank {rank_info.rank} of {rank_info.world_size}: "
            "launch with srun --mpi=pmix or mpirun, not a plain python per task"
        )
    return comm


def node_layout(cfg: CommConfig, rank_info: RankInfo) -> tuple[int, int]:
    """(node_rank, local_rank) for the hierarchical communicators; by hand with ranks_per_node."""
    if cfg.ranks_per_node:
        return rank_info.rank // cfg.ranks_per_node, rank_info.rank % cfg.ranks_per_node
    return rank_info.node_rank, rank_info.local_rank
