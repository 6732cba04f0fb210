"""Run under `mpirun -np N`: the distributed optimizer against single-process SGD on the global batch.

Every rank builds the same data and model, trains its shard with the distributed optimizer and,
alone, a reference model on the whole global batch; after a few steps they must agree.
"""

from __future__ import annotations

import copy
import math
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
    start = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    xs = torch.randn(STEPS, accumulation, world, BATCH, 10)
    ys = torch.randint(0, 4, (STEPS, accumulation, world, BATCH))
    opt = apply_distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9), model, comm, cfg, accumulation)
    train(model, opt, [[(xs[s, m, rank], ys[s, m, rank]) for m in range(accumulation)] for s in range(STEPS)])
    opt.remove_hooks()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.2, momentum=0.9)
    train(reference, ref_opt, [[(xs[s, m].reshape(-1, 10), ys[s, m].reshape(-1)) for m in range(accumulation)] for s in range(STEPS)])
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    # Measured against the size of the update, not of the weights: compressed gradients may be off
    # by a few roundings of their precision, and an error of a few percent of a step must fail.
    error, step = float((flat - expected).abs().max()), float((expected - start).abs().max())
    assert error <= tol * step, (cfg, accumulation, error, step, error / step)
    everyone = comm.allgather(flat).view(world, -1)
    assert all(torch.equal(row, everyone[0]) for row in everyone), ("ranks diverged", cfg)


def main() -> None:
    info = RankInfo.from_env(os.environ)
    # Tolerances relative to the largest parameter update: float32 reordering (1e-5), and 8
    # roundings of the wire precision for compressed gradients (fp16 2^-11, bf16 2^-8).
    cases = [
        (CommConfig(overlap=True, bucket_mb=4), 1, 1e-5),
        (CommConfig(overlap=True, bucket_mb=0), 1, 1e-5),
        (CommConfig(overlap=False, bucket_mb=0.001), 1, 1e-5),
        (CommConfig(overlap=True, bucket_mb=0.002, algorithm="ring"), 2, 1e-5),
        (CommConfig(overlap=False, bucket_mb=4, algorithm="mpi"), 3, 1e-5),
        (CommConfig(compression="fp16"), 1, 8 * 2**-11),
        (CommConfig(compression="bf16"), 1, 8 * 2**-8),
        (CommConfig(compression="topk", topk_ratio=1.0), 1, 1e-5),  # sends everything: exact
    ]
    for cfg, accumulation, tol in cases:
        comm = init_collectives(cfg, info)
        check(comm, info, cfg, accumulation, tol)
        comm.close()
    check_topk(info)
    check_optimizer_state_broadcast(info)
    if info.rank == 0:
        print(f"optimizer ok on {info.world_size} ranks")


def topk_reference(world: int, ratio: float, lr: float, steps: int) -> torch.Tensor:
    """Top-k with error feedback, by its definition, for every rank in this one process: rank r
    sends the k largest magnitudes of its gradient plus what it left unsent before, keeps the
    rest, and the update is the mean of what all ranks sent. Returns the final parameters, flat."""
    torch.manual_seed(0)
    model = nn.Linear(50, 5)
    params = list(model.parameters())
    left = [torch.zeros(sum(p.numel() for p in params)) for _ in range(world)]
    for _ in range(steps):
        x, y = torch.randn(4, 50), torch.randint(0, 5, (4,))  # the draws every rank makes; rank r adds r
        sent = torch.zeros_like(left[0])
        for rank in range(world):
            grads = torch.autograd.grad(nn.functional.cross_entropy(model(x + rank), y), params)
            corrected = torch.cat([g.reshape(-1) for g in grads]) + left[rank]
            chosen = torch.topk(corrected.abs(), math.ceil(ratio * corrected.numel())).indices
            sent[chosen] += corrected[chosen]
            corrected[chosen] = 0
            left[rank] = corrected
        with torch.no_grad():
            update, at = sent / world, 0
            for p in params:
                p -= lr * update[at : at + p.numel()].view_as(p)
                at += p.numel()
    return torch.cat([p.detach().reshape(-1) for p in params])


def check_topk(info: RankInfo, ratio: float = 0.05, lr: float = 0.1, steps: int = 3) -> None:
    """Sparse, and exactly what top-k with error feedback gives: 13 of 255 gradients per rank per
    step (a wrong selection, a lost residual or a missing average changes the result)."""
    cfg = CommConfig(compression="topk", topk_ratio=ratio)
    comm = init_collectives(cfg, info)
    torch.manual_seed(0)
    model = nn.Linear(50, 5)
    start = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    opt = apply_distributed_optimizer(torch.optim.SGD(model.parameters(), lr=lr), model, comm, cfg)
    train(model, opt, [[(torch.randn(4, 50) + comm.rank, torch.randint(0, 5, (4,)))] for _ in range(steps)])
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    expected = topk_reference(comm.world_size, ratio, lr, steps)
    changed = int((flat != start).sum())
    assert 0 < changed <= steps * comm.world_size * math.ceil(ratio * flat.numel()) < flat.numel(), ("topk sent too much", changed)
    error, step = float((flat - expected).abs().max()), float((expected - start).abs().max())
    assert error <= 1e-5 * step, ("topk differs from its definition", error, step)
    everyone = comm.allgather(flat).view(comm.world_size, -1)
    assert all(torch.equal(row, everyone[0]) for row in everyone), "topk ranks diverged"
    comm.close()


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
