"""The data-parallel training loop."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from collectives.base import Collectives, allreduce_sums, broadcast_module
from collectives.config import CommConfig
from trainers.checkpoint import CheckpointError, Checkpointer
from trainers.config import SCHEDULES, CheckpointConfig, DataConfig, ModelConfig, OptimConfig, TrainerConfig
from trainers.data import H5Split
from trainers.datasets import inspect_hdf5
from trainers.gradsync import build_gradient_sync
from trainers.metrics import MetricsWriter
from trainers.models import build_model
from trainers.preemption import StopFlag
from trainers.sampler import ShardSampler, eval_shard
from trainers.saving import SaveCoordinator
from trainers.state import Progress, restore, restore_rng, rng_state, shared_state

log = logging.getLogger("trainers")


@dataclass(frozen=True)
class FitConfig:
    model: ModelConfig
    data: DataConfig
    optim: OptimConfig
    trainer: TrainerConfig
    comm: CommConfig
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


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
    stopped_by: str | None = None  # the signal that stopped training early, if any
    resumed_from: int | None = None  # the checkpoint step this process started from


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


@dataclass
class RunContext:
    """Where a run keeps its state across restarts, and how it learns it must stop."""

    checkpoint_dir: Path | None = None
    config_text: str = ""  # the run's resolved config, stored in every checkpoint
    stop: StopFlag = field(default_factory=StopFlag)
    step_log: MetricsWriter = field(default_factory=lambda: MetricsWriter(None))


def fit(cfg: FitConfig, comm: Collectives, data_path: Path, metrics: MetricsWriter, run: RunContext | None = None) -> FitResult:
    run = run or RunContext()
    info = inspect_hdf5(data_path, cfg.data)
    torch.manual_seed(cfg.trainer.seed)
    device: torch.device = getattr(comm, "device", torch.device("cpu"))
    model = build_model(cfg.model, info.input_shape, info.num_classes).to(device)
    broadcast_module(comm, model)  # identical start on every rank, whatever their seeds did
    accumulation = cfg.trainer.accumulation_steps
    sync = build_gradient_sync(model, build_optimizer(cfg.optim, model.parameters()), comm, cfg.comm, accumulation)
    optimizer = sync.optimizer
    loss_fn = nn.CrossEntropyLoss()
    sampler = ShardSampler(info.num_train, cfg.data.batch_size, comm.rank, comm.world_size, cfg.trainer.seed)
    steps_per_epoch = max(1, sampler.steps_per_epoch // accumulation)
    max_steps = cfg.trainer.max_steps
    total_steps = min(max_steps or 1 << 62, cfg.trainer.epochs * steps_per_epoch)
    schedule = build_schedule(cfg.optim, optimizer, total_steps)
    coordinator, progress, resumed_from = resume_or_start(cfg, comm, run, model, optimizer, schedule)
    loss, accuracy, samples_per_s, step_ms, comm_wait_ms = float("nan"), 0.0, 0.0, 0.0, 0.0
    stopped_by: str | None = None
    log.info(
        "training %s on %s: %d train / %d test samples, %d ranks x batch %d x %d micro-batches, %d steps per epoch, "
        "allreduce %s, buckets %.1f MiB, overlap %s, compression %s",
        cfg.model.name, data_path.name, info.num_train, info.num_test, comm.world_size, cfg.data.batch_size, accumulation,
        steps_per_epoch, cfg.comm.algorithm, cfg.comm.bucket_mb, cfg.comm.overlap, cfg.comm.compression,
    )

    def save(synchronous: bool) -> None:
        if coordinator is not None:
            model_config = {"name": cfg.model.name, "input_shape": list(info.input_shape), "num_classes": info.num_classes}
            coordinator.save(
                progress.step,
                lambda: shared_state(model, optimizer, schedule, progress, model_config, run.config_text),
                {"rng": rng_state()},
                synchronous,
            )

    train = H5Split(data_path, cfg.data.train_x, cfg.data.train_y)
    test = H5Split(data_path, cfg.data.test_x, cfg.data.test_y)
    try:
        while progress.epoch <= cfg.trainer.epochs and not stopped_by and not (max_steps is not None and progress.step >= max_steps):
            epoch = progress.epoch
            started, waited, step_loss, step_seen = time.perf_counter(), 0.0, 0.0, 0
            optimizer.zero_grad()  # set_to_none by default (Horovod's wrapper takes no arguments)
            for micro, indices in enumerate(sampler.batches(epoch, start=progress.position), start=1):
                x, y = train.read(indices)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with sync.micro_step(last=micro % accumulation == 0):  # no communication on micro-steps
                    batch_loss = loss_fn(sync.module(x), y)
                    (batch_loss / accumulation).backward()
                step_loss += batch_loss.item() * len(y)
                step_seen += len(y)
                if micro % accumulation:
                    continue  # accumulation micro-step: gradients stay local
                waited -= sync.comm_wait_s
                optimizer.step()
                waited += sync.comm_wait_s
                schedule.step()
                optimizer.zero_grad()
                progress.step += 1
                progress.epoch_steps += 1
                progress.position += accumulation * sampler.global_batch
                # One tiny collective per step: the averaged loss, the stop vote, the save handshake.
                written = coordinator.written_flag() if coordinator else 1.0
                total_loss, total_seen, stop_votes, ranks_written = allreduce_sums(comm, [step_loss, step_seen, float(run.stop.raised), written])
                progress.epoch_loss_sum += total_loss  # global sums: the same on every rank, so
                progress.epoch_seen += int(total_seen)  # rank 0's checkpoint restores them all
                run.step_log.write({"step": progress.step, "epoch": epoch, "loss": total_loss / max(total_seen, 1)})
                step_loss, step_seen = 0.0, 0
                if coordinator is not None:
                    coordinator.on_step_boundary(ranks_written)
                if stop_votes:
                    stopped_by = run.stop.signal_name or "a signal on another rank"
                    break
                if max_steps is not None and progress.step >= max_steps:
                    break
                if coordinator is not None and coordinator.due(progress.step):
                    save(synchronous=False)
            progress.epoch_seconds += time.perf_counter() - started
            if stopped_by:
                break  # the partial epoch is evaluated after the restart
            # Throughput is set by the slowest rank: every rank reports that one figure.
            slowest = torch.tensor([progress.epoch_seconds, waited], dtype=torch.float64)
            comm.allreduce_(slowest, op="max")
            epoch_seconds, waited = slowest.tolist()
            progress.train_seconds += epoch_seconds
            loss = progress.epoch_loss_sum / max(progress.epoch_seen, 1)
            samples_per_s = progress.epoch_seen / epoch_seconds if epoch_seconds > 0 else 0.0
            step_ms = 1000 * epoch_seconds / max(progress.epoch_steps, 1)
            comm_wait_ms = 1000 * waited / max(progress.epoch_steps, 1)
            average_buffers(comm, model)
            accuracy = evaluate(model, test, comm, cfg.data.eval_batch_size, device)
            log.info("epoch %d/%d  loss %.4f  test_acc %.4f  samples/s %.0f", epoch, cfg.trainer.epochs, loss, accuracy, samples_per_s)
            metrics.write({
                "epoch": epoch, "step": progress.step, "loss": loss, "test_accuracy": accuracy, "samples_per_s": samples_per_s,
                "step_ms": step_ms, "comm_wait_ms": comm_wait_ms, "world_size": comm.world_size,
            })
            progress.next_epoch()
        save(synchronous=True)  # the last save before exit is synchronous
    finally:
        if coordinator is not None:
            coordinator.checkpointer.wait_pruned()
        train.close()
        test.close()
        sync.close()
    return FitResult(progress.epoch - 1, progress.step, loss, accuracy, samples_per_s,
                     progress.train_seconds, step_ms, comm_wait_ms, stopped_by, resumed_from)


def resume_or_start(cfg: FitConfig, comm: Collectives, run: RunContext, model: nn.Module, optimizer: torch.optim.Optimizer, schedule) -> tuple[SaveCoordinator | None, Progress, int | None]:  # type: ignore[no-untyped-def]
    if not cfg.checkpoint.enabled or run.checkpoint_dir is None:
        return None, Progress(), None
    checkpointer = Checkpointer(run.checkpoint_dir, comm.rank, comm.world_size, cfg.checkpoint.keep)
    coordinator = SaveCoordinator(checkpointer, comm, cfg.checkpoint)
    restored = checkpointer.load_latest() if cfg.checkpoint.resume else None
    chosen = torch.tensor([restored[0] if restored else -1, -(restored[0] if restored else -1)], dtype=torch.float64)
    comm.allreduce_(chosen, op="max")
    if chosen[0] != -chosen[1]:
        raise CheckpointError(f"ranks found different newest checkpoints (steps {int(-chosen[1])}..{int(chosen[0])}); check the shared file system")
    if restored is None:
        return coordinator, Progress(), None
    step, shared, own = restored
    progress = restore(model, optimizer, schedule, step, shared)
    if own is not None:
        restore_rng(own["rng"])
    log.info("resumed from checkpoint step %d (epoch %d, sample %d)%s", step, progress.epoch, progress.position,
             "" if own is not None else "; world size changed: data re-sharded by global sample index, fresh RNG")
    return coordinator, progress, step
