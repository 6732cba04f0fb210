"""One rank of the GRES binding test, started by srun: apply the toolkit's binding for the
topology preset named on the command line, then compare our hierarchical allreduce over the
node and rail communicators with MPI_Allreduce. Prints one JSON line per rank."""

from __future__ import annotations

import json
import os
import sys

from hpc.config.compose import compose_job
from hpc.env import RankInfo
from hpc.rank.binding import apply_binding, binding_for


def main() -> None:
    topo = compose_job([f"topology={sys.argv[1]}"]).topology
    rank = RankInfo.from_env(os.environ)
    binding = binding_for(topo, rank)
    line = apply_binding(binding, topo)  # before MPI initialises

    import torch
    from mpi4py import MPI

    from collectives.mpi import MpiCollectives

    comm = MPI.COMM_WORLD
    engine = MpiCollectives(comm, "hierarchical", rank.node_rank, rank.local_rank)
    data = torch.arange(1 << 16, dtype=torch.float64).remainder_(13) * (rank.rank + 1) + rank.rank
    ours = data.clone()
    engine.allreduce_(ours, "sum")
    reference = data.numpy().copy()
    comm.Allreduce(MPI.IN_PLACE, reference, op=MPI.SUM)
    node_size, rail_size = engine._node_comm.Get_size(), engine._rail_comm.Get_size()
    rail_members = engine._rail_comm.allgather(binding.rail)
    print(
        json.dumps(
            {
                "rank": rank.rank,
                "node": os.environ.get("SLURMD_NODENAME"),
                "node_rank": rank.node_rank,
                "local_rank": rank.local_rank,
                "gpu": binding.gpu,
                "nic": binding.nic,
                "rail": binding.rail,
                "line": line,
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "nccl_ib_hca": os.environ.get("NCCL_IB_HCA"),
                "slurm_gpus": os.environ.get("SLURM_GPUS_ON_NODE"),
                "node_comm": node_size,
                "rail_comm": rail_size,
                "rail_members": rail_members,
                "equal": bool(torch.equal(ours, torch.from_numpy(reference))),
            }
        ),
        flush=True,
    )
    engine.close()


if __name__ == "__main__":
    main()
