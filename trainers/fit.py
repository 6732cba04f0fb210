"""The data-parallel training loop."""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from collectives.base import Collectives, allreduce_sums, broadcast_module
from collectives.config import CommConfig
from trainers.checkpoint import Checkpointer, CheckpointError
from trainers.config import (
    SCHEDULES,
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    TrainerConfig,
    accumulation_steps,
    scaled_lr,
)
from trainers.data import H5Split, Prefetcher
from trainers.datasets import inspect_hdf5
from trainers.gradsync import build_gradient_sync
from trainers.guard import BadStepGuard, grads_finite, skip_past
from trainers.metrics import MetricsWriter
from trainers.models import build_model
from trainers.preemption import StopFlag
from trainers.reporting import PHASES, StepReporter, Straggler, find_straggler
from trainers.sampler import ShardSampler, eval_shard
from trainers.saving import SaveCoordinator
from trainers.state import Progress, restore, restore_rng, rng_state, shared_state
from trainers.watchdog import Watchdog

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


def build_optimizer(cfg: OptimConfig, params, lr: float | None = None) -> torch.optim.Optimizer:  # type: ignore[no-untyped-def]
    lr = cfg.lr if lr is None else lr
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, nesterov=cfg.nesterov)
    if cfg.name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=(cfg.momentum, 0.999), weight_decay=cfg.weight_decay)
    raise ValueError(f"unknown optimizer {cfg.name!r}; choose sgd or adamw")


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str) -> float:
    """Multiplier of the base lr at `step`: linear warm-up from 1/100, then the schedule."""
    warm = min(1.0, 0.01 + 0.99 * step / warmup_steps) if warmup_steps > 0 else 1.0
    if schedule == "cosine":
        return warm * 0.5 * (1.0 + math.cos(math.pi * min(step, total_steps) / max(total_steps, 1)))
    if schedule == "constant":
        return warm
    raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")


def build_schedule(cfg: OptimConfig, optimizer: torch.optim.Optimizer, total_steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    lr_factor(0, total_steps, cfg.warmup_steps, cfg.schedule)  # unknown schedules fail here, not at step 1
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, cfg.warmup_steps, cfg.schedule))


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
    steps: StepReporter = field(default_factory=lambda: StepReporter(None))
    host: str = field(default_factory=socket.gethostname)  # named in straggler reports
    watchdog: Watchdog | None = None  # told of every finished step


def fit(cfg: FitConfig, comm: Collectives, data_path: Path, metrics: MetricsWriter, run: RunContext | None = None) -> FitResult:
    run = run or RunContext()
    info = inspect_hdf5(data_path, cfg.data)
    torch.manual_seed(cfg.trainer.seed)
    device: torch.device = getattr(comm, "device", torch.device("cpu"))
    memory_format = torch.channels_last if cfg.trainer.channels_last and len(info.input_shape) == 3 else torch.contiguous_format
    model = build_model(cfg.model, info.input_shape, info.num_classes)
    if cfg.trainer.sync_batchnorm:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device, memory_format=memory_format)
    broadcast_module(comm, model)  # identical start on every rank, whatever their seeds did
    accumulation = accumulation_steps(cfg.trainer, cfg.data.batch_size, comm.world_size)
    global_batch = accumulation * cfg.data.batch_size * comm.world_size
    optimizer = build_optimizer(cfg.optim, model.parameters(), scaled_lr(cfg.optim, global_batch))
    sync = build_gradient_sync(model, optimizer, comm, cfg.comm, accumulation)
    optimizer = sync.optimizer
    precision = cfg.trainer.precision
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    loss_fn = nn.CrossEntropyLoss()
    sampler = ShardSampler(info.num_train, cfg.data.batch_size, comm.rank, comm.world_size, cfg.trainer.seed)
    steps_per_epoch = max(1, sampler.steps_per_epoch // accumulation)
    max_steps = cfg.trainer.max_steps
    total_steps = min(max_steps or 1 << 62, cfg.trainer.epochs * steps_per_epoch)
    schedule = build_schedule(cfg.optim, optimizer, total_steps)
    coordinator, progress, resumed_from = resume_or_start(cfg, comm, run, model, optimizer, schedule, scaler)
    loss, accuracy, samples_per_s, step_ms, comm_wait_ms = float("nan"), 0.0, 0.0, 0.0, 0.0
    stopped_by: str | None = None
    log.info(
        "training %s on %s: %d train / %d test samples, %d ranks x batch %d x %d micro-batches, %d steps per epoch, "
        "comm %s (allreduce %s, buckets %.1f MiB, overlap %s, compression %s), global batch %d, lr %g, precision %s",
        cfg.model.name, data_path.name, info.num_train, info.num_test, comm.world_size, cfg.data.batch_size, accumulation,
        steps_per_epoch, cfg.comm.backend, cfg.comm.algorithm, cfg.comm.bucket_mb, cfg.comm.overlap, cfg.comm.compression,
        global_batch, optimizer.param_groups[0]["initial_lr"], precision,
    )

    def save(synchronous: bool) -> None:
        if coordinator is not None:
            model_config = {"name": cfg.model.name, "input_shape": list(info.input_shape), "num_classes": info.num_classes}
            coordinator.save(
                progress.step,
                lambda: shared_state(model, optimizer, schedule, progress, model_config, run.config_text, scaler),
                {"rng": rng_state()},
                synchronous,
            )

    train = H5Split(data_path, cfg.data.train_x, cfg.data.train_y)
    test = H5Split(data_path, cfg.data.test_x, cfg.data.test_y)
    run.steps.total_steps = total_steps if total_steps < 1 << 62 else None
    watch = StragglerWatch(comm, run.host, cfg.trainer.straggler_every, cfg.trainer.straggler_ratio)
    guard = BadStepGuard(cfg.trainer.max_bad_steps)
    try:
        while progress.epoch <= cfg.trainer.epochs and not stopped_by and not (max_steps is not None and progress.step >= max_steps):
            epoch = progress.epoch
            started, waited, data_waited, step_loss, step_seen, step_correct = time.perf_counter(), 0.0, 0.0, 0.0, 0, 0
            optimizer.zero_grad()  # set_to_none by default (Horovod's wrapper takes no arguments)
            skip_past(progress)  # data of rolled-back steps is never trained on again
            rollback_range: list[int] | None = None
            batches = Prefetcher(train, sampler.batches(epoch, start=progress.position), pin=device.type == "cuda")
            step_started, step_data_wait = time.perf_counter(), 0.0
            try:
                for micro, (raw_x, y) in enumerate(batches, start=1):
                    x = train.decode(raw_x, device)  # uint8 travels, float32 is made on the device
                    x = x.contiguous(memory_format=memory_format) if x.dim() == 4 else x
                    y = y.to(device, non_blocking=True)
                    with sync.micro_step(last=micro % accumulation == 0):  # no communication on micro-steps
                        with torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext():
                            output = sync.module(x)
                            batch_loss = loss_fn(output, y)
                        scaler.scale(batch_loss / accumulation).backward()
                    step_loss += batch_loss.item() * len(y)  # .item() waits for the device: phases are real
                    step_correct += int((output.detach().argmax(dim=1) == y).sum())
                    step_seen += len(y)
                    if micro % accumulation:
                        continue  # accumulation micro-step: gradients stay local
                    synced_at = time.perf_counter()
                    waited -= sync.comm_wait_s
                    sync.synchronize()  # averaged gradients, before unscaling or clipping them
                    waited += sync.comm_wait_s
                    optimizer_at = time.perf_counter()
                    scaler.unscale_(optimizer)
                    finite = scaler.is_enabled() or grads_finite(model)  # fp16: the scaler skips such steps itself
                    if finite and cfg.trainer.clip_grad_norm is not None:
                        nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.clip_grad_norm)
                    if finite:
                        with sync.step_context():
                            scaler.step(optimizer)  # skipped (and the scale lowered) on inf/nan gradients in fp16
                    scaler.update()
                    schedule.step()
                    optimizer.zero_grad()
                    progress.step += 1
                    progress.epoch_steps += 1
                    position_before = progress.position
                    progress.position += accumulation * sampler.global_batch
                    guard.record(finite, progress, position_before)
                    # The step's time split; data wait is what the prefetcher made this rank wait.
                    done_at, data_s = time.perf_counter(), batches.wait_s - step_data_wait
                    phases = [data_s, synced_at - step_started - data_s, optimizer_at - synced_at, done_at - optimizer_at]
                    # One tiny collective per step: averaged loss, accuracy and phases, the stop vote, the save handshake.
                    written = coordinator.written_flag() if coordinator else 1.0
                    time_vote = coordinator.time_vote() if coordinator else 0.0
                    total_loss, total_seen, total_correct, stop_votes, ranks_written, time_votes, *phase_sums = allreduce_sums(
                        comm, [step_loss, step_seen, step_correct, float(run.stop.raised), written, time_vote, *phases])
                    progress.epoch_loss_sum += total_loss if finite else 0.0  # global sums: the same on every rank, so
                    progress.epoch_seen += int(total_seen)  # rank 0's checkpoint restores them all
                    step_s = time.perf_counter() - step_started
                    record = {"step": progress.step, "epoch": epoch, "loss": total_loss / max(total_seen, 1), "accuracy": total_correct / max(total_seen, 1),
                              "samples_per_s": total_seen / step_s, "step_ms": 1000 * step_s,
                              "bad_steps": progress.bad_steps, "rollbacks": progress.rollbacks,
                              **{f"{name}_ms": 1000 * value / comm.world_size for name, value in zip(PHASES, phase_sums, strict=True)}}
                    if not finite:
                        record["skipped"] = True
                        log.warning("step %d: non-finite gradients (loss %g): update skipped (%d in a row, %d in all)",
                                    progress.step, record["loss"], guard.in_a_row, progress.bad_steps)
                    # Compared: the time a rank was busy (not waiting for the others in a collective,
                    # which every rank does until the slowest arrives, so step times come out equal).
                    straggler = watch.step(progress.step, phases[0] + phases[1] + phases[3])
                    if straggler is not None:
                        log.warning("%s", straggler.line())
                        record["straggler"] = {"rank": straggler.rank, "host": straggler.host, "step_ms": straggler.step_ms, "median_ms": straggler.median_ms}
                    run.steps.report(record)
                    if run.watchdog is not None:
                        run.watchdog.beat(progress.step)
                    step_loss, step_seen, step_correct = 0.0, 0, 0
                    step_started, step_data_wait = time.perf_counter(), batches.wait_s
                    if coordinator is not None:
                        coordinator.on_step_boundary(ranks_written)
                    if stop_votes:
                        stopped_by = run.stop.signal_name or "a signal on another rank"
                        break
                    if max_steps is not None and progress.step >= max_steps:
                        break
                    if guard.must_roll_back:
                        rollback_range = guard.bad_range(progress)
                        break
                    if any(e == progress.epoch and start == progress.position for e, start, _ in progress.skip):
                        break  # a range to skip starts here: the outer loop restarts past it
                    if coordinator is not None and coordinator.due(progress.step, time_votes):
                        save(synchronous=False)
            finally:
                batches.close()
            data_waited += batches.wait_s
            progress.epoch_seconds += time.perf_counter() - started
            if stopped_by:
                break  # the partial epoch is evaluated after the restart
            if rollback_range is not None:
                progress = roll_back(comm, coordinator, model, optimizer, schedule, scaler, progress, rollback_range)
                guard.reset()
                continue
            if any(e == progress.epoch and start <= progress.position < end for e, start, end in progress.skip):
                continue  # the epoch goes on past the skipped range
            # Throughput is set by the slowest rank: every rank reports that one figure.
            slowest = torch.tensor([progress.epoch_seconds, waited, data_waited], dtype=torch.float64)
            comm.allreduce_(slowest, op="max")
            epoch_seconds, waited, data_waited = slowest.tolist()
            progress.train_seconds += epoch_seconds
            loss = progress.epoch_loss_sum / max(progress.epoch_seen, 1)
            samples_per_s = progress.epoch_seen / epoch_seconds if epoch_seconds > 0 else 0.0
            step_ms = 1000 * epoch_seconds / max(progress.epoch_steps, 1)
            comm_wait_ms = 1000 * waited / max(progress.epoch_steps, 1)
            data_wait_ms = 1000 * data_waited / max(progress.epoch_steps, 1)
            average_buffers(comm, model)
            accuracy = evaluate(model, test, comm, cfg.data.eval_batch_size, device)
            log.info("epoch %d/%d  loss %.4f  test_acc %.4f  samples/s %.0f", epoch, cfg.trainer.epochs, loss, accuracy, samples_per_s)
            run.steps.scalar("test/accuracy", accuracy, progress.step)
            metrics.write({
                "epoch": epoch, "step": progress.step, "loss": loss, "test_accuracy": accuracy, "samples_per_s": samples_per_s,
                "step_ms": step_ms, "comm_wait_ms": comm_wait_ms, "data_wait_ms": data_wait_ms, "world_size": comm.world_size,
            })
            if progress.position + accumulation * sampler.global_batch <= sampler.steps_per_epoch * sampler.global_batch:
                break  # max_steps ended the epoch midway: a later run with more steps goes on from here
            progress.next_epoch()
        save(synchronous=True)  # the last save before exit is synchronous
    finally:
        if coordinator is not None:
            coordinator.checkpointer.wait_pruned()
        train.close()
        test.close()
        sync.close()
        run.steps.close()
    return FitResult(progress.epoch - 1, progress.step, loss, accuracy, samples_per_s,
                     progress.train_seconds, step_ms, comm_wait_ms, stopped_by, resumed_from)


class StragglerWatch:
    """Every `every` steps, all ranks share their mean busy time per step since the last check
    (one allgather): data wait, forward+backward and optimizer, without the gradient wait. The
    slowest is reported when above `ratio` x the median. The hosts are gathered once, at the
    first check. With DDP (gloo, nccl) the last gradient bucket's wait falls inside backward, so
    there a straggler shows less clearly."""

    def __init__(self, comm: Collectives, host: str, every: int, ratio: float) -> None:
        self._comm, self._host, self._every, self._ratio = comm, host, every, ratio
        self._hosts: list[str] | None = None
        self._seconds, self._steps = 0.0, 0

    def step(self, step: int, seconds: float) -> Straggler | None:
        self._seconds, self._steps = self._seconds + seconds, self._steps + 1
        if self._every <= 0 or self._comm.world_size < 2 or step % self._every:
            return None  # the same decision on every rank: the step counts agree
        if self._hosts is None:
            encoded = torch.zeros(64, dtype=torch.float64)  # a dtype every backend reduces and gathers
            name = self._host.encode()[:64]
            encoded[: len(name)] = torch.tensor(list(name), dtype=torch.float64)
            gathered = self._comm.allgather(encoded).reshape(self._comm.world_size, 64)
            self._hosts = [bytes(int(v) for v in row.tolist()).rstrip(b"\0").decode(errors="replace") for row in gathered]
        mean_ms = torch.tensor([1000 * self._seconds / self._steps], dtype=torch.float64)
        self._seconds, self._steps = 0.0, 0
        return find_straggler(self._comm.allgather(mean_ms).tolist(), self._hosts, self._ratio)


def agree_on_newest(comm: Collectives, step: int | None) -> None:
    """Every rank must have found the same newest checkpoint (None: none); one max-allreduce of
    (step, -step) shows the highest and the lowest."""
    found = torch.tensor([step if step is not None else -1, -(step if step is not None else -1)], dtype=torch.float64)
    comm.allreduce_(found, op="max")
    if found[0] != -found[1]:
        raise CheckpointError(f"ranks found different newest checkpoints (steps {int(-found[1])}..{int(found[0])}); check the shared file system")


def roll_back(comm: Collectives, coordinator: SaveCoordinator | None, model: nn.Module, optimizer: torch.optim.Optimizer, schedule,  # type: ignore[no-untyped-def]
              scaler: torch.amp.GradScaler, progress: Progress, bad_range: list[int]) -> Progress:
    """Back to the newest committed checkpoint after too many non-finite steps in a row; the
    data of those steps is skipped from now on (the record travels in every later checkpoint)."""
    restored = coordinator.checkpointer.load_latest() if coordinator is not None else None
    agree_on_newest(comm, restored[0] if restored else None)
    if restored is None:  # nothing to go back to; the weights are still finite (no bad update was applied)
        progress.skip = [*progress.skip, bad_range]
        log.warning("non-finite steps in a row but no committed checkpoint yet: going on without a rollback; "
                    "samples %d..%d of epoch %d are skipped from now on", bad_range[1], bad_range[2], bad_range[0])
        return progress
    step, shared, _ = restored
    back = restore(model, optimizer, schedule, step, shared, scaler)
    back.bad_steps, back.rollbacks, back.skip = progress.bad_steps, progress.rollbacks + 1, [*progress.skip, bad_range]
    optimizer.zero_grad()
    log.warning("rolled back from step %d to checkpoint step %d after non-finite steps; samples %d..%d of epoch %d are skipped from now on",
                progress.step, step, bad_range[1], bad_range[2], bad_range[0])
    return back


def resume_or_start(cfg: FitConfig, comm: Collectives, run: RunContext, model: nn.Module, optimizer: torch.optim.Optimizer, schedule,  # type: ignore[no-untyped-def]
                    scaler: torch.amp.GradScaler | None = None) -> tuple[SaveCoordinator | None, Progress, int | None]:
    if not cfg.checkpoint.enabled or run.checkpoint_dir is None:
        return None, Progress(), None
    checkpointer = Checkpointer(run.checkpoint_dir, comm.rank, comm.world_size, cfg.checkpoint.keep)
    coordinator = SaveCoordinator(checkpointer, comm, cfg.checkpoint)
    restored = checkpointer.load_latest() if cfg.checkpoint.resume else None
    agree_on_newest(comm, restored[0] if restored else None)
    if restored is None:
        return coordinator, Progress(), None
    step, shared, own = restored
    progress = restore(model, optimizer, schedule, step, shared, scaler)
    if own is not None:
        restore_rng(own["rng"])
    log.info("resumed from checkpoint step %d (epoch %d, sample %d)%s", step, progress.epoch, progress.position,
             "" if own is not None else "; world size changed: data re-sharded by global sample index, fresh RNG")
    return coordinator, progress, step
