"""Run under `mpirun -np N`: checks the mpi backend against values every rank can compute.

Exits non-zero (failing the pytest that launched it) on the first mismatch.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn

from collectives import init_collectives
from collectives.base import allreduce_sums, broadcast_module
from collectives.config import ALGORITHMS, CommConfig
from hpc.env import RankInfo
from trainers.sampler import ShardSampler


def rank_values(rank: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.arange(count, dtype=torch.float64) * (rank + 1) + rank).to(dtype)


COUNTS = (0, 1, 2, 3, 5, 1000, 4099, 70_001)  # 0, 1, odd, not divisible by any world size, > 256 KiB
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)


def check_algorithms(info: RankInfo) -> None:
    """Every algorithm x dtype x op x count against a result each rank computes alone."""
    world = info.world_size
    for algorithm in ALGORITHMS:
        per_node = 2 if algorithm == "hierarchical" and world % 2 == 0 else None
        comm = init_collectives(CommConfig(algorithm=algorithm, ranks_per_node=per_node), info)
        for dtype in DTYPES:
            exact = dtype not in (torch.float16, torch.bfloat16)
            for count in COUNTS:
                if dtype in (torch.float16, torch.bfloat16) and count > 5000:
                    continue  # sums of large values lose precision in half types; covered small
                expected = sum(rank_values(r, count, torch.float64) for r in range(world))
                for op in ("sum", "max", "min", "avg"):
                    if op == "avg" and not dtype.is_floating_point:
                        continue
                    buffer = rank_values(comm.rank, count, dtype)
                    comm.allreduce_(buffer, op=op)
                    want = {
                        "sum": expected,
                        "avg": expected / world,
                        "max": rank_values(world - 1, count, torch.float64),
                        "min": rank_values(0, count, torch.float64),
                    }[op].to(dtype).to(torch.float64)
                    got = buffer.to(torch.float64)
                    rtol = 0.0 if exact and op != "avg" else 1e-6 if dtype in (torch.float32, torch.float64) else 2e-2
                    assert got.shape == want.shape and torch.allclose(got, want, rtol=rtol, atol=rtol), (algorithm, dtype, count, op)
        comm.close()


def check_other_collectives(comm) -> None:
    world, rank = comm.world_size, comm.rank
    for count in (0, 1, 7, 100_003):  # tree below 256 KiB, scatter + allgather above
        for root in {0, world - 1}:
            buffer = rank_values(rank, count, torch.float32) if rank == root else torch.zeros(count)
            comm.broadcast_(buffer, root)
            assert torch.equal(buffer, rank_values(root, count, torch.float32)), ("broadcast", count, root)
        gathered = comm.allgather(torch.full((count,), float(rank)))
        assert torch.equal(gathered, torch.arange(world, dtype=torch.float32).repeat_interleave(count)), ("allgather", count)
        mine = comm.reduce_scatter(rank_values(rank, count, torch.float64), op="sum")
        full = sum(rank_values(r, count, torch.float64) for r in range(world))
        assert torch.equal(mine, full[count * rank // world : count * (rank + 1) // world]), ("reduce_scatter", count)


def main() -> None:
    info = RankInfo.from_env(os.environ)
    check_algorithms(info)
    comm = init_collectives(CommConfig(), info)
    world = comm.world_size
    check_other_collectives(comm)

    # Different seeds per rank, identical after the broadcast from rank 0.
    torch.manual_seed(100 + comm.rank)
    model = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Linear(7, 3))
    broadcast_module(comm, model)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = torch.zeros(world * flat.numel(), dtype=flat.dtype)
    gathered[comm.rank * flat.numel() : (comm.rank + 1) * flat.numel()] = flat
    comm.allreduce_(gathered, op="sum")
    assert all(torch.equal(chunk, flat) for chunk in gathered.view(world, -1))

    # The shards each rank reads are disjoint across ranks.
    sampler = ShardSampler(100, 8, comm.rank, world, seed=3)
    mine = np.zeros(100, dtype=np.int64)
    for batch in sampler.batches(epoch=2):
        mine[batch] += 1
    counts = torch.from_numpy(mine)
    comm.allreduce_(counts, op="sum")
    assert counts.max() == 1 and int(counts.sum()) == sampler.steps_per_epoch * 8 * world

    total, _ = allreduce_sums(comm, [1.0, 0.0])
    assert total == world
    comm.barrier()
    if comm.rank == 0:
        print(f"collectives ok on {world} ranks")


if __name__ == "__main__":
    main()
