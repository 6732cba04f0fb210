"""The data-parallel training loop."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from collectives.base import Collectives, allreduce_sums, broadcast_module
from collectives.config import CommConfig
from collectives.optimizer import apply_distributed_optimizer
from trainers.config import SCHEDULES, DataConfig, ModelConfig, OptimConfig, TrainerConfig
from trainers.data import H5Split
from trainers.datasets import inspect_hdf5
from trainers.metrics import MetricsWriter
from trainers.models import build_model
from trainers.sampler import ShardSampler, eval_shard

log = logging.getLogger("trainers")


@dataclass(frozen=True)
class FitConfig:
    model: ModelConfig
    data: DataConfig
    optim: OptimConfig
    trainer: TrainerConfig
    comm: CommConfig


@dataclass(frozen=True)
class FitResult:
    epochs: int
    steps: int
    loss: float
    test_accuracy: float
    samples_per_s: float
    train_seconds: float
    step_ms: float
    comm_wait_ms: float  # per step: time step() waited for gradient communication


def build_optimizer(cfg: OptimConfig, params) -> torch.optim.Optimizer:  # type: ignore[no-untyped-def]
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, nesterov=cfg.nesterov)
    if cfg.name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.momentum, 0.999), weight_decay=cfg.weight_decay)
    raise ValueError(f"unknown optimizer {cfg.name!r}; choose sgd or adamw")


def build_schedule(cfg: OptimConfig, optimizer: torch.optim.Optimizer, total_steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    if cfg.schedule == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total_steps, 1))
    if cfg.schedule == "constant":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    raise ValueError(f"unknown schedule {cfg.schedule!r}; choose one of {', '.join(SCHEDULES)}")


def average_buffers(comm: Collectives, model: nn.Module) -> None:
    """BatchNorm statistics differ per rank; evaluate every rank with their average."""
    for buffer in model.buffers():
        if buffer.is_floating_point() and comm.world_size > 1:
            comm.allreduce_(buffer.data, op="avg")


@torch.no_grad()
def evaluate(model: nn.Module, split: H5Split, comm: Collectives, batch_size: int) -> float:
    model.eval()
    indices = eval_shard(len(split), comm.rank, comm.world_size)
    correct = 0
    for lo in range(0, len(indices), batch_size):
        x, y = split.read(indices[lo : lo + batch_size])
        correct += int((model(x).argmax(dim=1) == y).sum())
    total_correct, total = allreduce_sums(comm, [correct, len(indices)])
    model.train()
    return total_correct / max(total, 1)


def fit(cfg: FitConfig, comm: Collectives, data_path: Path, metrics: MetricsWriter) -> FitResult:
    info = inspect_hdf5(data_path, cfg.data)
    torch.manual_seed(cfg.trainer.seed)
    model = build_model(cfg.model, info.input_shape, info.num_classes)
    broadcast_module(comm, model)  # identical start on every rank, whatever their seeds did
    accumulation = cfg.trainer.accumulation_steps
    optimizer = apply_distributed_optimizer(build_optimizer(cfg.optim, model.parameters()), model, comm, cfg.comm, accumulation)
    loss_fn = nn.CrossEntropyLoss()
    train = H5Split(data_path, cfg.data.train_x, cfg.data.train_y)
    test = H5Split(data_path, cfg.data.test_x, cfg.data.test_y)
    sampler = ShardSampler(info.num_train, cfg.data.batch_size, comm.rank, comm.world_size, cfg.trainer.seed)
    steps_per_epoch = max(1, sampler.steps_per_epoch // accumulation)
    max_steps = cfg.trainer.max_steps
    total_steps = min(max_steps or 1 << 62, cfg.trainer.epochs * steps_per_epoch)
    schedule = build_schedule(cfg.optim, optimizer, total_steps)
    step, loss, accuracy, samples_per_s, train_seconds, step_ms, comm_wait_ms = 0, float("nan"), 0.0, 0.0, 0.0, 0.0, 0.0
    log.info(
        "training %s on %s: %d train / %d test samples, %d ranks x batch %d x %d micro-batches, %d steps per epoch, "
        "allreduce %s, buckets %.1f MiB, overlap %s, compression %s",
        cfg.model.name, data_path.name, info.num_train, info.num_test, comm.world_size, cfg.data.batch_size, accumulation,
        steps_per_epoch, cfg.comm.algorithm, cfg.comm.bucket_mb, cfg.comm.overlap, cfg.comm.compression,
    )
    epoch = 0
    try:
        for epoch in range(1, cfg.trainer.epochs + 1):
            started, loss_sum, seen, epoch_steps, waited = time.perf_counter(), 0.0, 0, 0, 0.0
            optimizer.zero_grad(set_to_none=True)
            for micro, indices in enumerate(sampler.batches(epoch), start=1):
                x, y = train.read(indices)
                batch_loss = loss_fn(model(x), y)
                (batch_loss / accumulation).backward()
                loss_sum += batch_loss.item() * len(y)
                seen += len(y)
                if micro % accumulation:
                    continue  # accumulation micro-step: gradients stay local
                waited -= optimizer.comm_wait_s  # type: ignore[attr-defined]
                optimizer.step()
                waited += optimizer.comm_wait_s  # type: ignore[attr-defined]
                schedule.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                epoch_steps += 1
                if max_steps is not None and step >= max_steps:
                    break
            # Throughput is set by the slowest rank: every rank reports that one figure.
            slowest = torch.tensor([time.perf_counter() - started, waited], dtype=torch.float64)
            comm.allreduce_(slowest, op="max")
            epoch_seconds, waited = slowest.tolist()
            train_seconds += epoch_seconds
            total_loss, total_seen = allreduce_sums(comm, [loss_sum, seen])
            loss = total_loss / max(total_seen, 1)
            samples_per_s = total_seen / epoch_seconds if epoch_seconds > 0 else 0.0
            step_ms = 1000 * epoch_seconds / max(epoch_steps, 1)
            comm_wait_ms = 1000 * waited / max(epoch_steps, 1)
            average_buffers(comm, model)
            accuracy = evaluate(model, test, comm, cfg.data.eval_batch_size)
            log.info("epoch %d/%d  loss %.4f  test_acc %.4f  samples/s %.0f", epoch, cfg.trainer.epochs, loss, accuracy, samples_per_s)
            metrics.write({
                "epoch": epoch, "step": step, "loss": loss, "test_accuracy": accuracy, "samples_per_s": samples_per_s,
                "step_ms": step_ms, "comm_wait_ms": comm_wait_ms, "world_size": comm.world_size,
            })
            if max_steps is not None and step >= max_steps:
                break
    finally:
        train.close()
        test.close()
        optimizer.remove_hooks()  # type: ignore[attr-defined]
    return FitResult(epoch, step, loss, accuracy, samples_per_s, train_seconds, step_ms, comm_wait_ms)
