"""Checks on gradients every rank holds whole (replicated data parallel): torch's own, on the model.

Both stay on the gradients' device: a training step reads nothing back to the host here (the loop
reads the non-finite flag once, with the step's other figures, a step later)."""

from __future__ import annotations

import torch
from torch import nn

_ONES: dict[torch.device, torch.Tensor] = {}  # the unscale factor of the check, one per device, made once


def nonfinite(model: nn.Module) -> torch.Tensor:
    """1.0 where any gradient holds an inf or NaN, else 0.0: a 0-dim float32 tensor on the
    gradients' device (the CPU when there are none). One fused kernel per dtype, the check
    GradScaler makes (its unscale by 1 leaves every value as it is)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    if any(g.is_sparse for g in grads):
        norms = torch._foreach_norm([g.coalesce().values() if g.is_sparse else g for g in grads])
        return torch.isfinite(torch.stack([n.float() for n in norms])).all().logical_not().float()
    found = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    one = _ONES.get(found.device)
    if one is None:
        one = _ONES[found.device] = torch.ones((), dtype=torch.float32, device=found.device)
    for group in by_dtype.values():
        torch._amp_foreach_non_finite_check_and_unscale_(group, found, one)
    return found


def grads_finite(model: nn.Module) -> bool:
    """Whether every gradient is finite, read on the host (one wait for the device)."""
    return not bool(nonfinite(model))


class ReplicatedGradients:
    """Every rank holds the whole averaged gradients: torch's own checks on the model."""

    def nonfinite(self, model: nn.Module) -> torch.Tensor:
        return nonfinite(model)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor | float:
        return nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # the norm stays on the device
