"""Checks on gradients every rank holds whole (replicated data parallel): torch's own, on the model.

Both stay on the gradients' device: a training step reads nothing back to the host here (the loop
reads the non-finite flag once, with the step's other figures, a step later)."""

from __future__ import annotations

import torch
from torch import nn


def nonfinite(model: nn.Module) -> torch.Tensor:
    """1.0 where any gradient holds an inf or NaN, else 0.0: a 0-dim float32 tensor on the
    gradients' device (the CPU when there are none)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    norms = torch._foreach_norm(grads)  # one fused pass; a NaN or Inf anywhere shows in its tensor's norm
    return torch.isfinite(torch.stack([n.float() for n in norms])).all().logical_not().float()


def grads_finite(model: nn.Module) -> bool:
    """Whether every gradient is finite, read on the host (one wait for the device)."""
    return not bool(nonfinite(model))


class ReplicatedGradients:
    """Every rank holds the whole averaged gradients: torch's own checks on the model."""

    def nonfinite(self, model: nn.Module) -> torch.Tensor:
        return nonfinite(model)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor | float:
        return nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # the norm stays on the device
