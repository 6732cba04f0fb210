"""Run under `mpirun -np N`: checks the mpi backend against values every rank can compute.

Exits non-zero (failing the pytest that launched it) on the first mismatch.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn

from collectives import init_collectives
from collectives.base import allreduce_gradients, allreduce_sums, broadcast_module
from collectives.config import CommConfig
from hpc.env import RankInfo
from trainers.sampler import ShardSampler


def rank_values(rank: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.arange(count, dtype=torch.float64) * (rank + 1) + rank).to(dtype)


def main() -> None:
    info = RankInfo.from_env(os.environ)
    comm = init_collectives(CommConfig(), info)
    world = comm.world_size
    assert (comm.rank, world) == (info.rank, info.world_size)

    for dtype in (torch.float32, torch.float64, torch.int32, torch.int64):
        for count in (0, 1, world + 1, 1000, 4099):
            expected = sum(rank_values(r, count, torch.float64) for r in range(world))
            buffer = rank_values(comm.rank, count, dtype)
            comm.allreduce_(buffer, op="sum")
            assert torch.equal(buffer.to(torch.float64), expected), (dtype, count)
            maximum = rank_values(comm.rank, count, dtype)
            comm.allreduce_(maximum, op="max")
            assert torch.equal(maximum, rank_values(world - 1, count, dtype)), (dtype, count, "max")
            if dtype.is_floating_point:
                avg = rank_values(comm.rank, count, dtype)
                comm.allreduce_(avg, op="avg")
                assert torch.allclose(avg.to(torch.float64), expected / world), (dtype, count, "avg")

    # Different seeds per rank, identical after the broadcast from rank 0.
    torch.manual_seed(100 + comm.rank)
    model = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Linear(7, 3))
    broadcast_module(comm, model)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = torch.zeros(world * flat.numel(), dtype=flat.dtype)
    gathered[comm.rank * flat.numel() : (comm.rank + 1) * flat.numel()] = flat
    comm.allreduce_(gathered, op="sum")
    assert all(torch.equal(chunk, flat) for chunk in gathered.view(world, -1))

    # Gradient average equals the mean of every rank's own gradient.
    torch.manual_seed(7)
    inputs = torch.randn(world, 4, 5)
    own = []
    for r in range(world):
        model.zero_grad()
        model(inputs[r]).square().sum().backward()
        own.append([p.grad.clone() for p in model.parameters()])
    model.zero_grad()
    model(inputs[comm.rank]).square().sum().backward()
    allreduce_gradients(comm, model.parameters())
    for i, p in enumerate(model.parameters()):
        assert torch.allclose(p.grad, sum(g[i] for g in own) / world, atol=1e-6)

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
