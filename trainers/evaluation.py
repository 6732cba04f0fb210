"""Evaluation on every rank's shard of the test split, with BatchNorm statistics averaged over ranks."""

from __future__ import annotations

import torch
from torch import nn

from collectives.base import Collectives, allreduce_sums
from trainers.data.sampler import eval_shard
from trainers.reporting import metricnames
from trainers.task import MapDataset, Task, read_items


def average_buffers(comm: Collectives, model: nn.Module) -> None:
    """BatchNorm statistics differ per rank; evaluate every rank with their average."""
    for buffer in model.buffers():
        if buffer.is_floating_point() and comm.world_size > 1:
            comm.allreduce_(buffer.data, op="avg")


@torch.no_grad()
def evaluate(
    task: Task, model: nn.Module, data: MapDataset, comm: Collectives, batch_size: int, device: torch.device, lockstep: bool = False
) -> dict[str, float]:
    """The task's evaluation over every rank's shard: "loss" and each metric, as means per sample
    over all ranks (the same on every rank). `lockstep`: a model whose forward communicates
    (FSDP) runs the same number of forwards on every rank."""
    model.eval()
    indices = eval_shard(len(data), comm.rank, comm.world_size)
    loss, count = 0.0, 0
    sums: dict[str, float] = {}
    starts = list(range(0, len(indices), batch_size))
    if lockstep:  # every rank runs as many forwards as the one with the most batches (their collectives pair up)
        most = torch.tensor([float(len(starts))], dtype=torch.float64)
        comm.allreduce_(most, op="max")
        starts += [-1] * (int(most[0]) - len(starts))
    for lo in starts:
        if lo < 0:  # a forward whose result is not counted: the first batch again
            task.eval_step(model, task.batch(read_items(data, indices[:batch_size]), device))
            continue
        out = task.eval_step(model, task.batch(read_items(data, indices[lo : lo + batch_size]), device))
        loss, count = loss + float(out.loss) * out.count, count + out.count
        for name, value in out.sums.items():
            sums[name] = sums.get(name, 0.0) + float(value)
    # Agreed, not assumed: a rank whose shard was empty reports none and takes the others'
    names = metricnames.agree(comm, tuple(sorted(sums)) if count else None, "evaluation")
    totals = allreduce_sums(comm, [loss, count, *(sums.get(name, 0.0) for name in names)])
    model.train()
    seen = max(totals[1], 1)
    return {"loss": totals[0] / seen, **{name: total / seen for name, total in zip(names, totals[2:], strict=True)}}
