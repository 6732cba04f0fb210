"""Checks on gradients every rank holds whole (replicated data parallel): torch's own, on the model."""

from __future__ import annotations

import torch
from torch import nn


def grads_finite(model: nn.Module) -> bool:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return True
    norms = torch._foreach_norm(grads)  # one fused pass; a NaN or Inf anywhere shows in its tensor's norm
    return bool(torch.isfinite(torch.stack(norms)).all())


class ReplicatedGradients:
    """Every rank holds the whole averaged gradients: torch's own checks on the model."""

    def grads_finite(self, model: nn.Module) -> bool:
        return grads_finite(model)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> float:
        return float(nn.utils.clip_grad_norm_(model.parameters(), max_norm))
