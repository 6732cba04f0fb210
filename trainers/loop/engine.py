"""The engine: the model and what updates it (gradient sync, optimizer, schedule, loss scaler),
built once per run. It runs a micro-batch forward and backward and the optimizer step on averaged
gradients; it knows nothing of data, votes or checkpoints beyond fencing an asynchronous save."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from collectives.base import Collectives, broadcast_module
from collectives.fsdp import shard_model
from collectives.gradsync import GradientSync, build_gradient_sync
from trainers.checkpoint.saving import SaveCoordinator
from trainers.config import scaled_lr
from trainers.context import FitConfig
from trainers.loop.records import Update
from trainers.optim import build_optimizer, build_schedule, step_unless
from trainers.recompute import recompute_in_backward
from trainers.task import Place, StepOutput, Task, TaskError


@dataclass
class Engine:
    """Model, gradient sync, optimizer, schedule and scaler, as one run trains them."""

    model: nn.Module
    sync: GradientSync
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    accumulation: int  # micro-batches per step
    device_type: str  # "cpu", "cuda": autocast's
    clip_grad_norm: float | None = None
    autocast_dtype: torch.dtype | None = None
    train_module: nn.Module | None = None  # what the training step runs: the synced module, compiled with trainer.compile

    def forward_backward(self, task: Task, batch: Any, last: bool) -> StepOutput:
        """One micro-batch; gradients travel only on a step's `last` one."""
        with self.sync.micro_step(last=last):  # no communication on micro-steps
            with torch.autocast(self.device_type, dtype=self.autocast_dtype) if self.autocast_dtype else contextlib.nullcontext():
                out = task.train_step(self.sync.module if self.train_module is None else self.train_module, batch)
            check_loss(out)
            self.scaler.scale(out.loss / self.accumulation if self.accumulation > 1 else out.loss).backward()
        return out

    def update(self, coordinator: SaveCoordinator | None) -> Update:
        """The optimizer step on averaged gradients, skipped where they are not finite; the
        step's non-finite flag and gradient norm (tensors on the device: read with the step's sums)."""
        scaler = self.scaler
        lr = host_number(self.optimizer.param_groups[0]["lr"])  # the schedule's, before it steps
        scaler.unscale_(self.optimizer)
        # fp16: the scaler skips such steps itself, and lowers its scale (not a bad step)
        nonfinite = 0.0 if scaler.is_enabled() else self.sync.nonfinite(self.model)
        grad_norm: torch.Tensor | float = 0.0
        if self.clip_grad_norm is not None:  # the global norm, also over sharded gradients (a skipped step's are dropped)
            grad_norm = self.sync.clip_grad_norm_(self.model, self.clip_grad_norm)
        if coordinator is not None:
            coordinator.fence()  # an asynchronous save still copying what this step changes
        with self.sync.step_context():
            if isinstance(nonfinite, torch.Tensor):
                step_unless(self.optimizer, nonfinite)
            else:
                scaler.step(self.optimizer)  # skipped (and the scale lowered) on inf/nan gradients in fp16
        scaler.update()
        self.schedule.step()
        self.optimizer.zero_grad()
        return Update(nonfinite, grad_norm, lr)

    def stepped_tensors(self) -> Callable[[torch.Tensor], bool]:
        """Whether a tensor of the state is a parameter or optimizer state: only the optimizer
        step changes those (buffers change in forward, and are copied at once)."""
        live = {p.data_ptr() for p in self.model.parameters()}
        live |= {t.data_ptr() for state in self.optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)}
        return lambda tensor: tensor.numel() > 0 and tensor.data_ptr() in live


def build_engine(cfg: FitConfig, comm: Collectives, task: Task, model: nn.Module, accumulation: int, total_steps: int) -> Engine:
    """The optimizer at the global batch's learning rate, the gradient sync of comm.*, the
    schedule over `total_steps`, the scaler of trainer.precision, compiled with trainer.compile."""
    global_batch = accumulation * cfg.data.batch_size * comm.world_size
    optimizer = build_optimizer(cfg.optim, task.param_groups(model), scaled_lr(cfg.optim, global_batch))
    sync = build_gradient_sync(model, optimizer, comm, cfg.comm, accumulation)
    # Compiled for training only: evaluation's eval mode would compile a second graph. The state
    # saved is the plain model's (no `_orig_mod.` prefix), so a resume may switch compile.
    train_module = compiled(sync.module, cfg.trainer.compile_backend) if cfg.trainer.compile else None
    return Engine(
        model,
        sync,
        sync.optimizer,
        build_schedule(cfg.optim, sync.optimizer, total_steps),
        torch.amp.GradScaler(comm.device.type, enabled=cfg.trainer.precision == "fp16"),
        accumulation,
        comm.device.type,
        cfg.trainer.clip_grad_norm,
        {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.trainer.precision),
        train_module,
    )


def placed_model(cfg: FitConfig, comm: Collectives, task: Task) -> nn.Module:
    """The task's model on this rank's device, the same on every rank, as the trainer settings
    shape it (SyncBatchNorm, channels_last, recomputation in backward) and sharded for
    comm.sharding=full, before any optimizer sees its parameters."""
    task.set_place(Place(comm.rank, comm.world_size, comm.device))
    torch.manual_seed(cfg.trainer.seed)
    if cfg.trainer.deterministic:
        apply_deterministic_kernels()
    memory_format = torch.channels_last if cfg.trainer.channels_last else torch.contiguous_format  # 4-D parameters only
    model = task.build_model()
    if cfg.trainer.sync_batchnorm:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(comm.device, memory_format=memory_format)  # type: ignore[call-overload]  # torch stubs lack memory_format
    if cfg.trainer.activation_checkpointing:
        recompute_in_backward(task.checkpointed_modules(model))
    broadcast_module(comm, model)  # identical start on every rank, whatever their seeds did
    if cfg.comm.sharding == "full":  # before the optimizer: FSDP2 replaces the parameters with their shards
        model = shard_model(model, sharding_units(task, model))
    return model


def apply_deterministic_kernels() -> None:
    """Kernels whose results do not depend on scheduling (GPU atomics, autotuning), before the
    first cuBLAS call: CUBLAS_WORKSPACE_CONFIG is read when cuBLAS starts. An op torch has no
    deterministic kernel for (some pooling backwards on CUDA) warns, naming itself, and runs.
    The settings are the process's: they stay for the rest of it (a rank trains once)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False


def sharding_units(task: Task, model: nn.Module) -> list[nn.Module]:
    """What comm.sharding=full shards one by one: the task's checkpointed_modules (a transformer's
    blocks) where it names them; else the model as one unit."""
    try:
        return list(task.checkpointed_modules(model) or [])
    except TaskError:
        return []


def compiled(module: nn.Module, backend: str) -> nn.Module:
    known = torch.compiler.list_backends(exclude_tags=())
    if backend not in known:
        raise TaskError(f"trainer.compile_backend={backend!r} is not a torch.compile backend here; one of {', '.join(sorted(known))}")
    return cast(nn.Module, torch.compile(module, backend=backend))  # an OptimizedModule


def host_number(value: Any) -> float:
    """A learning rate as a Python number, without waiting for a device (a tensor lr on a GPU, as
    capturable optimizers keep it, is not read: NaN)."""
    if isinstance(value, torch.Tensor):
        return float(value) if value.device.type == "cpu" else math.nan
    return float(value)


def check_loss(out: StepOutput) -> None:
    loss = out.loss
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0 or not loss.dtype.is_floating_point:
        shown = f"a {type(loss).__name__}" if not isinstance(loss, torch.Tensor) else f"a tensor of shape {tuple(loss.shape)}"
        raise TaskError(f"the training step returned {shown} as its loss; return the batch's mean loss as a scalar float tensor")
