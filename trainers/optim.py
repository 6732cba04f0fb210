"""Optimizer and learning-rate schedule from their config: the built-in ones (SGD or AdamW; linear
warm-up, then cosine or constant), or any torch class the config names by `_target_`."""

from __future__ import annotations

import inspect
import io
import math
from collections.abc import Iterable
from typing import Any

import torch

from trainers.config import SCHEDULES, OptimConfig, closure_refusal
from trainers.targets import instantiate
from trainers.task import TaskError


def build_optimizer(cfg: OptimConfig, params: Iterable[Any], lr: float | None = None) -> torch.optim.Optimizer:
    """`params`: the model's parameters, or parameter groups (dicts with "params")."""
    lr = cfg.lr if lr is None else lr
    if cfg.optimizer:
        optimizer = instantiate(cfg.optimizer, "optim.optimizer", (params,), {"lr": lr}, base=torch.optim.Optimizer)
        needs = [
            p.name for p in inspect.signature(optimizer.step).parameters.values() if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        if needs:
            raise TaskError(closure_refusal(str(cfg.optimizer["_target_"]), needs[0]))
        return checked_state(optimizer, "optim.optimizer")
    params = list(params)
    if cfg.name == "sgd":
        return fused_if_possible(torch.optim.SGD, params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, nesterov=cfg.nesterov)
    if cfg.name == "adamw":
        beta1, beta2 = cfg.betas if cfg.betas is not None else (cfg.momentum, 0.999)
        return fused_if_possible(torch.optim.AdamW, params, lr=lr, betas=(beta1, beta2), weight_decay=cfg.weight_decay)
    raise ValueError(f"unknown optimizer {cfg.name!r}; choose sgd or adamw")


def fused_if_possible(kind: type[torch.optim.Optimizer], params: list[Any], **options: Any) -> torch.optim.Optimizer:
    """The fused kernels (one per parameter group and device, on GPUs and CPUs): fewer launches,
    and a step they skip themselves when the gradients are not finite (`step_unless`), so the
    loop never waits for the device to decide. torch refuses them for some devices and dtypes,
    and FSDP2's sharded parameters (DTensors) have no sharding rule for fused SGD: the plain
    implementation there."""
    if any(type(p).__name__ == "DTensor" for group in params for p in (group["params"] if isinstance(group, dict) else [group])):
        return kind(params, **options)
    try:
        return kind(params, fused=True, **options)  # type: ignore[call-arg]
    except (RuntimeError, ValueError):
        return kind(params, **options)


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether optimizer.step() can skip itself on a device-side flag (torch's fused kernels take
    the flag GradScaler passes them, as the attribute `found_inf`)."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False) or not all(group.get("fused") for group in optimizer.param_groups):
        return False
    if isinstance(optimizer, torch.optim.SGD) and not getattr(optimizer, "_hpctk_momentum_ready", False):
        # torch's fused SGD leaves the momentum buffer it creates in a skipped first step
        # uninitialised (seen with torch 2.13 on the CPU): the host decides until every buffer
        # exists (then they stay: the answer is kept, not looked up again every step).
        ready = all(
            group["momentum"] == 0 or all(optimizer.state.get(p, {}).get("momentum_buffer") is not None for p in group["params"] if p.requires_grad)
            for group in optimizer.param_groups
        )
        optimizer._hpctk_momentum_ready = ready  # type: ignore[attr-defined]
        return ready
    return True


def step_unless(optimizer: torch.optim.Optimizer, nonfinite: torch.Tensor) -> None:
    """optimizer.step(), skipped (parameters and state untouched) where `nonfinite`, a 0-dim
    tensor, is 1: decided on the device where the optimizer can, else read on the host."""
    if not skips_on_device(optimizer):
        if not bool(nonfinite):  # the one extra wait for the device, for an optimizer that cannot skip itself
            optimizer.step()
        return
    device = next((p.device for group in optimizer.param_groups for p in group["params"]), nonfinite.device)
    if nonfinite.device != device or nonfinite.dtype != torch.float32:
        nonfinite = nonfinite.to(device=device, dtype=torch.float32)
    optimizer.found_inf = nonfinite  # type: ignore[attr-defined]
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf  # type: ignore[attr-defined]


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str, floor: float = 0.0) -> float:
    """Multiplier of the base lr at `step`: linear warm-up from 1/100, then the schedule (the
    cosine from 1 down to `floor`)."""
    warm = min(1.0, 0.01 + 0.99 * step / warmup_steps) if warmup_steps > 0 else 1.0
    if schedule == "cosine":
        return warm * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * min(step, total_steps) / max(total_steps, 1))))
    if schedule == "constant":
        return warm
    raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")


def build_schedule(cfg: OptimConfig, optimizer: torch.optim.Optimizer, total_steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    if cfg.scheduler:
        schedule = instantiate(cfg.scheduler, "optim.scheduler", (optimizer,), {"total_steps": total_steps}, base=torch.optim.lr_scheduler.LRScheduler)
        if isinstance(schedule, torch.optim.lr_scheduler.ReduceLROnPlateau):
            target = cfg.scheduler["_target_"]
            raise TaskError(f"optim.scheduler._target_={target} steps on a metric; the toolkit steps schedulers once per optimizer step, without one")
        return checked_state(schedule, "optim.scheduler")
    floor = cfg.min_lr / cfg.lr if cfg.lr > 0 else 0.0  # a fraction of the base lr: scaled with it
    lr_factor(0, total_steps, cfg.warmup_steps, cfg.schedule, floor)  # unknown schedules fail here, not at step 1
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, cfg.warmup_steps, cfg.schedule, floor))


def checked_state(owner: Any, key: str) -> Any:
    """`owner`, once its state_dict is shown to load as checkpoints load (weights only: tensors,
    numbers, strings): a class whose state holds anything else would save but never resume."""
    buffer = io.BytesIO()
    try:
        torch.save(owner.state_dict(), buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception as err:  # torch's UnpicklingError names the type it refused
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise TaskError(f"{key}: the state of {type(owner).__name__} cannot be checkpointed safely (only tensors, numbers and strings load): {first}") from None
    return owner
