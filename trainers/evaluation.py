"""Evaluation on every rank's shard of the test split, with BatchNorm statistics averaged over ranks."""

from __future__ import annotations

import torch
from torch import nn

from collectives.base import Collectives, allreduce_sums
from trainers.data import H5Split
from trainers.sampler import eval_shard


def average_buffers(comm: Collectives, model: nn.Module) -> None:
    """BatchNorm statistics differ per rank; evaluate every rank with their average."""
    for buffer in model.buffers():
        if buffer.is_floating_point() and comm.world_size > 1:
            comm.allreduce_(buffer.data, op="avg")


@torch.no_grad()
def evaluate(model: nn.Module, split: H5Split, comm: Collectives, batch_size: int, device: torch.device = torch.device("cpu")) -> float:
    model.eval()
    indices = eval_shard(len(split), comm.rank, comm.world_size)
    correct = 0
    for lo in range(0, len(indices), batch_size):
        x, y = split.read(indices[lo : lo + batch_size])
        correct += int((model(x.to(device)).argmax(dim=1) == y.to(device)).sum())
    total_correct, total = allreduce_sums(comm, [correct, len(indices)])
    model.train()
    return total_correct / max(total, 1)
