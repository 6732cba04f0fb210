"""Optimizer and learning-rate schedule from their config: linear warm-up, then cosine or constant."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from trainers.config import SCHEDULES, OptimConfig


def build_optimizer(cfg: OptimConfig, params: Iterable[nn.Parameter], lr: float | None = None) -> torch.optim.Optimizer:
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
