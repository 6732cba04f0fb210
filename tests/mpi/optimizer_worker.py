"""Run under `mpirun -np N`: the distributed optimizer against single-process SGD on the global batch.

Every rank builds the same data and model, trains its shard with the distributed optimizer and,
alone, a reference model on the whole global batch; after a few steps they must agree.
"""

from __future__ import annotations

import copy
import os

import torch
from torch import nn

from collectives import init_collectives
from collectives.config import CommConfig
from collectives.optimizer import apply_distributed_optimizer, broadcast_optimizer_state
from hpc.env import RankInfo

STEPS, BATCH = 3, 4  # per rank, per micro-step


def train(model, optimizer, batches) -> None:
    """batches: per step, a list of micro-batches (x, y) this process owns."""
    for micro_batches in batches:
        for x, y in micro_batches:
            (nn.functional.cross_entropy(model(x), y) / len(micro_batches)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def check(comm, info: RankInfo, cfg: CommConfig, accumulation: int, tol: float) -> None:
    world, rank = comm.world_size, comm.rank
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 4))
    reference = copy.deepcopy(model)
    xs = torch.randn(STEPS, accumulation, world, BATCH, 10)
    ys = torch.randint(0, 4, (STEPS, accumulation, world, BATCH))
    opt = apply_distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9), model, comm, cfg, accumulation)
    train(model, opt, [[(xs[s, m, rank], ys[s, m, rank]) for m in range(accumulation)] for s in range(STEPS)])
    opt.remove_hooks()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.2, momentum=0.9)
    train(reference, ref_opt, [[(xs[s, m].reshape(-1, 10), ys[s, m].reshape(-1)) for m in range(accumulation)] for s in range(STEPS)])
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    assert torch.allclose(flat, expected, atol=tol, rtol=0), (cfg, accumulation, float((flat - expected).abs().max()))
    everyone = comm.allgather(flat).view(world, -1)
    assert all(torch.equal(row, everyone[0]) for row in everyone), ("ranks diverged", cfg)


def main() -> None:
    info = RankInfo.from_env(os.environ)
    cases = [
        (CommConfig(overlap=True, bucket_mb=4), 1, 1e-5),
        (CommConfig(overlap=True, bucket_mb=0), 1, 1e-5),
        (CommConfig(overlap=False, bucket_mb=0.001), 1, 1e-5),
        (CommConfig(overlap=True, bucket_mb=0.002, algorithm="ring"), 2, 1e-5),
        (CommConfig(overlap=False, bucket_mb=4, algorithm="mpi"), 3, 1e-5),
        (CommConfig(compression="fp16"), 1, 1e-2),
        (CommConfig(compression="bf16"), 1, 5e-2),
        (CommConfig(compression="topk", topk_ratio=1.0), 1, 1e-5),  # sends everything: exact
    ]
    for cfg, accumulation, tol in cases:
        comm = init_collectives(cfg, info)
        check(comm, info, cfg, accumulation, tol)
        comm.close()
    comm = init_collectives(CommConfig(compression="topk", topk_ratio=0.05), info)
    torch.manual_seed(0)
    model = nn.Linear(50, 5)
    opt = apply_distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, comm, CommConfig(compression="topk", topk_ratio=0.05))
    train(model, opt, [[(torch.randn(4, 50) + comm.rank, torch.randint(0, 5, (4,)))] for _ in range(3)])
    everyone = comm.allgather(model.weight.detach().reshape(-1)).view(comm.world_size, -1)
    assert all(torch.equal(row, everyone[0]) for row in everyone), "topk ranks diverged"
    comm.close()
    check_optimizer_state_broadcast(info)
    if info.rank == 0:
        print(f"optimizer ok on {info.world_size} ranks")


def check_optimizer_state_broadcast(info: RankInfo) -> None:
    """Momentum buffers that differ per rank become rank 0's everywhere."""
    comm = init_collectives(CommConfig(), info)
    torch.manual_seed(comm.rank)
    model = nn.Linear(7, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 7)).sum().backward()
    opt.step()
    broadcast_optimizer_state(comm, opt)
    momentum = torch.cat([opt.state[p]["momentum_buffer"].reshape(-1) for p in model.parameters()])
    everyone = comm.allgather(momentum).view(comm.world_size, -1)
    assert all(torch.equal(row, everyone[0]) for row in everyone), "optimizer state differs after broadcast"
    comm.close()


if __name__ == "__main__":
    main()
